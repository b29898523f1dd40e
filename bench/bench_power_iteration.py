"""Batched power iteration over GPT-2's weights vs torch.linalg.svdvals, and its accuracy.

Timing (same process): one ``PowerIteration.step`` (1 iteration) over GPT-2-124M's 48 linear
weights (Conv1D shapes (768, 2304), (768, 768), (768, 3072), (3072, 768)) plus the per-head Q and
K slices of every c_attn weight (12 layers x 24 heads of (768, 64), strided views, no copy): 336
matrices; the same with wte and wpe added (the 50 matrices svdvals is timed on); the grouped
torch reference step; ``torch.linalg.svdvals`` over the 50 weight matrices (48 + wte + wpe).
An iteration reads every matrix once: its one-read lower bound is the matrices' bytes over the
measured copy bandwidth (``bench_tensor_stats.copy_bandwidth``). ``pi_step_one_stream`` is the
same step with its launches (one per row-length class) in turn on one stream instead of side by
side. ``--sweep`` also times the step under other tile configurations (the kernel's
``_Config``), same process.

Accuracy, against ``torch.linalg.svdvals``:
- trained-like weights (N(0, 0.02) + four strong rank-1 directions per weight and two per Q/K
  head block, drifting slowly every step), one iteration per step: relative error of every
  matrix after 1, 5, 10, 20, 50 steps;
- Gaussian random-init weights (N(0, 0.02)), cold start: relative error vs iterations, and the
  iterations after which every matrix is within 5% and 1%.

Usage: python bench/bench_power_iteration.py --out results.json   (H200)
       python bench/bench_power_iteration.py --smoke --out /tmp/x.json   (CPU, tiny shapes)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before numwatch.kernels imports triton

import triton
from bench_tensor_stats import copy_bandwidth, measure  # bench/ is this script's directory

from numwatch.kernels import launch
from numwatch.kernels.power_iteration import _CONFIG, PowerIteration, _Config, head_views


def _rank1(m: int, k: int, g: torch.Generator, device: str) -> torch.Tensor:
    u = torch.randn(m, 1, generator=g, device=device)
    v = torch.randn(1, k, generator=g, device=device)
    return (u / u.norm()) @ (v / v.norm())


def gpt2_weights(
    n_layer: int, d: int, n_head: int, device: str, trained_like: bool, seed: int
) -> list:
    """GPT-2's linear weights in Conv1D layout (in, out), N(0, 0.02).

    ``trained_like`` adds four strong rank-1 directions to every weight (sigma 4, 3, 2.5, 2) and
    two to every Q and K head block of c_attn (sigma 1.5 and 1.0, above the head's noise
    ~0.02 * (sqrt(d) + sqrt(d / n_head)) = 0.7): trained heads have a leading direction of their
    own, which the whole-matrix directions alone do not give a head slice.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    dh = d // n_head
    out = []
    for _ in range(n_layer):
        for shape in ((d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)):
            w = torch.randn(shape, generator=g, device=device) * 0.02
            if trained_like:
                for s in (4.0, 3.0, 2.5, 2.0):
                    w += s * _rank1(*shape, g, device)
                if shape[1] == 3 * d:
                    for h in range(2 * n_head):
                        for s in (1.5, 1.0):
                            w[:, h * dh : (h + 1) * dh] += s * _rank1(d, dh, g, device)
            out.append(w)
    return out


def matrix_list(weights: list, d: int, n_head: int) -> list:
    """The 2-D weights plus one (2 * n_head, d, d / n_head) Q/K head batch per layer."""
    heads = [head_views(w[:, : 2 * d], 2 * n_head, out_dim=1) for w in weights[0::4]]
    return weights + heads


def timed_step(mats: list, cfg: _Config, reps: int, device: str) -> dict:
    """``measure`` of one ``PowerIteration.step`` over ``mats`` under tile configuration ``cfg``."""
    pi = PowerIteration(iters=1, backend="triton")
    pi._cfg = cfg
    return measure(lambda: pi.step(mats), reps, device)


def svd_truth(mats: list) -> torch.Tensor:
    """Largest singular value of every matrix (3-D entries expand), float32."""
    out = []
    for m in mats:
        s = torch.linalg.svdvals(m.float())
        out.append(s[..., 0].reshape(-1))
    return torch.cat(out)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter check)")
    ap.add_argument(
        "--sweep",
        default="",
        help="tile configs to time too: 'tile:elems:warps:stages,...' (e.g. 8192:262144:4:3)",
    )
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        sys.exit("the benchmark needs a GPU (use --smoke for a CPU check of the script)")
    n_layer, d, n_head, vocab, ctx = (
        (1, 64, 4, 300, 64) if args.smoke else (12, 768, 12, 50257, 1024)
    )
    reps = 2 if args.smoke else 50
    result: dict = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "smoke": args.smoke,
        "kernel_config": _CONFIG._asdict(),
    }

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    # --- timing ---------------------------------------------------------------------------------
    weights = gpt2_weights(n_layer, d, n_head, device, trained_like=True, seed=0)
    g = torch.Generator(device=device).manual_seed(1)
    wte = torch.randn(vocab, d, generator=g, device=device) * 0.02
    wpe = torch.randn(ctx, d, generator=g, device=device) * 0.01
    mats = matrix_list(weights, d, n_head)
    mats_50 = [wte, wpe, *mats]
    n_mats = len(weights) + 2 * n_head * n_layer
    pi = PowerIteration(iters=1, backend="triton")
    step = measure(lambda: pi.step(mats), reps, device)  # replayed as a CUDA graph on CUDA
    launch.CUDA_GRAPHS = False  # the same step with its kernels launched one by one
    plain = PowerIteration(iters=1, backend="triton")
    step_plain = measure(lambda: plain.step(mats), reps, device)
    launch.CUDA_GRAPHS = True
    step_serial = timed_step(mats, _CONFIG._replace(streams=False), reps, device)  # in turn
    nbytes = sum(m.numel() * m.element_size() for m in mats)
    copy_bw = copy_bandwidth(device, 2**20 if args.smoke else 2**28)  # GB/s, 1 GiB of fp32
    floor_ms = nbytes / copy_bw / 1e6
    sweep = {}
    for spec in filter(None, args.sweep.split(",")):
        tile, elems, warps, stages = (int(x) for x in spec.split(":"))
        sweep[spec] = timed_step(mats, _Config(tile, elems, warps, stages), reps, device)
    pi50 = PowerIteration(iters=1, backend="triton")
    step50 = measure(lambda: pi50.step(mats_50), reps, device)
    ref = PowerIteration(iters=1, backend="torch")
    ref_step = measure(lambda: ref.step(mats), max(2, reps // 10), device)
    torch.linalg.svdvals(torch.randn(64, 64, device=device))  # solver initialization
    sync(device)
    t0 = time.perf_counter()
    svd_50 = svd_truth([wte, wpe, *weights])
    sync(device)
    svd_ms = (time.perf_counter() - t0) * 1e3
    result["timing"] = {
        "matrices": n_mats,
        "weights": len(weights),
        "qk_heads": 2 * n_head * n_layer,
        "pi_step": step,
        "pi_step_plain_launches": step_plain,
        "pi_step_one_stream": step_serial,
        "matrix_bytes": nbytes,
        "copy_bandwidth_GBps": copy_bw,
        "one_read_lower_bound_ms": floor_ms,
        "pi_step_over_one_read": step["gpu_ms"] / floor_ms,
        "sweep_tile_elems_warps_stages": sweep,
        "pi_step_with_wte_wpe": step50,
        "torch_grouped_reference_step": ref_step,
        "svdvals_50_weights_ms": svd_ms,
        "svdvals_over_pi_step_with_wte_wpe": svd_ms / step50["gpu_ms"],
        "torch_reference_over_pi_step": ref_step["gpu_ms"] / step["gpu_ms"],
        "targets_met": {
            "<1ms_device": step["gpu_ms"] < 1.0,
            "<1ms_wall": step["wall_ms"] < 1.0,
            ">=100x_vs_svdvals": svd_ms / step50["gpu_ms"] >= 100,
        },
    }
    save()

    # --- accuracy on trained-like weights, warm-started, drifting -------------------------------
    truth_w = svd_50[2:]
    est = PowerIteration(iters=1, backend="triton")
    drift = torch.Generator(device=device).manual_seed(2)
    errs: dict = {}
    for t in range(1, 6 if args.smoke else 51):
        for w in weights:
            w.add_(torch.randn(w.shape, generator=drift, device=device), alpha=1e-5)
        got = est.step(mats)
        if t in (1, 5, 10, 20, 49, 50):
            truth = torch.cat([svd_truth(weights), svd_truth(mats[len(weights) :])])
            rel = ((got - truth) / truth).abs()
            errs[t] = {
                "weights_max": rel[: len(weights)].max().item(),
                "heads_max": rel[len(weights) :].max().item(),
                "median": rel.median().item(),
            }
    result["trained_like_warm_start"] = {
        "drift_per_step": "N(0, 1e-5) per element",
        "max_rel_err_vs_svdvals_after_steps": errs,
        "truth_drift_check_max_rel": ((svd_truth(weights) - truth_w) / truth_w).abs().max().item(),
    }
    save()

    # --- convergence on Gaussian random-init weights, cold start --------------------------------
    gauss = gpt2_weights(1 if args.smoke else 2, d, n_head, device, False, seed=3)
    gmats = matrix_list(gauss, d, n_head)
    truth = svd_truth(gmats)
    cold = PowerIteration(iters=1, backend="triton")
    curve, first = {}, {"5%": None, "1%": None}
    checkpoints = (1, 2, 5) if args.smoke else (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    for it in range(1, checkpoints[-1] + 1):
        rel = ((cold.step(gmats) - truth) / truth).abs()
        worst = rel.max().item()
        for name, tol in (("5%", 0.05), ("1%", 0.01)):
            if first[name] is None and worst <= tol:
                first[name] = it
        if it in checkpoints:
            curve[it] = {"max": worst, "median": rel.median().item()}
    result["gaussian_cold_start"] = {
        "matrices": len(truth),
        "max_rel_err_vs_iterations": curve,
        "iterations_until_all_within": first,
    }
    save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
