"""Health statistics of many tensors at once: extremes, moments and special-value counts.

One row of ``N_STATS`` float64 values per tensor (columns below). Extremes and moments are over
the *finite* values only, so one NaN does not erase the rest of the picture; the non-finite values
are counted separately. Counts are exact (float64 holds integers up to 2**53).

``tensor_stats`` is what the probes call. ``tensor_stats_reference`` is the pure-torch
implementation: the CPU path and the oracle of the fused kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "ABSMAX",
    "MAX",
    "MIN",
    "NAN",
    "NEGINF",
    "NUMEL",
    "N_STATS",
    "POSINF",
    "STAT_NAMES",
    "SUBNORMAL",
    "SUM",
    "SUMSQ",
    "UNDERFLOW",
    "ZERO",
    "combine_stats",
    "empty_stats",
    "tensor_stats",
    "tensor_stats_reference",
]

NUMEL, ABSMAX, MIN, MAX, SUM, SUMSQ, NAN, POSINF, NEGINF, ZERO, SUBNORMAL, UNDERFLOW = range(12)
N_STATS = 12
STAT_NAMES = (
    "numel",  # all elements
    "absmax",  # max |x| over finite x (0 when none)
    "min",  # min over finite x (+inf when none)
    "max",  # max over finite x (-inf when none)
    "sum",  # sum of finite x
    "sumsq",  # sum of finite x**2
    "nan",
    "posinf",
    "neginf",
    "zero",  # exact zeros (+0 and -0)
    "subnormal",  # non-zero |x| below the smallest normal of the tensor's own dtype
    "underflow",  # non-zero finite |x| below the smallest normal of the underflow dtype
)

# How a row of an earlier call merges with the row of a later one (several forward calls of a
# module, several steps between flushes): extremes take max/min, everything else adds.
_MAX_COLUMNS = (ABSMAX, MAX)
_MIN_COLUMNS = (MIN,)


def empty_stats(n: int, device: torch.device | str) -> torch.Tensor:
    """Rows that are the identity of ``combine_stats``."""
    out = torch.zeros(n, N_STATS, dtype=torch.float64, device=device)
    out[:, MIN] = float("inf")
    out[:, MAX] = float("-inf")
    return out


def combine_stats(acc: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Merge rows ``new`` into ``acc`` (same shape), in place; returns ``acc``."""
    torch.maximum(acc[..., ABSMAX], new[..., ABSMAX], out=acc[..., ABSMAX])
    torch.maximum(acc[..., MAX], new[..., MAX], out=acc[..., MAX])
    torch.minimum(acc[..., MIN], new[..., MIN], out=acc[..., MIN])
    for col in (NUMEL, SUM, SUMSQ, NAN, POSINF, NEGINF, ZERO, SUBNORMAL, UNDERFLOW):
        acc[..., col] += new[..., col]
    return acc


def _tiny(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).tiny


def _one_tensor_stats(x: torch.Tensor, underflow_tiny: float) -> torch.Tensor:
    """Row of statistics of one floating tensor, on its device, without a host sync."""
    own_tiny = _tiny(x.dtype)
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()  # exact for bf16/fp16/fp8; counts use the original dtype's thresholds
    x = x.reshape(-1)
    finite = torch.isfinite(x)
    xf = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    a = xf.abs()
    nonzero = a != 0
    inf = float("inf")
    row = torch.stack(
        [
            torch.full((), float(x.numel()), dtype=torch.float64, device=x.device),
            a.amax().double(),
            torch.where(finite, x, inf).amin().double(),
            torch.where(finite, x, -inf).amax().double(),
            xf.sum(dtype=torch.float64),
            xf.square().sum(dtype=torch.float64),
            torch.isnan(x).sum().double(),
            (x == inf).sum().double(),
            (x == -inf).sum().double(),
            (x == 0).sum().double(),
            (nonzero & (a < own_tiny)).sum().double(),
            (nonzero & (a < underflow_tiny)).sum().double(),
        ]
    )
    return row


def tensor_stats_reference(
    tensors: Sequence[torch.Tensor], underflow_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Statistics of each tensor, ``(len(tensors), N_STATS)`` float64 on the tensors' device.

    ``underflow_dtype`` sets the threshold of the UNDERFLOW column (e.g. ``torch.float16`` for fp32
    gradients bound for an fp16 all-reduce); ``None`` uses each tensor's own dtype, in which case
    UNDERFLOW equals SUBNORMAL. Empty tensors give the identity row (numel 0).
    """
    if not tensors:
        raise ValueError("tensor_stats needs at least one tensor")
    device = tensors[0].device
    rows = []
    for t in tensors:
        if t.device != device:
            raise ValueError(f"tensor_stats needs one device, got {device} and {t.device}")
        if not t.is_floating_point():
            raise TypeError(f"tensor_stats needs floating-point tensors, got {t.dtype}")
        if t.numel() == 0:
            rows.append(empty_stats(1, device)[0])
            continue
        tiny = _tiny(underflow_dtype if underflow_dtype is not None else t.dtype)
        rows.append(_one_tensor_stats(t.detach(), tiny))
    return torch.stack(rows)


def tensor_stats(
    tensors: Sequence[torch.Tensor],
    underflow_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Statistics of each tensor (see ``tensor_stats_reference``) with the chosen backend.

    ``backend``: ``"torch"`` (reference), ``"triton"`` (fused kernel), ``"auto"`` (the fused kernel
    on CUDA, the reference elsewhere).
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "triton":
        raise NotImplementedError(
            "the fused Triton tensor-statistics kernel is not yet supported; "
            "use kernel_backend='torch' or 'auto'"
        )
    return tensor_stats_reference(tensors, underflow_dtype)
