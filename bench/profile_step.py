"""Where a monitored training step's extra time goes: host time of ``monitor.step`` and of the
whole step, device time of the monitor's kernels, and the monitor's hot Python functions.

For one configuration at a time (no numwatch, the defaults, gradients only, or one sampled probe
or the flush every step: what one sampled step of the defaults costs), on GPT-2 (or a smaller
preset) with the training step of examples/gpt2.py:

- ``step_ms``: wall time of one step between two device syncs (what bench_overhead times);
- ``baseline_step_ms``: the same without numwatch, timed right before the configuration, and
  ``extra_ms``, the configuration's step minus it (medians);
- ``host_step_ms``: host time to issue the step (no sync at its end): when it approaches
  ``step_ms`` the host, not the GPU, sets the pace and every host microsecond counts;
- ``monitor_step_host_ms``: host time inside ``monitor.step``;
- ``table_builds``: tensor_stats pointer tables built during the timed steps (a build is host
  work that should happen once, not per step);
- for the configurations named by ``--cprofile``: cProfile of the whole step, cProfile of
  ``monitor.step`` alone, and the torch profiler's host-time table go to ``<out>.profiles.txt``.

    python bench/profile_step.py --out bench/results/profile_step_h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt2 import GPT, PRESETS, train_step

import numwatch
from numwatch.kernels import tensor_stats as ts

_SAMPLED_OFF = {
    "activations__enabled": False,
    "attention__enabled": False,
    "weights__enabled": False,
    "optimizer__enabled": False,
}
CONFIGS = {
    "baseline": None,
    "default": {},
    "gradients_only": _SAMPLED_OFF,
    # what one sampled step (or one flush) of the defaults costs, every step
    "flush_every_step": {**_SAMPLED_OFF, "flush_every": 1},
    "attention_every_step": {**_SAMPLED_OFF, "attention__enabled": True, "attention__every": 1},
    "activations_every_step": {
        **_SAMPLED_OFF,
        "activations__enabled": True,
        "activations__every": 1,
    },
    "weights_every_step": {**_SAMPLED_OFF, "weights__enabled": True, "weights__every": 1},
    "optimizer_every_step": {**_SAMPLED_OFF, "optimizer__enabled": True, "optimizer__every": 1},
    # every sampled probe at once, no flush: the sampled step of the defaults without its flush
    "sampled_every_step": {
        "activations__every": 1,
        "attention__every": 1,
        "weights__every": 1,
        "optimizer__every": 1,
    },
    # a sampled step of the defaults as it happens: every probe and the flush at once
    "everything_every_step": {
        "flush_every": 1,
        "activations__every": 1,
        "attention__every": 1,
        "weights__every": 1,
        "optimizer__every": 1,
    },
}


def profile_views(step, monitor, real_step, steps: int, sync, on_cuda: bool) -> str:
    """Three views of ``steps`` monitored steps: cProfile of the whole step (cumulative, own),
    cProfile of ``monitor.step`` alone (cumulative), and the torch profiler's table by host
    time (what a host-bound step pays) with device times beside it."""
    parts = []
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    sync()
    prof.disable()
    for order, lines in (("cumulative", 70), ("tottime", 30)):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(lines)
        parts.append(f"--- whole step, cProfile by {order} time\n" + text.getvalue())
    inner = cProfile.Profile()
    monitor.step = functools.partial(inner.runcall, real_step)
    for _ in range(steps):
        step()
    sync()
    text = io.StringIO()
    pstats.Stats(inner, stream=text).sort_stats("cumulative").print_stats(50)
    parts.append("--- monitor.step, cProfile cumulative\n" + text.getvalue())
    acts = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as tp:
        for _ in range(5):
            step()
        sync()
    table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)
    parts.append("--- torch profiler, 5 steps, by self host time\n" + table)
    return "\n".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    p.add_argument(
        "--cprofile",
        default="default",
        help="configs whose monitor.step gets a cumulative cProfile (comma-separated)",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    device = args.device
    on_cuda = torch.device(device).type == "cuda"

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    torch.manual_seed(0)
    cfg = PRESETS[args.preset]
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=on_cuda)
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), device=device)
    y = torch.roll(x, -1, 1)

    builds = 0
    build_plan = ts._build_plan

    def counting_build(*a, **k):
        nonlocal builds
        builds += 1
        return build_plan(*a, **k)

    ts._build_plan = counting_build

    def attach(name: str) -> tuple[numwatch.Monitor | None, list[float], Any]:
        """The configuration's monitor, with monitor.step timed into the returned list."""
        spec = CONFIGS[name]
        if spec is None:
            return None, [], None
        monitor = numwatch.Monitor(
            model,
            sinks__console__enabled=False,
            sinks__jsonl__path=str(out.with_suffix(f".{name}.jsonl")),
            **{"flush_every": 10_000, **spec},  # by default no flush in the window
        ).attach(opt)
        inner: list[float] = []
        real_step = monitor.step

        def timed_step(loss=None, _real=real_step, _inner=inner):
            t = time.perf_counter()
            _real(loss)
            _inner.append(time.perf_counter() - t)

        monitor.step = timed_step
        return monitor, inner, real_step

    def timed(monitor: numwatch.Monitor | None) -> tuple[list[float], list[float]]:
        wall, host = [], []
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            train_step(model, opt, x, y, monitor)
            t1 = time.perf_counter()
            sync()
            wall.append(time.perf_counter() - t0)
            host.append(t1 - t0)
        return wall, host

    # Timing first, every configuration right after a baseline block of its own (extra_ms is
    # the difference): the host's and the GPU's pace drift over a process, and profiling leaves
    # state behind, so neither the order of the configurations nor the profiles below may
    # enter the figures (they did: an earlier version measured one configuration at +20.8 and
    # +3.7 ms in two runs that differed in what ran before it).
    results = {}
    for name in args.configs.split(","):
        for _ in range(5):
            train_step(model, opt, x, y, None)
        base_wall, _ = timed(None)
        monitor, inner, _ = attach(name)
        for _ in range(5):
            train_step(model, opt, x, y, monitor)
        sync()
        inner.clear()
        builds = 0
        wall, host = timed(monitor)
        results[name] = {
            "step_ms": statistics.median(wall) * 1e3,
            "baseline_step_ms": statistics.median(base_wall) * 1e3,
            "extra_ms": (statistics.median(wall) - statistics.median(base_wall)) * 1e3,
            "host_step_ms": statistics.median(host) * 1e3,
            "monitor_step_host_ms": statistics.median(inner) * 1e3 if inner else None,
            "table_builds": builds,
        }
        print(name, json.dumps(results[name]), flush=True)
        if monitor is not None:
            monitor.detach()
    texts = []
    for name in args.cprofile.split(","):
        if CONFIGS.get(name) is None:
            continue
        monitor, _, real_step = attach(name)
        for _ in range(5):
            train_step(model, opt, x, y, monitor)
        texts.append(
            f"===== {name}\n"
            + profile_views(
                functools.partial(train_step, model, opt, x, y, monitor),
                monitor,
                real_step,
                args.steps,
                sync,
                on_cuda,
            )
        )
        monitor.detach()
    ts._build_plan = build_plan
    if texts:
        out.with_suffix(".profiles.txt").write_text("\n".join(texts))
    report = {
        "benchmark": "where a monitored step's time goes",
        "gpu": torch.cuda.get_device_name() if on_cuda else "cpu",
        "torch": torch.__version__,
        "model": args.preset,
        "batch": args.batch,
        "steps": args.steps,
        "results": results,
    }
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
