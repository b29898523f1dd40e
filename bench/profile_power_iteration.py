"""Where one power-iteration step's device time goes, on GPT-2's matrices (H200).

The step's matrices split into the kernel's launch classes (row lengths padded to a power of two):
c_attn and c_fc (rows of 2304 and 3072), the two projections (768), the Q/K head slices (64).
For each class alone: device time against its one-read floor (bytes over the measured copy
bandwidth), under a sweep of tile configurations (``tile:elems:warps:stages``, the kernel's
``_Config``). ``--all`` times only the whole list, under configurations that also switch the
side-by-side streams off (``:False``). Last, torch.profiler's device time per kernel over 20
steps launched one by one (no CUDA graph).

Session 14 used it to find that a separate finishing launch took a fifth of the step (result
files: ``power_iteration_profile_h200*.json``).

    python bench/profile_power_iteration.py --out bench/results/power_iteration_profile_h200.json
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_power_iteration import gpt2_weights, matrix_list, timed_step
from bench_tensor_stats import copy_bandwidth
from torch.profiler import ProfilerActivity, profile

from numwatch.kernels import launch
from numwatch.kernels.power_iteration import _CONFIG, PowerIteration, _Config

PER_CLASS = [
    *((t, e, w, 3) for t in (4096, 8192, 16384) for e in (131072, 262144, 524288) for w in (4, 8)),
    (8192, 262144, 4, 2),
    (8192, 262144, 4, 4),
    (16384, 262144, 8, 4),
    (4096, 262144, 4, 4),
]
WHOLE = [
    (8192, 262144, 4, 3, True),
    (8192, 262144, 4, 3, False),
    (4096, 131072, 4, 3, True),
    (16384, 524288, 8, 3, True),
    (8192, 131072, 4, 3, True),
    (8192, 524288, 4, 3, True),
    (8192, 262144, 4, 4, True),
    (16384, 262144, 8, 3, True),
]


def sweep(mats: list, specs: list, reps: int = 50) -> dict[str, float | str]:
    out: dict[str, float | str] = {}
    for spec in specs:
        key = ":".join(map(str, spec))
        try:
            out[key] = round(timed_step(mats, _Config(*spec), reps, "cuda")["gpu_ms"], 5)
        except Exception as e:  # a config that does not compile is a result too
            out[key] = repr(e)[:100]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--all", action="store_true", help="only the whole list, streams on and off")
    args = p.parse_args()
    weights = gpt2_weights(12, 768, 12, "cuda", trained_like=True, seed=0)
    mats = matrix_list(weights, 768, 12)
    classes = {
        "wide_c_attn_c_fc": weights[0::4] + weights[2::4],
        "narrow_c_proj_mlp_proj": weights[1::4] + weights[3::4],
        "heads": mats[len(weights) :],
        "all": mats,
    }
    bw = copy_bandwidth("cuda", 2**28)
    out: dict = {"gpu": torch.cuda.get_device_name(), "copy_GBps": bw, "default": _CONFIG._asdict()}
    out["classes"] = {}
    for name, mats in classes.items():
        if args.all and name != "all":
            continue
        nbytes = sum(m.numel() * m.element_size() for m in mats)
        times = sweep(mats, WHOLE if name == "all" else PER_CLASS)
        best = min((v, k) for k, v in times.items() if isinstance(v, float))
        out["classes"][name] = {
            "bytes": nbytes,
            "floor_ms": nbytes / bw / 1e6,
            "best": best,
            "all": times,
        }
        print(name, "floor", round(nbytes / bw / 1e6, 4), "best", best, flush=True)
    launch.CUDA_GRAPHS = False  # one entry per kernel launch in the profile
    pi = PowerIteration(iters=1, backend="triton")
    for _ in range(3):
        pi.step(classes["all"])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            pi.step(classes["all"])
        torch.cuda.synchronize()
    out["profile_us_per_call"] = {
        k.key: [k.count, k.device_time_total / max(k.count, 1)]
        for k in prof.key_averages()
        if k.device_time_total > 0
    }
    print(out["profile_us_per_call"])
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
