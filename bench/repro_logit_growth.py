"""Attention-logit-growth divergence (Wortsman et al. 2023) and a spike-prone short warm-up:
how early numwatch warns, its false alarms, and whether mitigation driven by its rules saves
the run.

Runs of the GPT of examples/gpt2.py (no QK-norm), same seed and data:

- ``control``: a safe learning rate; numwatch's default rules report (actions off): every
  precursor/spike event here is a false alarm;
- ``unstable``: a high learning rate with a short warm-up, actions off;
- ``mitigated``: the same, with the default rules acting plus the scenario's mitigation rules:
  ``--mitigation qk_clip`` adds attn_max_logit > tau -> QK-clip of that head's W_Q/W_K rows
  (Kimi K2); ``--mitigation spike`` adds skip_step + lr_backoff on gradient-norm and loss
  z-score spikes (OLMo-style spike skipping); ``--mitigation loss_rise`` adds an LR back-off
  (x0.5 for 500 steps) on the default ``loss_rise`` condition (loss > 2x its median of the
  last 20 flushes): a reaction to the loss itself, for runs where no precursor is known.

Divergence and lead time are defined in bench/_repro.py.

    python bench/repro_logit_growth.py --device cuda --preset small --steps 3000 --batch 32 \\
        --lr 0.1 --warmup 20 --out bench/results/repro_logit_growth_h200.json
    python bench/repro_logit_growth.py --device cuda --preset small --steps 2000 --batch 32 \\
        --lr 0.02 --warmup 1 --mitigation spike --out bench/results/repro_spike_h200.json
    python bench/repro_logit_growth.py --device cpu --preset tiny --steps 400 --lr 0.05 \\
        --out bench/results/repro_logit_growth_cpu.json           # a CPU-scale analogue
"""

from __future__ import annotations

import argparse

from _repro import add_arguments, run_all


def mitigation_rules(kind: str, tau: float) -> list[dict]:
    if kind == "qk_clip":
        return [
            {
                "type": "threshold",
                "name": "qk_clip_logits",
                "metric": "attn_max_logit",
                "threshold": tau,
                "actions": [{"type": "qk_clip", "tau": tau}],
            }
        ]
    if kind == "loss_rise":
        return [
            {
                "type": "growth",
                "name": "loss_rise_backoff",
                "metric": "loss",
                "factor": 2.0,
                "window": 20,
                "kind": "spike",
                "actions": [{"type": "lr_backoff", "factor": 0.5, "steps": 500}],
            }
        ]
    spike_actions = ["skip_step", {"type": "lr_backoff", "factor": 0.5, "steps": 100}]
    return [
        {
            "type": "zscore",
            "name": f"{metric}_spike_skip",
            "metric": metric,
            "sigma": 6.0,
            "window": 50,
            "actions": spike_actions,
        }
        for metric in ("grad_norm", "loss")
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p, lr=0.05, warmup=5, runs="control,unstable,mitigated")
    p.add_argument("--safe-lr", type=float, default=1e-3)
    p.add_argument("--mitigation", choices=("qk_clip", "spike", "loss_rise"), default="qk_clip")
    p.add_argument("--tau", type=float, default=100.0)
    args = p.parse_args()
    plans = {
        "control": {"lr": args.safe_lr, "act": False},
        "unstable": {"lr": args.lr, "act": False},
        "mitigated": {
            "lr": args.lr,
            "act": True,
            "add_rules": mitigation_rules(args.mitigation, args.tau),
        },
    }
    run_all(args, plans, "instability reproduction: warning lead time, false alarms, mitigation")


if __name__ == "__main__":
    main()
