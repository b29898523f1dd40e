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


def timer(device: str) -> Callable[[Callable[[], object], int], float]:
    """Mean milliseconds per call of ``fn`` over ``reps`` back-to-back calls (after warm-up)."""

    def run(fn: Callable[[], object], reps: int) -> float:
        fn()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps

    return run


def host_us(fn: Callable[[], object], reps: int, device: str) -> float:
    """Host time to enqueue one call (what the training loop's CPU thread pays)."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.synchronize()
    return dt * 1e6 / reps


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


def copy_bandwidth(device: str, numel: int, run: Callable) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written per second)."""
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    ms = run(lambda: dst.copy_(src), 10)
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


def bench_list(name: str, grads: list, lb_bw: float, run: Callable, device: str, reps: int):
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    lower_ms = nbytes / lb_bw / 1e6
    kernel_ms = run(lambda: ts.tensor_stats(grads, torch.float16, backend="triton"), reps)
    loop_ms = run(lambda: torch_loop(grads), max(2, reps // 50))
    foreach_ms = run(lambda: torch._foreach_norm(grads), reps)
    ref_ms = run(lambda: ts.tensor_stats_reference(grads, torch.float16), max(2, reps // 50))
    res = {
        "workload": name,
        "n_tensors": len(grads),
        "numel": sum(g.numel() for g in grads),
        "dtype": str(grads[0].dtype),
        "bytes": nbytes,
        "lower_bound_ms": lower_ms,
        "kernel_ms": kernel_ms,
        "kernel_GBps": nbytes / kernel_ms / 1e6,
        "kernel_host_us_per_call": host_us(
            lambda: ts.tensor_stats(grads, torch.float16, backend="triton"), reps, device
        ),
        "torch_loop_ms": loop_ms,
        "foreach_norm_ms": foreach_ms,
        "torch_reference_ms": ref_ms,
        "kernel_over_lower_bound": kernel_ms / lower_ms,
        "loop_over_kernel": loop_ms / kernel_ms,
        "foreach_norm_over_kernel": foreach_ms / kernel_ms,
        "check": check_against_reference(grads),
    }
    res["targets_met"] = {
        "<=2x_lower_bound": res["kernel_over_lower_bound"] <= 2.0,
        ">=100x_vs_loop": res["loop_over_kernel"] >= 100.0,
        ">=1.5x_vs_foreach_norm": res["foreach_norm_over_kernel"] >= 1.5,
    }
    return res


def bench_large(dtype: torch.dtype, numel: int, copy_bw: float, run: Callable, reps: int) -> dict:
    x = torch.randn(numel, device="cuda" if torch.cuda.is_available() else "cpu").to(dtype)
    nbytes = x.numel() * x.element_size()
    kernel_ms = run(lambda: ts.tensor_stats([x], torch.float16, backend="triton"), reps)
    foreach_ms = run(lambda: torch._foreach_norm([x]), reps)
    tbps = nbytes / kernel_ms / 1e9
    return {
        "dtype": str(dtype),
        "numel": numel,
        "bytes": nbytes,
        "kernel_ms": kernel_ms,
        "kernel_TBps": tbps,
        "copy_TBps": copy_bw / 1e3,
        "kernel_over_lower_bound": kernel_ms / (nbytes / copy_bw / 1e6),
        "foreach_norm_ms": foreach_ms,
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
    run = timer(device)
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

    copy_bw = copy_bandwidth(device, large, run)
    result["copy_bandwidth_GBps"] = copy_bw
    grads = make_grads(shapes, torch.float32, device)
    t0 = time.perf_counter()
    ts.tensor_stats(grads, backend="triton")  # table build (cache miss): host time, no sync
    result["plan_build_host_ms"] = (time.perf_counter() - t0) * 1e3
    result["gpt2_grads"] = [bench_list("gpt2 dense grads", grads, copy_bw, run, device, reps)]
    save()
    grads_bf16 = [g.to(torch.bfloat16) for g in grads]
    result["gpt2_grads"].append(
        bench_list("gpt2 dense grads", grads_bf16, copy_bw, run, device, reps)
    )
    save()
    del grads, grads_bf16
    for dtype in (torch.float32, torch.bfloat16):
        sparse = make_grads(shapes, dtype, device, zero_wte_rows=0.85)
        result["gpt2_grads"].append(
            bench_list("gpt2 grads, 85% zero wte rows", sparse, copy_bw, run, device, reps)
        )
        save()
        del sparse
    result["large_tensor"] = [
        bench_large(torch.float32, large, copy_bw, run, reps),
        bench_large(torch.bfloat16, 2 * large, copy_bw, run, reps),
    ]
    save()
    # launch-shape sweep (the work split, hence the last bits of the sums, depends on it)
    sweep = []
    grads = make_grads(shapes, torch.float32, device)
    grads_bf16 = [g.to(torch.bfloat16) for g in grads]
    x = torch.randn(large, device=device)
    for cfg in (
        ts._Config(),
        ts._Config(block=2048, num_warps=8),
        ts._Config(min_iters=32, target_chunks=2048),
    ):
        row = {"config": cfg._asdict()}
        for key, tensors in (
            ("gpt2_fp32_ms", grads),
            ("gpt2_bf16_ms", grads_bf16),
            ("large_fp32_ms", [x]),
        ):
            row[key] = run(lambda c=cfg, t=tensors: ts._tensor_stats_triton(t, None, c), reps)
        sweep.append(row)
        result["sweep"] = sweep
        save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
