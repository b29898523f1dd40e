"""Monitor overhead on a GPT-2-124M bf16 training step, against the same loop without it.

Configurations alternate in one process (rounds x configs), every step is timed between two
device syncs, and each configuration reports the median and the mean over all its timed steps
(the median as the issues ask; the mean includes the steps that sample probes or flush), and the
overhead of each round's median against the baseline block of the same round (their median and
spread: the machine's drift cancels, and the spread says how far a figure can be trusted), and
the host time to issue a step (before the closing sync), whose difference to the baseline is the
monitor's host cost per step, and ``by_phase``: the mean excess over the paired baseline step of
the steps that flushed, of those that sampled an every-N probe, and of the others, with each
kind's share of the mean overhead (the mean is what a run pays; the median sees ordinary steps):

- ``baseline``: no numwatch;
- ``default``: numwatch with its default configuration;
- ``default_flush_every_1``: the same, flushing (reading the device) every step;
- ``every_10``: the defaults with every sampled probe and the flush every 10 steps (instead of
  50);
- ``default_skip_step``: the defaults plus skip_step on non-finite gradients, whose decision
  reads two scalars from the device every step (the cost issue 6 asks to state);
- ``attention_only``: only the attention probe, default cadence (issue 3's figure);
- ``grads_spectral_every_step``: gradient statistics and spectral norms every step (issue 5);
  runs up to 24 also had ``grads_spectral_alternate_every_step``, half an iteration a step
  (``weights.alternate``, removed once a whole iteration read the weights once);
- ``everything_every_step``: every probe at every step, flush every step;
- ``default_swapped_stabilized``: the defaults with every layer's attention routed to numwatch's
  stabilized flash attention (``Monitor.swap_attention``), against the cuDNN baseline;
- ``<config>_plain_launches`` (for grads_spectral_every_step, default): the same with the power
  iteration launched one by one instead of replayed as a CUDA graph (runs 16-17 also had
  ``gradients_only_plain_launches``, from when the gradient statistics replayed one too);
- ``detect_anomaly``: torch.autograd.set_detect_anomaly(True), what users run instead;
- ``nan_check_hooks``: a per-parameter gradient hook checking isnan/isinf with a host read, the
  common NaN-check recipe.

``--interleave``: one model (same seed, same data) and optimizer per configuration, all in one
process, stepping in turn (baseline, then the others in an order that rotates every round, from
session 9 on): each step's overhead is taken against the baseline step of its round, so drifts
slower than one round (host speed, clocks) cancel, and the median over the steps is the
per-step overhead (with a bootstrap 95 % interval); sampled steps and flushes fall into the
window as in training. ``--reanalyze FILE`` recomputes those statistics from a report's
per-step times.

    python bench/bench_overhead.py --out bench/results/overhead.json            # GPU
    python bench/bench_overhead.py --interleave --steps 200 \
        --configs baseline,default,attention_only,grads_spectral_every_step \
        --out bench/results/overhead_interleaved.json
    python bench/bench_overhead.py --preset demo --device cpu --batch 16 \
        --configs baseline,default,default_flush_every_1 --out bench/results/overhead_cpu_demo.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt2 import GPT, PRESETS, train_step

import numwatch
from numwatch.kernels import launch

EVERY = {
    "flush_every": 1,
    "gradients__every": 1,
    "activations__every": 1,
    "attention__every": 1,
    "weights__every": 1,
    "optimizer__every": 1,
}
OFF = {
    "gradients__enabled": False,
    "activations__enabled": False,
    "attention__enabled": False,
    "weights__enabled": False,
    "optimizer__enabled": False,
}
CONFIGS: dict[str, dict | str | None] = {
    "baseline": None,
    "default": {},
    "default_flush_every_1": {"flush_every": 1},
    "every_10": {
        "flush_every": 10,
        "activations__every": 10,
        "attention__every": 10,
        "weights__every": 10,
        "optimizer__every": 10,
    },
    "default_skip_step": {
        "rules": {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]}
    },
    "attention_only": {**OFF, "attention__enabled": True},
    "gradients_only": {**OFF, "gradients__enabled": True},  # the defaults' every-step part
    "grads_spectral_every_step": {
        **OFF,
        "gradients__enabled": True,
        "weights__enabled": True,
        "gradients__every": 1,
        "weights__every": 1,
    },
    "everything_every_step": EVERY,
    "detect_anomaly": "detect_anomaly",
    "nan_check_hooks": "nan_check_hooks",
}
# The same configurations with the power iteration launched one by one instead of replayed as a
# CUDA graph (numwatch.kernels.launch.CUDA_GRAPHS off around their steps): what the graph saves,
# measured in the same process, so the host's speed (which varies widely between machines) cancels.
PLAIN_LAUNCHES = {
    f"{name}_plain_launches": name for name in ("grads_spectral_every_step", "default")
}
CONFIGS.update({plain: CONFIGS[name] for plain, name in PLAIN_LAUNCHES.items()})
# The defaults with every layer's SDPA calls routed to numwatch's stabilized flash attention
# (Monitor.swap_attention) instead of cuDNN: what the hot-swap costs a training step, its
# kernels' device time and their launches' host time together.
SWAPPED = {"default_swapped_stabilized": "default"}
CONFIGS.update({name: CONFIGS[base] for name, base in SWAPPED.items()})


@contextmanager
def configured(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, monitors: dict):
    """The configuration's hooks for one block of steps. A configuration's Monitor lives across
    rounds (detached between its blocks), so its step count, and with it the 50-step cadence of
    sampled probes and flushes, runs on through the timed steps of every round."""
    spec = CONFIGS[name]
    monitor = None
    handles = []
    with ExitStack() as stack:
        if spec == "detect_anomaly":
            stack.enter_context(torch.autograd.set_detect_anomaly(True))
        elif spec == "nan_check_hooks":

            def check(grad: torch.Tensor) -> None:
                if torch.isnan(grad).any() or torch.isinf(grad).any():  # host read per tensor
                    raise FloatingPointError("non-finite gradient")

            handles = [p.register_hook(check) for p in model.parameters()]
        elif isinstance(spec, dict):
            monitor = monitors[name].attach(opt)
            if name in SWAPPED:
                monitor.swap_attention()
        try:
            yield monitor
        finally:
            for h in handles:
                h.remove()
            if monitor is not None:
                monitor.detach()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="gpt2", help="examples/gpt2.py preset, or 'demo'")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=20, help="timed steps per config and round")
    p.add_argument(
        "--warmup", type=int, default=5, help="untimed steps of each config's first round"
    )
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--interleave", action="store_true", help="a model per config, steps in turn")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--reanalyze",
        metavar="JSON",
        help="recompute an interleaved report's paired statistics from its per-step times",
    )
    args = p.parse_args()
    if args.reanalyze:
        reanalyze(args.reanalyze)
        return
    if args.interleave:
        run_interleaved(args)
        return

    model, opt, x, y, seq_len = _setup(args)
    on_cuda = torch.device(args.device).type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else lambda: None

    def step(monitor: numwatch.Monitor | None) -> None:
        train_step(model, opt, x, y, monitor)

    names = args.configs.split(",")
    times: dict[str, list[float]] = {n: [] for n in names}
    per_round: dict[str, list[float]] = {n: [] for n in names}  # each round's median step
    overhead_host: dict[str, list[float]] = {n: [] for n in names}
    # Host time to issue a step (no sync at its end): less noisy than the step time, and what
    # the monitor adds when the host, not the GPU, sets the pace.
    host: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as logdir, ExitStack() as stack:
        monitors = {
            name: _monitor(model, name, spec, logdir)
            for name, spec in CONFIGS.items()
            if name in names and isinstance(spec, dict)
        }
        _prefer_cudnn(stack, on_cuda)
        for r in range(args.rounds):
            for name in names:
                with configured(name, model, opt, monitors) as monitor:
                    # Later rounds: one untimed step after re-attaching (it rebuilds the probes'
                    # tables, a once-per-run cost in real training); it still counts toward the
                    # cadence, so sampled steps and flushes fall into timed steps.
                    for _ in range(args.warmup if r == 0 else 1):
                        step(monitor)
                    block = []
                    for _ in range(args.steps):
                        sync()
                        t0 = time.perf_counter()
                        step(monitor)
                        issued = time.perf_counter()
                        sync()
                        block.append(time.perf_counter() - t0)
                        host[name].append(issued - t0)
                    times[name] += block
                    per_round[name].append(statistics.median(block))
                    if monitor is not None and monitor.snapshot() is not None:
                        v = monitor.snapshot().get("monitor_overhead_seconds")
                        if v is not None:
                            overhead_host[name].append(v)

    base = statistics.median(times["baseline"]) if "baseline" in times else None
    base_mean = statistics.fmean(times["baseline"]) if "baseline" in times else None
    results = {}
    for name in names:
        ts = sorted(times[name])
        med = statistics.median(ts)
        mean = statistics.fmean(ts)
        # Paired per round against the baseline block run just before: drifts of the machine
        # (clocks, the host's speed) cancel, and the spread over rounds shows the noise.
        ratios = (
            sorted(r / b - 1 for r, b in zip(per_round[name], per_round["baseline"], strict=True))
            if "baseline" in per_round
            else []
        )
        results[name] = {
            "median_ms": med * 1e3,
            "mean_ms": mean * 1e3,
            # The median hides costs paid on a few steps (sampled probes, flushes); the mean is
            # what a run's throughput pays.
            "mean_overhead_vs_baseline": (mean / base_mean - 1) if base_mean else None,
            "p10_ms": ts[len(ts) // 10] * 1e3,
            "p90_ms": ts[(9 * len(ts)) // 10] * 1e3,
            "steps": len(ts),
            "overhead_vs_baseline": (med / base - 1) if base else None,
            "host_issue_median_ms": statistics.median(host[name]) * 1e3,
            "host_issue_overhead_ms": (
                (statistics.median(host[name]) - statistics.median(host["baseline"])) * 1e3
                if "baseline" in host
                else None
            ),
            "round_overheads": ratios,
            "round_overhead_median": statistics.median(ratios) if ratios else None,
            "monitor_host_seconds_per_step": (
                statistics.median(overhead_host[name]) if overhead_host[name] else None
            ),
        }
        line = f"{name:28s} median {med * 1e3:9.2f} ms  mean {mean * 1e3:9.2f} ms"
        if base and base_mean:
            line += f"  {100 * (med / base - 1):+7.2f} % / {100 * (mean / base_mean - 1):+7.2f} %"
            line += f"  rounds {100 * ratios[0]:+.1f} .. {100 * ratios[-1]:+.1f} %"
        print(line, flush=True)
    report = {
        "benchmark": "monitor overhead per training step",
        **_run_info(args, seq_len, on_cuda),
        "params": sum(p.numel() for p in model.parameters()),
        "rounds": args.rounds,
        "timed_steps_per_round": args.steps,
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


def _count_flushes(monitor: numwatch.Monitor | None) -> list[int]:
    """A counter of the monitor's flushes (its first item), kept up by wrapping its flush."""
    count = [0]
    if monitor is not None:
        flush = monitor.flush

        def counted():
            count[0] += 1
            return flush()

        monitor.flush = counted
    return count


def _sampled_now(monitor: numwatch.Monitor | None) -> bool:
    """Whether the coming step samples a probe that is off on most steps (the attention,
    activation, weight and optimizer probes at their ``every``; the gradient probe is left out:
    by default it runs every step)."""
    if monitor is None:
        return False
    cfg, step = monitor.config, monitor.steps
    probes = (cfg.attention, cfg.activations, cfg.weights, cfg.optimizer)
    return any(p.enabled and p.every > 1 and step % p.every == 0 for p in probes)


def _by_phase(times: list[float], base: list[float], phases: list[str]) -> dict:
    total = sum(base)
    out = {}
    for phase in ("other", "sampled", "flush"):
        excess = [t - b for t, b, p in zip(times, base, phases, strict=True) if p == phase]
        if excess:
            out[phase] = {
                "steps": len(excess),
                "mean_excess_ms": statistics.fmean(excess) * 1e3,
                "share_of_mean_overhead_pct": 100 * sum(excess) / total,
            }
    return out


def _monitor(model: torch.nn.Module, name: str, spec: dict, logdir: str) -> numwatch.Monitor:
    """The configuration's monitor, console off (its lines would time the terminal). The
    ``*_plain_launches`` ones say so in their config too: attach sets the process-wide switch,
    which the block mode relies on (the interleaved mode sets it before every step)."""
    if name in PLAIN_LAUNCHES:
        spec = {**spec, "cuda_graphs": False}
    return numwatch.Monitor(
        model, sinks__console__enabled=False, sinks__jsonl__path=f"{logdir}/{name}.jsonl", **spec
    )


def _prefer_cudnn(stack: ExitStack, on_cuda: bool) -> None:
    """SDPA as the issues measure it on the GPU: cuDNN first, then FA2."""
    if on_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
        stack.enter_context(sdpa_kernel(backends, set_priority=True))


def _run_info(args: argparse.Namespace, seq_len: int, on_cuda: bool) -> dict:
    """What a report says about the machine and the training step it timed."""
    return {
        "gpu": torch.cuda.get_device_name() if on_cuda else "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "model": args.preset,
        "batch": args.batch,
        "seq_len": seq_len,
        "dtype": "bf16 autocast",
        "optimizer": "AdamW (fused on CUDA)",
        "attention": "SDPA, cuDNN then FA2 backend" if on_cuda else "SDPA",
    }


def _setup(args: argparse.Namespace):
    """Model, optimizer and batch of one run (same seed: same weights)."""
    torch.manual_seed(0)
    if args.preset == "demo":  # the model `numwatch demo` trains
        from numwatch.demo import GPTConfig, TinyGPT

        demo = GPTConfig()
        model = TinyGPT(demo).to(args.device)
        seq_len, vocab = demo.seq_len, demo.vocab
    else:
        cfg = PRESETS[args.preset]
        model = GPT(cfg).to(args.device)
        seq_len, vocab = cfg.block_size, cfg.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.device == "cuda")
    x = torch.randint(0, vocab, (args.batch, seq_len), device=args.device)
    return model, opt, x, torch.roll(x, -1, 1), seq_len


def run_interleaved(args: argparse.Namespace) -> None:
    names = args.configs.split(",")
    if names[0] != "baseline":
        raise SystemExit("--interleave needs 'baseline' first in --configs")
    on_cuda = torch.device(args.device).type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else lambda: None
    runs = {}
    with tempfile.TemporaryDirectory() as logdir, ExitStack() as stack:
        _prefer_cudnn(stack, on_cuda)
        for name in names:
            model, opt, x, y, seq_len = _setup(args)
            spec = CONFIGS[name]
            monitors = {name: _monitor(model, name, spec, logdir)} if isinstance(spec, dict) else {}
            # detect_anomaly is process-wide: switched on around its own model's steps below
            monitor = (
                None
                if spec == "detect_anomaly"
                else stack.enter_context(configured(name, model, opt, monitors))
            )
            runs[name] = (model, opt, x, y, monitor)
        times: dict[str, list[float]] = {n: [] for n in names}
        issue: dict[str, list[float]] = {n: [] for n in names}  # host time to issue the step
        phases: dict[str, list[str]] = {n: [] for n in names}
        flushed = {n: _count_flushes(runs[n][4]) for n in names}
        others = names[1:]
        for i in range(args.warmup + args.steps):
            # baseline first (each step pairs with it), the others in an order that rotates
            # every round, so that no configuration always runs right after the baseline
            k = i % len(others) if others else 0
            for name in ["baseline", *others[k:], *others[:k]]:
                model, opt, x, y, monitor = runs[name]
                launch.CUDA_GRAPHS = name not in PLAIN_LAUNCHES
                sampled, before = _sampled_now(monitor), flushed[name][0]
                with torch.autograd.set_detect_anomaly(CONFIGS[name] == "detect_anomaly"):
                    sync()
                    t0 = time.perf_counter()
                    train_step(model, opt, x, y, monitor)
                    t1 = time.perf_counter()
                    sync()
                    if i >= args.warmup:
                        times[name].append(time.perf_counter() - t0)
                        issue[name].append(t1 - t0)
                        flush = flushed[name][0] > before
                        phases[name].append("flush" if flush else "sampled" if sampled else "other")
    base = times["baseline"]
    results = {}
    for name in names:
        results[name] = {
            "median_ms": statistics.median(times[name]) * 1e3,
            "mean_ms": statistics.fmean(times[name]) * 1e3,
            **_paired_stats(times[name], base),
            # near median_ms: the host, not the device, sets the pace (its work counts in full)
            "issue_median_ms": statistics.median(issue[name]) * 1e3,
            # where the mean's excess over the median comes from: per kind of step, how many
            # there were, their mean excess over the paired baseline step, and their share of
            # the mean overhead (percent of the baseline's total time)
            "by_phase": _by_phase(times[name], base, phases[name]),
            # every timed step, in order
            "step_ms_each": [round(t * 1e3, 3) for t in times[name]],
        }
        r = results[name]
        pct = {k: 100 * v for k, v in r.items() if k.endswith(("_p25", "_p75", "_median"))}
        lo, hi = (100 * v for v in r["paired_overhead_median_ci95"])
        print(
            f"{name:28s} median {r['median_ms']:8.2f} ms  paired median "
            f"{pct['paired_overhead_median']:+6.2f} % (95 % CI {lo:+.2f} .. {hi:+.2f}, IQR "
            f"{pct['paired_overhead_p25']:+.2f} .. {pct['paired_overhead_p75']:+.2f} %)  mean "
            f"{100 * r['mean_overhead']:+6.2f} %  issued in {r['issue_median_ms']:.2f} ms",
            flush=True,
        )
    report = {
        "benchmark": "monitor overhead per training step, interleaved models",
        **_run_info(args, seq_len, on_cuda),
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        # host time to issue a baseline step over its whole time: near 1, the loop is host-bound
        # and the monitor's host time per step shows in the step time almost in full
        "baseline_issue_fraction": results["baseline"]["issue_median_ms"]
        / results["baseline"]["median_ms"],
        "results": results,
        "graphs_vs_plain_launches": _graphs_vs_plain(times),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


def _median_ci95(values: list[float], resamples: int = 2000) -> list[float]:
    """Percentile-bootstrap 95 % interval of the median of ``values`` (fixed seed): how far a
    paired median can be trusted on this machine, whose noise varies widely between leases."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return [meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]]


def _paired_stats(times: list[float], base: list[float]) -> dict:
    """Each step against the baseline step just before it: median (with its 95 % interval),
    quartiles, and the ratio of the means."""
    paired = sorted(t / b - 1 for t, b in zip(times, base, strict=True))
    q = len(paired)
    return {
        "steps": q,
        "paired_overhead_median": statistics.median(paired),
        "paired_overhead_median_ci95": _median_ci95(paired),
        "paired_overhead_p25": paired[q // 4],
        "paired_overhead_p75": paired[(3 * q) // 4],
        "mean_overhead": statistics.fmean(times) / statistics.fmean(base) - 1,
    }


def _graphs_vs_plain(times: dict[str, list[float]]) -> dict:
    """For each configuration run both with CUDA graphs and with plain launches: the median of
    step-by-step ratios (graphs / plain - 1, same round) with its 95 % interval."""
    out = {}
    for plain, name in PLAIN_LAUNCHES.items():
        if plain in times and name in times:
            ratios = [g / p - 1 for g, p in zip(times[name], times[plain], strict=True)]
            out[name] = {
                "median": statistics.median(ratios),
                "median_ci95": _median_ci95(ratios),
            }
    return out


def reanalyze(path: str) -> None:
    """Recompute the paired statistics of an interleaved report from its per-step times."""
    report = json.loads(Path(path).read_text())
    results = report["results"]
    times = {name: [t / 1e3 for t in r["step_ms_each"]] for name, r in results.items()}
    for name, r in results.items():
        r.update(_paired_stats(times[name], times["baseline"]))
    report["graphs_vs_plain_launches"] = _graphs_vs_plain(times)
    Path(path).write_text(json.dumps(report, indent=2))


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
