"""Fused tensor statistics vs the per-tensor torch loop, torch._foreach_norm and one memory read.

Workloads (same process, same tensors):
- GPT-2-124M's 148 gradient tensors (shapes of the Hugging Face model, fp32 and bf16), dense
  gradient-like values; and a variant whose wte gradient has the zero rows of a real step (tokens
  absent from the batch), which sends most of wte's programs through the kernel's exact pass;
- one 1 GiB tensor (fp32 and bf16).
Peers: the per-tensor torch loop (absmax, isnan count, isinf count, zero count, norm per tensor),
``torch._foreach_norm``, numwatch's own torch reference, and the one-read lower bound = bytes /
copy bandwidth (device-to-device copy of 1 GiB measured here; a copy moves 2 bytes per byte read).

Usage: python bench/bench_tensor_stats.py --out results.json   (H200)
       python bench/bench_tensor_stats.py --smoke --out /tmp/x.json   (CPU interpreter, tiny shapes)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before numwatch.kernels imports triton

import triton

from numwatch.kernels import tensor_stats as ts


def gpt2_shapes(n_layer: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024) -> list:
    """Parameter shapes of Hugging Face GPT-2 (Conv1D weights are (in, out)), in model order."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte", (vocab, d)), ("wpe", (ctx, d))]
    for i in range(n_layer):
        p = f"h.{i}."
        shapes += [
            (p + "ln_1.weight", (d,)),
            (p + "ln_1.bias", (d,)),
            (p + "attn.c_attn.weight", (d, 3 * d)),
            (p + "attn.c_attn.bias", (3 * d,)),
            (p + "attn.c_proj.weight", (d, d)),
            (p + "attn.c_proj.bias", (d,)),
            (p + "ln_2.weight", (d,)),
            (p + "ln_2.bias", (d,)),
            (p + "mlp.c_fc.weight", (d, 4 * d)),
            (p + "mlp.c_fc.bias", (4 * d,)),
            (p + "mlp.c_proj.weight", (4 * d, d)),
            (p + "mlp.c_proj.bias", (d,)),
        ]
    return [*shapes, ("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


def make_grads(shapes: list, dtype: torch.dtype, device: str, zero_wte_rows: float = 0.0) -> list:
    """Gradient-like tensors: N(0, 1e-3); optionally a fraction of wte's rows exactly zero."""
    g = torch.Generator(device=device).manual_seed(0)
    out = [torch.randn(s, generator=g, device=device).mul_(1e-3).to(dtype) for _, s in shapes]
    if zero_wte_rows:
        rows = out[0].shape[0]
        keep = torch.rand(rows, generator=g, device=device) >= zero_wte_rows
        out[0].mul_(keep.unsqueeze(1).to(dtype))
    return out


def measure(fn: Callable[[], object], reps: int, device: str) -> dict:
    """Per-call figures of ``fn`` after two warm-up calls (compile, table build).

    ``wall_ms``: back-to-back calls, CUDA events: what a loop of calls costs, max(host, device).
    ``host_us``: host time to enqueue one call (what the training loop's CPU thread pays).
    ``gpu_ms``: device time: the calls are queued behind a sleep kernel longer than their
    enqueueing (``gpu_time_valid`` checks it), so launch gaps from a slow host do not count.
    """
    fn()
    fn()
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        ms = (time.perf_counter() - t0) * 1e3 / reps
        return {"gpu_ms": ms, "wall_ms": ms, "host_us": ms * 1e3, "gpu_time_valid": False}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    torch.cuda.synchronize()
    ev[0].record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = time.perf_counter() - t0
    ev[1].record()
    torch.cuda.synchronize()
    wall_ms = ev[0].elapsed_time(ev[1]) / reps
    ev[0].record()
    torch.cuda._sleep(int(2e9 * (2 * host + 1e-3)))  # ~2 GHz clock: twice the enqueue time
    ev[1].record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    queued = time.perf_counter() - t0
    ev[2].record()
    torch.cuda.synchronize()
    return {
        "gpu_ms": ev[1].elapsed_time(ev[2]) / reps,
        "wall_ms": wall_ms,
        "host_us": host * 1e6 / reps,
        "gpu_time_valid": queued * 1e3 < ev[0].elapsed_time(ev[1]),
    }


def torch_loop(grads: list) -> list:
    """The per-tensor statistics a naive monitor computes: 5 reductions per tensor."""
    out = []
    for g in grads:
        out.append(g.abs().amax())
        out.append(torch.isnan(g).sum())
        out.append(torch.isinf(g).sum())
        out.append((g == 0).sum())
        out.append(torch.linalg.vector_norm(g))
    return out


def copy_bandwidth(device: str, numel: int) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written per second)."""
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    ms = measure(lambda: dst.copy_(src), 10, device)["gpu_ms"]
    return 2 * src.numel() * 4 / ms / 1e6


def check_against_reference(grads: list) -> dict:
    got = ts.tensor_stats(grads, torch.float16, backend="triton").cpu()
    want = ts.tensor_stats_reference(grads, torch.float16).cpu()
    exact = [c for c in range(ts.N_STATS) if c not in (ts.SUM, ts.SUMSQ)]
    scale = want[:, ts.SUMSQ].clamp_min(1e-300)
    return {
        "exact_columns_equal": bool(torch.equal(got[:, exact], want[:, exact])),
        "max_rel_err_sumsq": (got[:, ts.SUMSQ] - want[:, ts.SUMSQ]).abs().div(scale).max().item(),
    }


def bench_list(name: str, grads: list, copy_bw: float, device: str, reps: int) -> dict:
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    lower_ms = nbytes / copy_bw / 1e6
    few = max(2, reps // 25)
    kern = measure(lambda: ts.tensor_stats(grads, torch.float16, backend="triton"), reps, device)
    loop = measure(lambda: torch_loop(grads), few, device)
    foreach = measure(lambda: torch._foreach_norm(grads), reps, device)
    ref = measure(lambda: ts.tensor_stats_reference(grads, torch.float16), few, device)
    k = kern["gpu_ms"]
    res = {
        "workload": name,
        "n_tensors": len(grads),
        "numel": sum(g.numel() for g in grads),
        "dtype": str(grads[0].dtype),
        "bytes": nbytes,
        "lower_bound_ms": lower_ms,
        "kernel": kern,
        "kernel_GBps": nbytes / k / 1e6,
        "torch_loop": loop,
        "foreach_norm": foreach,
        "torch_reference": ref,
        "kernel_over_lower_bound": k / lower_ms,
        "loop_over_kernel": loop["gpu_ms"] / k,
        "foreach_norm_over_kernel": foreach["gpu_ms"] / k,
        "wall": {
            "kernel_over_lower_bound": kern["wall_ms"] / lower_ms,
            "loop_over_kernel": loop["wall_ms"] / kern["wall_ms"],
            "foreach_norm_over_kernel": foreach["wall_ms"] / kern["wall_ms"],
        },
        "check": check_against_reference(grads),
    }
    res["targets_met_device_time"] = {
        "<=2x_lower_bound": res["kernel_over_lower_bound"] <= 2.0,
        ">=100x_vs_loop": res["loop_over_kernel"] >= 100.0,
        ">=1.5x_vs_foreach_norm": res["foreach_norm_over_kernel"] >= 1.5,
    }
    return res


def host_with_moving_addresses(grads: list, reps: int, device: str) -> dict:
    """Host time per call when the gradients keep their addresses, and when they move every call
    (two lists of one layout in turn), as gradients reallocated by ``zero_grad(set_to_none=True)``
    may: each such call rewrites the table's addresses."""
    twins = (grads, [g.clone() for g in grads])
    turn = iter(range(1 << 62))
    moved = measure(lambda: ts.tensor_stats(twins[next(turn) % 2], backend="triton"), reps, device)
    still = measure(lambda: ts.tensor_stats(grads, backend="triton"), reps, device)
    return {"same_addresses": still["host_us"], "moved": moved["host_us"]}


def bench_large(x: torch.Tensor, label: str, copy_bw: float, device: str, reps: int) -> dict:
    nbytes = x.numel() * x.element_size()
    kern = measure(lambda: ts.tensor_stats([x], torch.float16, backend="triton"), reps, device)
    foreach = measure(lambda: torch._foreach_norm([x]), reps, device)
    tbps = nbytes / kern["gpu_ms"] / 1e9
    return {
        "tensor": label,
        "dtype": str(x.dtype),
        "numel": x.numel(),
        "bytes": nbytes,
        "kernel": kern,
        "kernel_TBps": tbps,
        "copy_TBps": copy_bw / 1e3,
        "kernel_over_lower_bound": kern["gpu_ms"] / (nbytes / copy_bw / 1e6),
        "foreach_norm": foreach,
        "target_met_>=3.4TBps": tbps >= 3.4,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter check)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        sys.exit("the benchmark needs a GPU (use --smoke for a CPU check of the script)")
    reps = 2 if args.smoke else 50
    shapes = gpt2_shapes(n_layer=1, d=64, vocab=500, ctx=64) if args.smoke else gpt2_shapes()
    large = 1 << 16 if args.smoke else 1 << 28  # fp32: 1 GiB
    result: dict = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "smoke": args.smoke,
        "kernel_config": ts._CONFIG._asdict(),
        "underflow_dtype": "float16",
    }

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    copy_bw = copy_bandwidth(device, large)
    result["copy_bandwidth_GBps"] = copy_bw
    grads = make_grads(shapes, torch.float32, device)
    t0 = time.perf_counter()
    ts.tensor_stats(grads, backend="triton")  # table build (cache miss): host time, no sync
    result["plan_build_host_ms"] = (time.perf_counter() - t0) * 1e3
    result["gpt2_fp32_host_us"] = host_with_moving_addresses(grads, reps, device)
    result["gpt2_grads"] = [bench_list("gpt2 dense grads", grads, copy_bw, device, reps)]
    save()
    grads_bf16 = [g.to(torch.bfloat16) for g in grads]
    result["gpt2_grads"].append(bench_list("gpt2 dense grads", grads_bf16, copy_bw, device, reps))
    save()
    for dtype in (torch.float32, torch.bfloat16):
        sparse = make_grads(shapes, dtype, device, zero_wte_rows=0.85)
        label = "gpt2 grads, 85% zero wte rows"
        result["gpt2_grads"].append(bench_list(label, sparse, copy_bw, device, reps))
        save()
        del sparse
    # one large tensor: N(0, 1); and with a NaN in every program's chunk (all take the exact pass)
    x = torch.randn(large, device=device)
    with_nan = x.clone()
    with_nan[::4096] = float("nan")
    result["large_tensor"] = [
        bench_large(x, "N(0,1)", copy_bw, device, reps),
        bench_large(x.to(torch.bfloat16).repeat(2), "N(0,1)", copy_bw, device, reps),
        bench_large(with_nan, "N(0,1), a NaN every 4096 values", copy_bw, device, reps),
    ]
    del with_nan
    save()
    # launch-shape sweep (the work split, hence the last bits of the sums, depends on it)
    sweep = []
    x_bf16 = x.to(torch.bfloat16).repeat(2)
    workloads = (
        ("gpt2_fp32", grads),
        ("gpt2_bf16", grads_bf16),
        ("large_fp32", [x]),
        ("large_bf16", [x_bf16]),
    )
    for cfg in (
        ts._Config(),
        ts._Config(block=2048, num_warps=8),
        ts._Config(block=4096, num_warps=8),
        ts._Config(block=2048, num_warps=16),
        ts._Config(block=1024, num_warps=8),
        ts._Config(block=2048, num_warps=4),
        ts._Config(min_iters=16, target_chunks=4096),
    ):
        row = {"config": cfg._asdict()}
        for key, tensors in workloads:
            fn = lambda c=cfg, t=tensors: ts._tensor_stats_triton(t, torch.float16, c)
            row[key + "_gpu_ms"] = measure(fn, reps, device)["gpu_ms"]
        sweep.append(row)
        result["sweep"] = sweep
        save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
