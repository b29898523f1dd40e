"""Attention-logit-growth divergence (Wortsman et al. 2023): how early numwatch warns, and
whether QK-clip driven by its precursor saves the run.

Three runs of the GPT of examples/gpt2.py (no QK-norm), same seed and data:

- ``control``: a safe learning rate; numwatch's default rules report (actions off): every
  precursor/spike event here is a false alarm;
- ``unstable``: a high learning rate with a very short warm-up, actions off;
- ``mitigated``: the same high learning rate, with the default rules plus a QK-clip rule
  (attn_max_logit > tau -> rescale that head's W_Q/W_K rows, Kimi K2 style).

Divergence (the issue's definition): the first step, after ``--settle`` steps, whose loss is
non-finite or more than twice the median of the previous 50 losses. Lead time = divergence
step - step of the first precursor/spike/nonfinite event under the default rules.

    python bench/repro_logit_growth.py --device cuda --preset small --steps 3000 --lr 0.03 \\
        --out bench/results/repro_logit_growth_h200.json          # the H200 setting
    python bench/repro_logit_growth.py --device cpu --preset tiny --steps 400 --lr 0.3 \\
        --out bench/results/repro_logit_growth_cpu.json           # a CPU-scale analogue
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt2 import GPT, PRESETS, GPTConfig, batches, lr_at, train_step

import numwatch

WARN_KINDS = ("precursor", "spike", "nonfinite")


def divergence_step(losses: list[float], settle: int) -> int | None:
    for t in range(settle, len(losses)):
        window = [v for v in losses[max(0, t - 50) : t] if math.isfinite(v)]
        if not math.isfinite(losses[t]) or (window and losses[t] > 2 * statistics.median(window)):
            return t
    return None


def run(name: str, args: argparse.Namespace, lr: float, act: bool, clip: bool, logdir: Path):
    torch.manual_seed(args.seed)
    cfg = GPTConfig(**{**PRESETS[args.preset].__dict__})
    model = GPT(cfg).to(args.device)
    fused = args.device.startswith("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), fused=fused)
    rules: dict = {"act": act}
    if clip:
        rules["add"] = [
            {
                "type": "threshold",
                "name": "qk_clip_logits",
                "metric": "attn_max_logit",
                "threshold": args.tau,
                "actions": [{"type": "qk_clip", "tau": args.tau}],
            }
        ]
    log = logdir / f"{name}.jsonl"
    log.unlink(missing_ok=True)
    monitor = numwatch.Monitor(
        model,
        run_name=name,
        flush_every=args.flush_every,
        attention__every=args.flush_every,
        activations__every=args.flush_every,
        weights__every=args.flush_every,
        optimizer__every=args.flush_every,
        rules=rules,
        sinks__console__enabled=False,
        sinks__jsonl__path=str(log),
    ).attach(opt)
    data = batches(cfg, args.batch, "bigram", args.seed, args.device)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=lr, warmup=args.warmup, total=args.steps)
        loss = train_step(model, opt, *next(data), monitor)
        losses.append(loss.item())  # the benchmark's own per-step record, not numwatch's
    seconds = time.perf_counter() - start
    monitor.detach()
    events = monitor.events
    warn = [e for e in events if e.kind in WARN_KINDS]
    max_logits = [
        r.value for s in monitor.history for r in s.series("attn_max_logit")
    ]  # last flushes only; the JSONL has all
    div = divergence_step(losses, args.settle)
    first = warn[0] if warn else None
    with log.open("rb") as f, gzip.open(f"{log}.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    log.unlink()
    return {
        "lr": lr,
        "actions": act,
        "qk_clip_rule": clip,
        "seconds": seconds,
        "divergence_step": div,
        "first_warning_step": first.step if first else None,
        "first_warning_rule": first.rule if first else None,
        "lead_steps": (div - first.step) if (div is not None and first) else None,
        "warnings": len(warn),
        "warning_rules": sorted({e.rule for e in warn}),
        "actions_taken": sum(e.kind == "action" for e in events),
        "final_loss_mean_last_50": statistics.fmean(
            [v for v in losses[-50:] if math.isfinite(v)] or [math.nan]
        ),
        "nonfinite_losses": sum(not math.isfinite(v) for v in losses),
        "max_attn_logit_last_flushes": max(max_logits, default=None),
        "log": f"{log.name}.gz",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--safe-lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--settle", type=int, default=20)
    p.add_argument("--tau", type=float, default=100.0)
    p.add_argument("--flush-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    out = Path(args.out)
    logdir = out.with_suffix("")
    logdir.mkdir(parents=True, exist_ok=True)
    runs = {
        "control": run("control", args, args.safe_lr, act=False, clip=False, logdir=logdir),
        "unstable": run("unstable", args, args.lr, act=False, clip=False, logdir=logdir),
        "mitigated": run("mitigated", args, args.lr, act=True, clip=True, logdir=logdir),
    }
    for name, r in runs.items():
        print(name, json.dumps(r))
    report = {
        "benchmark": "attention-logit-growth divergence: warning lead time and QK-clip",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "settings": vars(args),
        "divergence_definition": "first step after --settle with a non-finite loss or a loss "
        "above 2x the median of the previous 50",
        "runs": runs,
    }
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
