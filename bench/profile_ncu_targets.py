"""The kernels bench/profile_ncu.sh profiles under Nsight Compute, each launched twice.

- the attention statistics kernel (B4 H16 T4096 D128, no entropy) with its tuned 64x128 tiles
  (4 warps, 3 stages) and with 64x64 tiles (2 stages): the two occupancy regimes;
- the Triton flash-attention forward at D 64 (B4 H32 T4096), plain and stabilized.
"""

from __future__ import annotations

import math

import torch

from numwatch.kernels import attention_stats as stats
from numwatch.kernels import flash_attention_triton as tri


def main() -> None:
    thr = stats.saturation_threshold(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))  # fmt: skip
    for cfg in ((64, 128, 4, 3), (64, 64, 4, 2)):
        for _ in range(2):
            stats._head_stats_triton(q, k, None, False, 1 / math.sqrt(128), None, None, thr,
                                     False, cfg)  # fmt: skip
    q, k, v = (torch.randn(4, 32, 4096, 64, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))  # fmt: skip
    for mode in (0, 1):  # plain, stabilized
        for _ in range(2):
            tri.triton_forward(q, k, v, None, False, 0.125, mode, 2.0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
