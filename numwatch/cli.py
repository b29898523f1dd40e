"""The `numwatch` command: `numwatch demo` (more subcommands join as features land)."""

from __future__ import annotations

import sys

__all__ = ["main"]

USAGE = """usage: numwatch <command> [options]

commands:
  demo      train a small GPT on synthetic data with the monitor attached
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from numwatch.demo import main as demo

        return demo(rest)
    print(f"numwatch: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
