"""A/B: the Gluon flash-attention forward of this tree against the one of an earlier revision,
in one process on a Hopper GPU, with cuDNN's forward timed in the same rounds.

A kernel change worth a few percent is smaller than the lease-to-lease spread of the baselines
(bench/README.md), so it is judged against its predecessor in the same process: the old
``kernels/flash_attention_gluon.py`` is read from git (``--against``) and imported as a sibling
module of the package, so that its relative imports resolve to this tree's helpers. Each round
times the old kernel, the new one and cuDNN once (triton.testing.do_bench medians); the report
keeps the median over rounds, the new kernel's speed-up and whether outputs and LSEs are
bitwise equal. Both kernels run with their own default configs (``gluon_forward`` directly,
bypassing ``supports``). Session 18's A/Bs (flash_attention_gluon_qreg_h200.json,
flash_attention_gluon_packed_cvt_h200.json) came from scratch versions of this script.

    python3 bench/ab_flash_gluon.py --against HEAD~1 --out /tmp/ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
import triton
from _revision import import_at_revision  # bench/ is first on sys.path
from bench_flash_attention import bench_ms, make_inputs
from torch.nn.attention import SDPBackend, sdpa_kernel

from numwatch.kernels import flash_attention_gluon as fag


def load_revision(rev: str) -> ModuleType:
    """The Gluon forward as of git revision ``rev``: numwatch.kernels._ab_flash_gluon_old."""
    return import_at_revision(rev, fag, "flash_gluon")


def measure(old: ModuleType, d: int, t: int, causal: bool, rounds: int, ties: bool) -> dict:
    h, b = 2048 // d, 16384 // t
    q, k, v, _ = (x.detach() for x in make_inputs(b, h, t, d))
    if ties:  # every key twice: every row's maximum is repeated (the stabilized worst case)
        k[:, :, 1::2] = k[:, :, 0::2]
    scale = d**-0.5
    row: dict = {"B": b, "H": h, "T": t, "D": d, "causal": causal, "ties": ties}

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    for mode, name in ((1, "stabilized"), (0, "plain")):
        fns = {
            "old": lambda m=mode: old.gluon_forward(q, k, v, causal, scale, m, 2.0),
            "new": lambda m=mode: fag.gluon_forward(q, k, v, causal, scale, m, 2.0),
        }
        (o_old, lse_old), (o_new, lse_new) = fns["old"](), fns["new"]()
        row[f"{name} bitwise"] = bool(torch.equal(o_old, o_new) and torch.equal(lse_old, lse_new))
        times: dict[str, list[float]] = {"old": [], "new": [], "cudnn": []}
        for _ in range(rounds):
            for key, fn in fns.items():
                times[key].append(bench_ms(fn))
            times["cudnn"].append(bench_ms(cudnn))
        med = {key: statistics.median(x) for key, x in times.items()}
        for key in ("old", "new", "cudnn"):
            row[f"{name} {key}_ms"] = round(med[key], 4)
        for key in ("old", "new"):
            row[f"{name} {key}_vs_cudnn"] = round(med["cudnn"] / med[key], 3)
        row[f"{name} new_speedup_pct"] = round(100 * (med["old"] / med["new"] - 1), 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", required=True, help="git revision of the old kernel")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dims", type=int, nargs="+", default=[128])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ties", action="store_true", help="also time every key repeated twice")
    args = ap.parse_args()
    if not (fag.AVAILABLE and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] == 9):  # fmt: skip
        print("skipped: the Gluon forward needs a Hopper GPU and Triton's Gluon Hopper API")
        return
    old = load_revision(args.against)
    rows = []
    for d in args.dims:
        for t in args.seqs:
            for causal in (False, True):
                for ties in (False, True) if args.ties else (False,):
                    rows.append(measure(old, d, t, causal, args.rounds, ties))
                    print(json.dumps(rows[-1]), flush=True)
    report = {
        "benchmark": f"Gluon forward: this tree against {args.against} (same process)",
        "note": f"bf16, B*T 16k tokens, H*D 2048, q/k/v ~ N(0,1); medians of {args.rounds} "
        "rounds, each timing old, new and cuDNN once; *_vs_cudnn = cuDNN time / ours",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
