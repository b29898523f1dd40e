"""Host time of the monitor's every-step path with the kernel launches stubbed out.

On a host-bound training loop every microsecond of ``monitor.step`` shows in the step time, and
those microseconds are Python bookkeeping that any machine can measure: this runs GPT-2-124M's
148 gradients (a CPU model, one backward) through the gradient probe with the Triton path of
``tensor_stats`` in the interpreter's mode but its launches replaced by an output of zeros, and
times ``monitor.step`` and its parts with ``timeit`` (best of 5 repeats). The launches
themselves (a few Triton launches) come on top on a GPU
(``bench_tensor_stats.py`` measures them there).

    python bench/profile_host_path.py --out /tmp/host_path.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import timeit
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton path's host code, on any machine

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt2 import GPT, PRESETS

import numwatch
from numwatch.kernels import tensor_stats as ts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--calls", type=int, default=3000, help="calls per timeit repeat")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    ts._launch = lambda plan, n, uf, cfg: torch.zeros(n, ts.N_STATS, dtype=torch.float64)
    torch.manual_seed(0)
    cfg = PRESETS[args.preset]
    model = GPT(cfg)
    off = ("activations", "attention", "optimizer", "weights")
    monitor = numwatch.Monitor(
        model,
        kernel_backend="triton",
        flush_every=10**9,
        sinks__console__enabled=False,
        sinks__jsonl__enabled=False,
        **{f"{name}__enabled": False for name in off},
    ).attach()
    loss = model(torch.randint(0, cfg.vocab_size, (1, min(16, cfg.block_size)))).float().mean()
    loss.backward()
    loss = loss.detach()
    grads = [p.grad for p in model.parameters()]
    twins = (grads, [g.clone() for g in grads])  # the same layout at other addresses
    turn = iter(range(1 << 62))
    probe = monitor._gradients
    parts = {
        "monitor_step_with_loss": lambda: monitor.step(loss),
        "gradient_probe_on_step": probe.on_step,
        "tensor_stats_same_addresses": lambda: ts.tensor_stats(grads, None, "triton"),
        "tensor_stats_moved": lambda: ts.tensor_stats(twins[next(turn) % 2], None, "triton"),
        "record_loss": lambda: monitor._record_loss(loss, monitor.steps),
    }
    for f in parts.values():
        f()  # plans, tables and caches built
    result = {
        "benchmark": "monitor.step host path, kernel launches stubbed",
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gradients": len(grads),
        "host_us": {
            name: min(timeit.repeat(f, number=args.calls, repeat=5)) / args.calls * 1e6
            for name, f in parts.items()
        },
    }
    monitor.detach()
    for name, us in result["host_us"].items():
        print(f"{name:32s} {us:8.2f} us")
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
