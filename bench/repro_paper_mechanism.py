"""The failure mechanism of arXiv 2510.04212 on a real training run: the paper's
BF16-accumulating flash attention (numwatch's ``paper_repro`` emulation) against the stabilized
kernel, same seed and data, and the closed loop that swaps the first for the second.

Runs of the GPT of examples/gpt2.py, every attention layer routed by the monitor:

- ``paper_repro``: the emulated failing kernel for the whole run, actions off (what the default
  rules would have said, and when);
- ``stabilized``: numwatch's stabilized kernel for the whole run, actions off (the healthy
  reference: its precursor events are false alarms);
- ``mitigated``: starts on ``paper_repro`` with the default rules acting: a persistent one-signed
  output error or sustained repeated maxima swap the layer to the stabilized kernel;
- ``sdpa``: PyTorch's own SDPA (cuDNN/flash on the GPU), actions off: what the user's native
  kernel does in the same setting (not in the default ``--runs``);
- ``paper_stabilized``: the BF16-accumulating kernel with the stabilizing shift (the paper's fix
  on its own kernel), actions off: whether the ties, or BF16 accumulation by itself, fail the run
  (not in the default ``--runs``).

The synthetic bigram language starts every sequence with a BOS token (an attention sink); a
learning rate near the top of the healthy range keeps logits large, where bf16 scores tie often.
Divergence and lead time are defined in bench/_repro.py.

    python bench/repro_paper_mechanism.py --device cuda --preset small --steps 3000 --batch 32 \\
        --lr 0.01 --out bench/results/repro_paper_mechanism_h200.json
"""

from __future__ import annotations

import argparse

from _repro import add_arguments, run_all


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p, lr=0.01, warmup=20, runs="paper_repro,stabilized,mitigated")
    args = p.parse_args()
    plans = {
        "paper_repro": {"lr": args.lr, "kernel": "paper_repro", "act": False},
        "stabilized": {"lr": args.lr, "kernel": "stabilized", "act": False},
        "mitigated": {"lr": args.lr, "kernel": "paper_repro", "act": True},
        "sdpa": {"lr": args.lr, "kernel": None, "act": False},
        "paper_stabilized": {"lr": args.lr, "kernel": "paper_repro_stabilized", "act": False},
    }
    run_all(args, plans, "paper mechanism: BF16-accumulating flash attention vs stabilized kernel")


if __name__ == "__main__":
    main()
