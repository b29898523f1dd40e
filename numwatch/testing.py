"""Helpers shared by numwatch's tests and by users who test their own integration.

The same test files run on a CPU (torch references; Triton kernels through the interpreter)
and on a GPU (compiled kernels): ``requires_gpu`` marks what only the second can do.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

__all__ = [
    "PlantedCounts",
    "devices",
    "hook_state",
    "host_never_waits",
    "kernel_devices",
    "planted_tensor",
    "planted_tie_attention",
    "requires_gpu",
    "triton_interpreting",
]

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def hook_state(model: torch.nn.Module) -> list:
    """Every forward, forward-pre and backward hook of ``model``'s modules and every
    post-accumulate-grad hook of its parameters: equal before attach and after detach."""
    return [
        (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
        for m in model.modules()
    ] + [dict(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()]


@contextmanager
def host_never_waits(budget_s: float = 2.0) -> Iterator[None]:
    """Fail if the host waits for the current CUDA stream inside the block.

    ``torch.cuda.set_sync_debug_mode`` sees the syncs torch itself makes, not a wait inside the
    driver (a copy from pageable host memory may wait for its stream). Here a sleep kernel of
    ``budget_s`` holds the stream first: any wait for the stream, or for the whole device, ends
    only after the sleep, so the sleep still running at the block's end proves there was none.
    Waits on other streams alone go unseen. The block must issue its work in under ``budget_s``,
    and run warm: the first launch of a kernel loads its module (CUDA's lazy loading), which can
    wait for the device.
    """
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe_cycles = 10_000_000
    probe_ms = []
    for _ in range(3):  # the fastest: other processes' kernels may share the GPU meanwhile
        start.record()
        torch.cuda._sleep(probe_cycles)
        end.record()
        end.synchronize()
        probe_ms.append(start.elapsed_time(end))
    cycles = int(probe_cycles * budget_s * 1e3 / min(probe_ms))
    torch.cuda._sleep(cycles)
    slept = torch.cuda.Event()
    slept.record()
    t0 = time.perf_counter()
    yield
    elapsed = time.perf_counter() - t0
    if slept.query():  # a wait ends with the sleep, so its time says nothing more
        raise AssertionError(
            f"the host waited for the GPU inside the block (it returned after {elapsed:.3f} s, "
            f"the stream held busy for about {budget_s} s; unless the block's own host work "
            "outlasted that)"
        )
    torch.cuda.synchronize()


def triton_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def devices() -> list[str]:
    """Devices the torch paths are tested on: always CPU, plus CUDA when present."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def kernel_devices() -> list[str]:
    """Devices Triton kernels can run on here: CUDA compiled, or CPU through the interpreter."""
    out = []
    if torch.cuda.is_available():
        out.append("cuda")
    if triton_interpreting():
        out.append("cpu")
    return out


@dataclass(frozen=True)
class PlantedCounts:
    """What ``planted_tensor`` put in: exact answers for the tensor-statistics oracle."""

    numel: int
    nan: int
    posinf: int
    neginf: int
    zeros: int
    subnormal: int
    absmax: float


def planted_tensor(
    dtype: torch.dtype,
    *,
    nan: int = 0,
    posinf: int = 0,
    neginf: int = 0,
    zeros: int = 0,
    subnormal: int = 0,
    normal: int = 16,
    absmax: float = 8.0,
    shape: tuple[int, ...] | None = None,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.Tensor, PlantedCounts]:
    """A shuffled tensor with exactly the requested numbers of each kind of value.

    Normal values lie in [1, absmax] in magnitude with one element equal to -absmax; subnormals
    are multiples of the dtype's smallest subnormal (nonzero, below its smallest normal).
    """
    if normal < 1:
        raise ValueError("planted_tensor needs at least one normal value")
    g = torch.Generator().manual_seed(seed)
    finfo = torch.finfo(dtype)
    smallest_sub = finfo.smallest_normal * finfo.eps  # smallest positive subnormal
    parts = [
        torch.full((nan,), float("nan")),
        torch.full((posinf,), float("inf")),
        torch.full((neginf,), float("-inf")),
        torch.zeros(zeros),
        (torch.randint(1, 4, (subnormal,), generator=g, dtype=torch.float64) * smallest_sub)
        * torch.where(torch.rand(subnormal, generator=g) < 0.5, -1.0, 1.0).double(),
        1
        + (absmax - 1)
        * torch.rand(normal, generator=g).double()
        * torch.where(torch.rand(normal, generator=g) < 0.5, -1.0, 1.0).double(),
    ]
    values = torch.cat([p.double() for p in parts])
    values[-1] = -absmax
    values = values[torch.randperm(values.numel(), generator=g)].to(dtype)
    if shape is not None:
        values = values.reshape(shape)
    counts = PlantedCounts(values.numel(), nan, posinf, neginf, zeros, subnormal, absmax)
    return values.to(device), counts


def planted_sink_attention(
    B: int = 1,
    H: int = 2,
    T: int = 64,
    D: int = 64,
    *,
    n_sink: int = 2,
    gap: float = 14.0,
    dtype: torch.dtype = torch.bfloat16,
    v_range: tuple[float, float] = (-4.0, -2.0),
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V (B, H, T, D) where keys 0..n_sink-1 are identical "sinks" whose logit beats every
    other key by at least ``gap`` (with the default scale 1/sqrt(D)), and V lies in ``v_range``.

    This is the DESIGN.md setup: every row that sees two sinks has a repeated maximum, so the
    unnormalised P̄ holds several exact 1.0 entries and a BF16-accumulating kernel errs one-signed.
    """
    g = torch.Generator().manual_seed(seed)
    scale = D**-0.5
    q = torch.zeros(B, H, T, D, dtype=torch.float64)
    k = torch.zeros(B, H, T, D, dtype=torch.float64)
    q[..., 0] = 1.0
    q[..., 1:] = torch.rand(B, H, T, D - 1, generator=g, dtype=torch.float64) - 0.5
    k[..., 1:] = (torch.rand(B, H, T, D - 1, generator=g, dtype=torch.float64) - 0.5) / D
    # Other keys score |q·k| * scale < 1; the sinks score (gap + 1) exactly (q[..., 0] == 1).
    k[:, :, :n_sink, :] = 0.0
    k[:, :, :n_sink, 0] = (gap + 1.0) / scale
    lo, hi = v_range
    v = lo + (hi - lo) * torch.rand(B, H, T, D, generator=g, dtype=torch.float64)
    return q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device)


def planted_tie_attention(
    n_ties: int,
    gap: float = 14.0,
    dtype: torch.dtype = torch.bfloat16,
    b: int = 1,
    h: int = 2,
    t: int = 256,
    d: int = 64,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DESIGN.md §1 setup with Gaussian logits: ``n_ties`` identical sink keys whose logit
    exceeds the others (about N(0, 1)) by ``gap`` in every row, V uniform in [-4, -2)."""
    g = torch.Generator().manual_seed(seed)
    scale = d**-0.5
    q = torch.randn(b, h, t, d, generator=g)
    k = torch.randn(b, h, t, d, generator=g) / (math.sqrt(d - 1) * scale)
    q[..., 0] = 4.0
    k[..., 0] = 0.0
    k[:, :, :n_ties] = 0.0
    k[:, :, :n_ties, 0] = gap / (4.0 * scale)
    v = -(2.0 + 2.0 * torch.rand(b, h, t, d, generator=g))
    return q.to(dtype), k.to(dtype), v.to(dtype)
