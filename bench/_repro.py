"""Shared harness of the instability reproductions: one monitored training run of the GPT of
examples/gpt2.py, its divergence step, its first warning and its outcome.

Divergence (issue 9's definition): the first step, after ``settle`` steps, whose loss is
non-finite or more than twice the median of the previous 50 losses. Lead time = divergence step
- step of the first precursor/spike/nonfinite event under the default rules.

Regression: the first step at which the mean loss of the last 100 steps is 10 % above the lowest
such mean reached before it. It catches the failure the 2x rule cannot see: a run whose loss climbs
back and stays up without a jump or a non-finite value (the BF16-accumulating kernel's at
GPT-2-small scale on the H200: the loss rises from 5.3 to 6 and never recovers).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt2 import (
    BURST_EVERY,
    BURST_LEN,
    GPT,
    PRESETS,
    GPTConfig,
    batches,
    is_burst,
    lr_at,
    train_step,
)

import numwatch
from numwatch.events import Event

WARN_KINDS = ("precursor", "spike", "nonfinite")
REGRESSION = (
    "first step at which the mean loss of the last 100 steps is more than 10% above the lowest "
    "100-step mean reached before it"
)
_REGRESSION_WINDOW, _REGRESSION_MARGIN = 100, 1.10
DIVERGENCE = (
    "first step after the settle steps with a non-finite loss or a loss above 2x the median of "
    "the previous 50"
)


def divergence_step(losses: list[float], settle: int) -> int | None:
    for t in range(settle, len(losses)):
        window = [v for v in losses[max(0, t - 50) : t] if math.isfinite(v)]
        if not math.isfinite(losses[t]) or (window and losses[t] > 2 * statistics.median(window)):
            return t
    return None


def regression_step(losses: list[float]) -> int | None:
    """First step whose trailing 100-step mean exceeds the best earlier one by 10 % (a non-finite
    loss makes its windows' means +inf, so a run that diverges after step 100 also regresses)."""
    w = _REGRESSION_WINDOW
    best = math.inf
    for t in range(w - 1, len(losses)):
        window = losses[t - w + 1 : t + 1]
        mean = math.fsum(window) / w if all(map(math.isfinite, window)) else math.inf
        if mean > _REGRESSION_MARGIN * best:
            return t
        best = min(best, mean)
    return None


@dataclass
class Setting:
    """What every run of one reproduction shares."""

    device: str
    preset: str
    batch: int
    steps: int
    warmup: int
    settle: int = 20
    seed: int = 0
    flush_every: int = 10
    data: str = "bigram"  # examples/gpt2.py's --data
    pos_emb: bool = True  # False: NoPE (examples/gpt2.py's --no-pos-emb)
    qk_norm: bool = False  # LayerNorm on q and k per head (no attention-logit growth)
    beta2: float = 0.95  # AdamW's second-moment decay (0.999: slow to follow a gradient burst)
    eps: float = 1e-8  # AdamW's epsilon
    clip: float = 1.0  # gradient-norm clipping (0: none)
    max_seconds: float = 300.0  # a run stops here (recorded), so a whole batch fits a GPU call
    logdir: Path = field(default_factory=lambda: Path("."))


def run(
    name: str,
    s: Setting,
    *,
    lr: float,
    act: bool,
    add_rules: list[dict[str, Any]] | None = None,
    kernel: str | None = None,
) -> dict[str, Any]:
    """Train one run and summarize it. ``kernel``: route every attention layer to numwatch's
    kernel in this mode ('paper_repro' or 'stabilized') from the first step; None = SDPA."""
    torch.manual_seed(s.seed)
    cfg = GPTConfig(**{**PRESETS[s.preset].__dict__, "pos_emb": s.pos_emb, "qk_norm": s.qk_norm})
    model = GPT(cfg).to(s.device)
    fused = s.device.startswith("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, s.beta2), eps=s.eps, fused=fused)
    rules: dict[str, Any] = {"act": act}
    if add_rules:
        rules["add"] = add_rules
    log = s.logdir / f"{name}.jsonl"
    log.unlink(missing_ok=True)
    monitor = numwatch.Monitor(
        model,
        run_name=name,
        flush_every=s.flush_every,
        attention__every=s.flush_every,
        activations__every=s.flush_every,
        weights__every=s.flush_every,
        optimizer__every=s.flush_every,
        rules=rules,
        sinks__console__enabled=False,
        sinks__jsonl__path=str(log),
    ).attach(opt)
    if kernel is not None:
        monitor.swap_attention(stabilize=kernel == "stabilized", mode=kernel)
    data = batches(cfg, s.batch, s.data, s.seed, s.device)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(s.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=lr, warmup=s.warmup, total=s.steps)
        loss = train_step(model, opt, *next(data), monitor, clip=s.clip)
        losses.append(loss.item())  # the benchmark's own per-step record, not numwatch's
        if time.perf_counter() - start > s.max_seconds:
            break
    seconds = time.perf_counter() - start
    monitor.detach()
    events = monitor.events
    warn = [e for e in events if e.kind in WARN_KINDS]
    max_logits = [r.value for snap in monitor.history for r in snap.series("attn_max_logit")]
    # with --data bursts the loss of a repeated-n-gram batch is another language's: divergence and
    # regression are read on the ordinary batches alone (a spike is damage that outlasts a burst)
    normal = [t for t in range(len(losses)) if not (s.data == "bursts" and is_burst(t))]
    normal_losses = [losses[t] for t in normal]
    div = _at(normal, divergence_step(normal_losses, s.settle))
    regressed = _at(normal, regression_step(normal_losses))
    first = warn[0] if warn else None
    first_of = {}
    for e in warn:
        first_of.setdefault(e.rule, e.step)
    with log.open("rb") as f, gzip.open(f"{log}.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    log.unlink()
    finite = [v for v in losses if math.isfinite(v)]
    summary = {
        "lr": lr,
        "kernel": kernel or "sdpa",
        "actions": act,
        "added_rules": [r["name"] for r in add_rules or []],
        "steps_run": len(losses),
        "seconds": seconds,
        "divergence_step": div,
        "first_warning_step": first.step if first else None,
        "first_warning_rule": first.rule if first else None,
        "lead_steps": (div - first.step) if (div is not None and first) else None,
        "regression_step": regressed,
        "first_warning_step_by_rule": first_of,
        "warnings": len(warn),
        "warning_rules": sorted({e.rule for e in warn}),
        "actions_taken": sum(e.kind == "action" for e in events),
        "action_kinds": sorted(
            {e.evidence.get("action", "") for e in events if e.kind == "action"}
        ),
        "first_action_step": next((e.step for e in events if e.kind == "action"), None),
        "skipped_steps": skipped_steps(events),
        "min_loss": min(finite, default=None),
        "final_loss_mean_last_50": statistics.fmean(
            [v for v in losses[-50:] if math.isfinite(v)] or [math.nan]
        ),
        "nonfinite_losses": sum(not math.isfinite(v) for v in losses),
        "max_attn_logit_last_flushes": max(max_logits, default=None),
        "log": f"{log.name}.gz",
        "loss_every_10_steps": [
            round(statistics.fmean(losses[i : i + 10]), 4) for i in range(0, len(losses), 10)
        ],
    }
    if s.data == "bursts":
        summary["bursts"] = burst_effects(losses)
    print(name, summary, flush=True)
    return summary


def skipped_steps(events: list[Event]) -> list[int]:
    """Steps whose optimizer update a skip_step action dropped."""
    return sorted(
        {e.step for e in events if e.kind == "action" and e.evidence["action"] == "skip_step"}
    )


def _at(steps: list[int], index: int | None) -> int | None:
    return None if index is None else steps[index]


def burst_effects(losses: list[float]) -> list[dict[str, Any]]:
    """Per burst: its own losses, and the worst ordinary-batch loss in the 50 steps after it
    against the median of the 50 ordinary steps before it (the spike the burst caused)."""
    out = []
    for b in range(BURST_EVERY, len(losses) - BURST_LEN, BURST_EVERY):
        before = [v for v in losses[b - 50 : b] if math.isfinite(v)]
        after = losses[b + BURST_LEN : b + BURST_LEN + 50]
        worst = max(after, key=lambda v: v if math.isfinite(v) else math.inf)
        base = statistics.median(before) if before else math.nan
        out.append(
            {
                "step": b,
                "burst_losses": [round(v, 4) for v in losses[b : b + BURST_LEN]],
                "median_before": round(base, 4),
                "max_after": round(worst, 4),
                "max_after_step": b + BURST_LEN + after.index(worst),
                "spike_ratio": round(worst / base, 3) if base else None,
            }
        )
    return out


def add_arguments(p: argparse.ArgumentParser, *, lr: float, warmup: int, runs: str) -> None:
    """The options every reproduction takes (a CPU-scale setting by default)."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--settle", type=int, default=20)
    p.add_argument("--flush-every", type=int, default=10)
    p.add_argument("--data", choices=("bigram", "sinks", "bursts"), default="bigram")
    p.add_argument("--no-pos-emb", action="store_true", help="NoPE model")
    p.add_argument("--qk-norm", action="store_true", help="LayerNorm on each head's q and k")
    p.add_argument("--beta2", type=float, default=0.95, help="AdamW beta2")
    p.add_argument("--eps", type=float, default=1e-8, help="AdamW epsilon")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: none)")
    p.add_argument("--max-seconds", type=float, default=300.0, help="per run")
    p.add_argument("--runs", default=runs)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)


def run_all(args: argparse.Namespace, plans: dict[str, dict[str, Any]], benchmark: str) -> None:
    """Train the runs named by ``--runs`` (keyword arguments of ``run`` in ``plans``) and write
    the report after every run, so partial results survive a time limit."""
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
        data=args.data,
        pos_emb=not args.no_pos_emb,
        qk_norm=args.qk_norm,
        beta2=args.beta2,
        eps=args.eps,
        clip=args.clip,
        max_seconds=args.max_seconds,
        logdir=logdir,
    )
    report: dict[str, Any] = {
        "benchmark": benchmark,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "settings": vars(args),
        "divergence_definition": DIVERGENCE,
        "regression_definition": REGRESSION,
        "runs": {},
    }
    for name in args.runs.split(","):
        report["runs"][name] = run(name, s, **plans[name])
        out.write_text(json.dumps(report, indent=2))
