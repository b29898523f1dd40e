"""The failure mechanism of arXiv 2510.04212 on a real training run: the paper's
BF16-accumulating flash attention (numwatch's ``paper_repro`` emulation) against the stabilized
kernel, same seed and data, and the closed loop that swaps the first for the second.

Runs of the GPT of examples/gpt2.py, every attention layer routed by the monitor:

- ``paper_repro``: the emulated failing kernel for the whole run, actions off (what the default
  rules would have said, and when);
- ``stabilized``: numwatch's stabilized kernel for the whole run, actions off (the healthy
  reference: its precursor events are false alarms);
- ``mitigated``: starts on ``paper_repro`` with the default rules acting: a persistent one-signed
  output error or sustained repeated maxima swap the layer to the stabilized kernel.

The synthetic bigram language starts every sequence with a BOS token (an attention sink); a
learning rate near the top of the healthy range keeps logits large, where bf16 scores tie often.
Divergence and lead time are defined in bench/_repro.py.

    python bench/repro_paper_mechanism.py --device cuda --preset small --steps 3000 --batch 32 \\
        --lr 0.01 --out bench/results/repro_paper_mechanism_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _repro import DIVERGENCE, Setting, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--settle", type=int, default=20)
    p.add_argument("--flush-every", type=int, default=10)
    p.add_argument("--max-seconds", type=float, default=300.0, help="per run")
    p.add_argument("--runs", default="paper_repro,stabilized,mitigated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    out = Path(args.out)
    logdir = out.with_suffix("")
    logdir.mkdir(parents=True, exist_ok=True)
    s = Setting(
        device=args.device,
        preset=args.preset,
        batch=args.batch,
        steps=args.steps,
        warmup=args.warmup,
        settle=args.settle,
        seed=args.seed,
        flush_every=args.flush_every,
        max_seconds=args.max_seconds,
        logdir=logdir,
    )
    plans = {
        "paper_repro": {"kernel": "paper_repro", "act": False},
        "stabilized": {"kernel": "stabilized", "act": False},
        "mitigated": {"kernel": "paper_repro", "act": True},
    }
    report = {
        "benchmark": "paper mechanism: BF16-accumulating flash attention vs stabilized kernel",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "settings": vars(args),
        "divergence_definition": DIVERGENCE,
        "runs": {},
    }
    for name in args.runs.split(","):
        report["runs"][name] = run(name, s, lr=args.lr, **plans[name])
        out.write_text(json.dumps(report, indent=2))  # after every run: partial results survive


if __name__ == "__main__":
    main()
