"""The `numwatch` command (also `python -m numwatch`): demo, report, tail, replay."""

from __future__ import annotations

import argparse
import sys

__all__ = ["count", "main", "seconds"]

USAGE = """usage: numwatch <command> [options]

commands:
  demo      train a small GPT on synthetic data with the monitor attached
  report    write an HTML report (plots, events, heads) of a JSONL run log
  tail      follow a JSONL run log in the terminal
  replay    run a rules configuration over a JSONL run log (which events, at which steps)
"""


def count(text: str) -> int:
    """argparse type of a count option (``tail -n``, ``replay --limit``): an int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def seconds(text: str) -> float:
    """argparse type of a duration option (``tail --interval``): a float in (0, 1 day]
    (``inf`` passed, then time.sleep raised OverflowError)."""
    value = float(text)
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"must be > 0 and at most 86400 seconds, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from numwatch.demo import main as demo

        return demo(rest)
    if command == "report":
        from numwatch.sinks.report import main as report

        return report(rest)
    if command == "tail":
        from numwatch.sinks.tail import main as tail

        return tail(rest)
    if command == "replay":
        from numwatch.replay import main as replay

        return replay(rest)
    print(f"numwatch: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
