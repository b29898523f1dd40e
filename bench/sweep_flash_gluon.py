"""Sweep: the Gluon flash-attention forward's launch settings per head dim, against the Triton
forward and cuDNN SDPA on the same calls (one GPU, one process).

For each head dim, T, causal and mode (plain, stabilized) it times the forward through
``flash_attention`` with every candidate ``GluonConfig`` (keys per block, ring slots, consumer
and producer registers, up to how many keys programs are persistent), then the Triton forward
(the Gluon kernel switched off) and cuDNN's forward, and reports each as cuDNN time / ours. bf16,
B*T = 16k tokens, H 16. The defaults in kernels/flash_attention_gluon.py come from this sweep
(session 15:
bench/results/flash_attention_gluon_h200.json and flash_attention_gluon_configs_h200.json came
from its exploratory predecessor, the same timings written against the kernel's launch
arguments before they became GluonConfig). ``--head-dims 64`` sweeps head dim 64, which the
kernel did not serve before session 18 (session 16:
flash_attention_gluon_d64_rejected_h200.json; session 17, with persistent programs:
flash_attention_gluon_d64_persistent_rejected_h200.json). ``--configs`` replaces the
candidates. Usage (Hopper GPU):
    python3 bench/sweep_flash_gluon.py --out results.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_flash_attention import bench_ms, make_inputs
from torch.nn.attention import SDPBackend, sdpa_kernel

from numwatch.kernels import flash_attention_gluon as fag
from numwatch.kernels.flash_attention import flash_attention

CANDIDATES = {
    128: [
        fag.GluonConfig(128, 2),
        fag.GluonConfig(128, 2, persistent_max_t_k=0),
        fag.GluonConfig(64, 2),
        fag.GluonConfig(64, 3),
        fag.GluonConfig(128, 2, 232, 40),
    ],
    # Served since session 18 (plain; stabilized from 8192 keys); these candidates serve every
    # length, so that both modes are compared. Half the shared memory per slot leaves room for
    # deeper rings; 256-key blocks spill.
    64: [
        fag.GluonConfig(128, 2),
        fag.GluonConfig(128, 3),
        fag.GluonConfig(128, 4),
        fag.GluonConfig(64, 2),
        fag.GluonConfig(64, 4),
    ],
}


def measure(d: int, t: int, causal: bool, candidates: list) -> dict:
    """One shape: cuDNN, then each candidate and the Triton forward, per mode."""
    h = 2048 // d
    q, k, v, _ = make_inputs(16384 // t, h, t, d)
    q, k, v = (x.detach() for x in (q, k, v))
    row = {"B": 16384 // t, "H": h, "T": t, "D": d, "causal": causal}
    fag.DEFAULT_CONFIGS.setdefault(d, candidates[0])
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        row["cudnn_ms"] = bench_ms(lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal))  # fmt: skip
    for mode in ("stabilized", "plain"):

        def fwd(mode=mode):
            return flash_attention(q, k, v, is_causal=causal, mode=mode)

        for cfg in candidates:
            fag.CONFIG_OVERRIDES[(d, causal)] = cfg
            try:
                row[f"{mode} {tuple(cfg)}"] = round(row["cudnn_ms"] / bench_ms(fwd), 3)
            except Exception as e:  # recorded; the other candidates still run
                row[f"{mode} {tuple(cfg)}"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            if fag.DISABLED_BY is not None:  # flash_attention fell back to the Triton forward
                row[f"{mode} {tuple(cfg)}"] = f"failed: {fag.DISABLED_BY}"
                fag.ENABLED, fag.DISABLED_BY = True, None  # the next candidate gets its turn
        fag.CONFIG_OVERRIDES.clear()
        fag.ENABLED = False
        try:
            row[f"{mode} triton forward"] = round(row["cudnn_ms"] / bench_ms(fwd), 3)
        finally:
            fag.ENABLED = True
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128], choices=list(CANDIDATES))
    ap.add_argument(
        "--configs", nargs="+", metavar="FIELDS",
        help="candidates instead of CANDIDATES, as comma-separated GluonConfig fields, "
        "e.g. 128,2,240,24,4096 128,2,240,24,0",
    )  # fmt: skip
    args = ap.parse_args()
    if not (fag.AVAILABLE and torch.cuda.get_device_capability()[0] == 9):
        print("skipped: the Gluon forward needs a Hopper GPU and Triton's Gluon Hopper API")
        return
    rows = []
    for d, t, causal in itertools.product(args.head_dims, args.seqs, (False, True)):
        candidates = CANDIDATES[d]
        if args.configs:
            candidates = [fag.GluonConfig(*(int(x) for x in c.split(","))) for c in args.configs]
        rows.append(measure(d, t, causal, candidates))
        print(json.dumps(rows[-1]), flush=True)
    out = {
        "benchmark": "Gluon forward settings per head dim (cuDNN fwd time / ours)",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "config_fields": list(fag.GluonConfig._fields),
        "rows": rows,
    }
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
