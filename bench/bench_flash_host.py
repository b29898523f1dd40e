"""Host time per call of numwatch's flash attention against SDPA's cuDNN and FA2 backends, with
an A/B of the launch path in the same process.

At GPT-2's head shapes the GPU finishes a layer's attention in a few tens of microseconds, so a
training loop that routes every layer to our kernel (Monitor.swap_attention) pays mostly for the
host work of each call: argument checks, tensor descriptors, Triton's launcher. "before" is the
launch path as it was (JITFunction.run binding and specializing ~40 arguments per launch, and
TensorDescriptor's checked constructor); "after" is the current one (launch.Relauncher straight
into the compiled launcher, descriptor fields filled in directly). Head dim 128 on Hopper runs
the Gluon forward, whose launch has the same two paths (session 16). bench_flash_attention.host_us
does the timing: ``calls`` calls back to back, one sync.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import bench_flash_attention as bfa  # bench/ is the script's folder, first on sys.path
import torch
import triton

from numwatch.kernels import flash_attention_gluon as fag
from numwatch.kernels import flash_attention_triton as fat
from numwatch.kernels import launch

LAUNCHERS = (fat._launch_fwd, fat._launch_delta, fat._launch_dkdv, fat._launch_dq)
LAUNCHERS += (fag._launch,) if fag.AVAILABLE else ()
DIRECT = launch._direct_launch_supported
MAKE_DESC = (fat._make_desc, fag._make_desc)


def use_path(after: bool) -> None:
    fat._make_desc = MAKE_DESC[0] if after else fat.TensorDescriptor
    if fag.AVAILABLE:
        fag._make_desc = MAKE_DESC[1] if after else fag.TensorDescriptor
    launch._direct_launch_supported = DIRECT if after else (lambda compiled: False)
    for launcher in LAUNCHERS:
        launcher._compiled.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    report: dict = {
        "benchmark": "flash attention host time per call (us), causal bf16",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "timing": "300 calls back to back after 20 warm-up calls, one sync (bench_flash_attention"
        ".host_us); fwd_bwd = forward + torch.autograd.backward",
        "rows": [],
    }
    # GPT-2's attention: 12 heads of 64; T 128 leaves the GPU idle, T 1024 is the training shape;
    # 16 heads of 128 at T 128: the Gluon forward's launch
    for shape in [(1, 12, 128, 64), (8, 12, 1024, 64), (1, 16, 128, 128)]:
        for rnd in range(args.rounds):
            for path in ("before", "after"):
                use_path(path == "after")
                r = bfa.host_us(shape, causal=True)
                row = {"path": path, "round": rnd, **r}
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
    use_path(True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
