"""Archive a run log for bench/results: the series the default rules read plus the run-level ones,
recompressed with xz.

Why: the lent GPU machine takes the tracked tree only up to 64 MiB, and full logs of the
reproductions (every gradient, activation and head statistic at every flush) passed that in
session 13. What stays is what `numwatch replay` of the default rules and the README's tables
read; the `numwatch report` pages are made from the full logs first (bench/run_all.sh), and the
full logs of the runs before the thinning are in git history (bench/README).

    python bench/archive_log.py RUN.jsonl.gz RUN.jsonl.xz
"""

from __future__ import annotations

import argparse
import json
import lzma
from pathlib import Path

from numwatch.rules import default_rules
from numwatch.sinks.jsonl import open_log

# besides the rules' inputs: the series the reproductions' summaries and tables quote
RUN_LEVEL = {
    "grad_norm_max",
    "loss_max",
    "loss_mean",
    "step_seconds",
    "monitor_overhead_seconds",
    "monitor_errors_total",
    "events_total",
    "attn_kernel_stabilized",
    "optimizer_lr",
    "weight_spectral_norm",
}


def kept_metrics() -> set[str]:
    return {r.metric for r in default_rules()} | RUN_LEVEL


def archive(src: Path, dst: Path) -> None:
    keep = kept_metrics()
    with open_log(src) as fi, lzma.open(dst, "wt", preset=9 | lzma.PRESET_EXTREME) as fo:
        for line in fi:
            if not line.strip():
                continue
            record = json.loads(line)
            record["metrics"] = [
                m
                for m in record["metrics"]
                if m["name"] in keep or m["name"].startswith("mitigation_")
            ]
            fo.write(json.dumps(record) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="a JSONL log (.jsonl, .gz or .xz)")
    p.add_argument("dst", type=Path, help="the archived log (.jsonl.xz)")
    args = p.parse_args()
    archive(args.src, args.dst)


if __name__ == "__main__":
    main()
