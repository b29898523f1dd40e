"""A/B: the attention statistics of this tree against those of an earlier revision, in one
process on a GPU, as bench_attention_stats.py times them (the kernel launch plus the per-block
reduction in torch).

Lease-to-lease spread hides changes of a few percent, and a slower rerun does not tell a slower
lease from slower code, so the old ``kernels/attention_stats.py`` is read from git
(``--against``) and imported as a sibling module of the package (its relative imports resolve
to this tree's helpers). Each case runs both versions with the same tile config; the rounds
alternate which goes first; the report keeps the best time of each and whether the partials are
bitwise equal. Session 20's attention_stats_sync_regression_ab_h200.json came from a scratch
version of this script (--against 9fdd857, the commit of attention_stats.json).

    python3 bench/ab_attention_stats.py --against 9fdd857 --out /tmp/ab_stats.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import ModuleType

import torch
import triton
from _revision import import_at_revision  # bench/ is first on sys.path
from bench_attention_stats import THR, bench_ms, make_inputs

from numwatch.kernels import attention_stats as A

# (head dim, causal, tile config): the configs attention_stats.json's autotuner chose
CASES = [
    (128, False, (64, 128, 4, 3)),
    (128, True, (64, 64, 4, 3)),
    (64, False, (64, 128, 4, 2, 128)),
    (64, True, (64, 128, 4, 2, 128)),
]


def measure(old: ModuleType, d: int, causal: bool, cfg: tuple, entropy: bool, rounds: int) -> dict:
    q, k, _ = make_inputs(4, 16, 4096, d)  # the shapes of bench_attention_stats.py
    scale = 1.0 / math.sqrt(d)
    fns = {
        name: (
            lambda mod=mod: mod._head_stats_triton(
                q, k, None, causal, scale, None, None, THR, entropy, cfg
            )
        )
        for name, mod in (("old", old), ("new", A))
    }
    row: dict = {"B": 4, "H": 16, "T": 4096, "D": d, "causal": causal, "config": list(cfg)}
    row["bitwise"] = bool(torch.equal(fns["old"](), fns["new"]()))
    times: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(rounds):
        for key in ("old", "new") if r % 2 == 0 else ("new", "old"):
            times[key].append(round(bench_ms(fns[key]), 4))
    row.update({f"{key}_ms": x for key, x in times.items()})
    row["new_over_old"] = round(min(times["new"]) / min(times["old"]), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", required=True, help="git revision of the old statistics")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--entropy", action="store_true", help="time the entropy variant")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: the A/B times the compiled kernel on a GPU")
        return
    old = import_at_revision(args.against, A, "attention_stats")
    rows = []
    for d, causal, cfg in CASES:
        rows.append(measure(old, d, causal, cfg, args.entropy, args.rounds))
        print(json.dumps(rows[-1]), flush=True)
    report = {
        "benchmark": f"attention statistics: this tree against {args.against} (same process)",
        "note": f"bf16 q, k ~ N(0,1), every row, entropy {args.entropy}; {args.rounds} rounds "
        "alternating which version goes first; new_over_old = best new / best old time",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
