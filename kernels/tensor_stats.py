"""Health statistics of many tensors at once: extremes, moments and special-value counts.

One row of ``N_STATS`` float64 values per tensor (columns below). Extremes and moments are over
the *finite* values only, so one NaN does not erase the rest of the picture; the non-finite values
are counted separately. Counts are exact (float64 holds integers up to 2**53).

``tensor_stats`` is what the probes call. ``tensor_stats_reference`` is the pure-torch
implementation: the oracle of the fused kernel and of ``tensor_stats_cpu``, the CPU path.
"""

from __future__ import annotations

import functools
import math
import operator
import os
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .host_copy import to_device
from .launch import Relauncher

__all__ = [
    "ABSMAX",
    "MAX",
    "MAX_COLUMNS",
    "MIN",
    "MIN_COLUMNS",
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
    "tensor_stats_cpu",
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
# module, several steps between flushes, several ranks): extremes take max/min, the rest adds.
MAX_COLUMNS = (ABSMAX, MAX)
MIN_COLUMNS = (MIN,)


def empty_stats(n: int, device: torch.device | str) -> torch.Tensor:
    """Rows that are the identity of ``combine_stats``."""
    out = torch.zeros(n, N_STATS, dtype=torch.float64, device=device)
    out[:, MIN] = float("inf")
    out[:, MAX] = float("-inf")
    return out


def combine_stats(acc: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Merge rows ``new`` into ``acc`` (same shape), in place; returns ``acc``."""
    for col in range(N_STATS):
        if col in MAX_COLUMNS:
            torch.maximum(acc[..., col], new[..., col], out=acc[..., col])
        elif col in MIN_COLUMNS:
            torch.minimum(acc[..., col], new[..., col], out=acc[..., col])
        else:
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
            xf.double().square().sum(),  # squared in fp32, 2e19 would read +inf
            torch.isnan(x).sum().double(),
            (x == inf).sum().double(),
            (x == -inf).sum().double(),
            (x == 0).sum().double(),
            (nonzero & (a < own_tiny)).sum().double(),
            (nonzero & (a < underflow_tiny)).sum().double(),
        ]
    )
    return row


def _check_tensors(tensors: Sequence[torch.Tensor]) -> None:
    if not tensors:
        raise ValueError("tensor_stats needs at least one tensor")
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"tensor_stats needs one device, got {device} and {t.device}")
        if not t.is_floating_point():
            raise TypeError(f"tensor_stats needs floating-point tensors, got {t.dtype}")


def tensor_stats_reference(
    tensors: Sequence[torch.Tensor], underflow_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Statistics of each tensor, ``(len(tensors), N_STATS)`` float64 on the tensors' device.

    ``underflow_dtype`` sets the threshold of the UNDERFLOW column (e.g. ``torch.float16`` for fp32
    gradients bound for an fp16 all-reduce); ``None`` uses each tensor's own dtype, in which case
    UNDERFLOW equals SUBNORMAL. Empty tensors give the identity row (numel 0).
    """
    _check_tensors(tensors)
    device = tensors[0].device
    rows = []
    for t in tensors:
        if t.numel() == 0:
            rows.append(empty_stats(1, device)[0])
            continue
        tiny = _tiny(underflow_dtype if underflow_dtype is not None else t.dtype)
        rows.append(_one_tensor_stats(t.detach(), tiny))
    return torch.stack(rows)


# --- CPU path ------------------------------------------------------------------------------------
#
# On a CPU, ops cost more in dispatch than in arithmetic (the reference's ~27 ops per tensor made
# the demo model's 29 gradients take 8 ms), and reading a value back costs no device sync. So the
# CPU path branches on the data: a tensor whose float64 sum is finite holds no NaN/Inf (finite
# fp32 values cannot overflow a float64 sum), and its row takes about ten ops, read back as
# Python floats (one tensor is built for all rows at the end); others go through the reference.


def _finite_row(x: torch.Tensor, total: float, own_tiny: float, underflow_tiny: float) -> list:
    """Row of a tensor known to hold only finite values (flat, upcast to fp32 or fp64);
    ``own_tiny`` is the smallest normal of its original dtype."""
    mn, mx = torch.aminmax(x)
    lo, hi = mn.item(), mx.item()
    a = x.abs()
    zeros = int((a == 0).sum())
    below_own = int((a < own_tiny).sum()) - zeros
    if x.dtype == torch.float32:  # a threshold below fp32's range (float64's) would read 0
        underflow_tiny = max(underflow_tiny, 2.0**-149)
    below_uf = below_own if underflow_tiny == own_tiny else int((a < underflow_tiny).sum()) - zeros
    sumsq = x.double().square().sum().item()  # squared in fp32, 2e19 would read +inf
    return [
        float(x.numel()), max(abs(lo), abs(hi)), lo, hi, total, sumsq,
        0.0, 0.0, 0.0, float(zeros), float(below_own), float(below_uf),
    ]  # fmt: skip


def tensor_stats_cpu(
    tensors: Sequence[torch.Tensor], underflow_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``tensor_stats_reference``'s rows for CPU tensors (sums equal up to float64 rounding
    order), with a short path for tensors without NaN/Inf; it reads values back, so it is for
    the CPU only."""
    _check_tensors(tensors)
    if tensors[0].device.type != "cpu":
        raise ValueError(f"tensor_stats_cpu needs CPU tensors, got {tensors[0].device}")
    rows = []
    for t in tensors:
        x = t.detach().reshape(-1)
        total = x.sum(dtype=torch.float64).item()
        if x.numel() == 0 or not math.isfinite(total):
            rows.append(tensor_stats_reference([t], underflow_dtype)[0].tolist())
            continue
        own = _tiny(t.dtype)
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()  # exact for bf16/fp16/fp8
        uf = _tiny(underflow_dtype) if underflow_dtype is not None else own
        rows.append(_finite_row(x, total, own, uf))
    return torch.tensor(rows, dtype=torch.float64)


# --- fused Triton kernel -------------------------------------------------------------------------
#
# Work split (fixed, so results are bitwise reproducible): each tensor is cut into chunks of
# ``iters * BLOCK`` elements, ``iters`` a function of its numel only; one program per chunk reads
# it once and writes ten fp32 partials (min, max, sum, sumsq and six counts, each count <= 2**24 so
# exact in fp32). A second launch reduces each tensor's partials in float64, in a fixed order,
# and writes the row. No atomics. One partials launch per storage format, one finalize launch.
#
# A program first reads its chunk assuming every value is finite (moments, extremes and the zero /
# subnormal / underflow counts, about 10 integer and float ops per value); only a chunk that holds
# an Inf or NaN is read a second time with non-finite values excluded and counted by kind.
#
# Classification works on the fp32 bit pattern of each value (after an exact upcast), with integer
# compares, so the counts do not depend on how the GPU treats subnormal floats. fp8 is decoded from
# its bytes with integer ops (the Triton 3.9 interpreter mis-converts fp8 NaN).

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs no triton
    triton = None

_FMT_FP32, _FMT_BF16, _FMT_FP16, _FMT_E4M3FN, _FMT_E5M2 = range(5)
_FORMATS = {torch.float32: _FMT_FP32, torch.bfloat16: _FMT_BF16, torch.float16: _FMT_FP16}
for _name, _fmt in (("float8_e4m3fn", _FMT_E4M3FN), ("float8_e5m2", _FMT_E5M2)):
    if hasattr(torch, _name):
        _FORMATS[getattr(torch, _name)] = _fmt
_N_PARTIALS = 10  # min, max, sum, sumsq, non-finite, nan, -inf, zero, below own tiny, below uf tiny


class _Config(NamedTuple):
    """Launch shape of the fused kernel (it also fixes the work split, hence the exact sums)."""

    block: int = 1024  # elements per tile
    # H200 sweep with 4 tiles per step for 16-bit formats: 4 warps beat 8 on GPT-2's gradients
    # (fp32 0.140 vs 0.146 ms, bf16 0.085 vs 0.093 ms) and lose on 1 GiB of bf16 (0.293 vs 0.279)
    num_warps: int = 4
    # H200 sweep (bench/results/tensor_stats_h200.json): 32 / 2048 beat 16 / 4096 on GPT-2's
    # gradients (fp32 0.142 vs 0.156 ms, bf16 0.112 vs 0.132 ms) and on 1 GiB (0.262 vs 0.273 ms)
    min_iters: int = 32  # tiles per program at least, to amortize its table reads and reductions
    target_chunks: int = 2048  # a large tensor is split into about this many programs
    final_block: int = 512  # partial rows per step of the finalize loop


_CONFIG = _Config()
_MAX_CHUNK = 1 << 24  # elements per program: fp32 partial counts stay exact


def _chunk_iters(numel: int, cfg: _Config) -> int:
    """Tiles per program for a tensor of ``numel`` elements (depends on the shape only)."""
    iters = max(cfg.min_iters, -(-numel // (cfg.block * cfg.target_chunks)))
    return min(iters, _MAX_CHUNK // cfg.block, 0xFFFF)  # a lane's count must fit 16 bits


@functools.cache
def _threshold(dtype: torch.dtype) -> float:
    """``dtype``'s smallest normal as an fp32 value; fp32's smallest subnormal where no fp32
    value lies below it (then only zeros are below). A float, because triton would turn an
    integer argument equal to 1 into a constant."""
    tiny = torch.tensor(torch.finfo(dtype).tiny, dtype=torch.float32).item()
    return max(tiny, 2.0**-149)


if triton is not None:

    @triton.jit
    def _load_bits(ptr, offs, mask, FMT: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr):
        """fp32 bit patterns (int32) of the values at ``ptr + offs``; masked lanes give +0."""
        if FMT == 0:
            p = ptr.to(tl.pointer_type(tl.float32))
        elif FMT == 1:
            p = ptr.to(tl.pointer_type(tl.uint16))
        elif FMT == 2:
            p = ptr.to(tl.pointer_type(tl.float16))
        else:
            p = ptr.to(tl.pointer_type(tl.uint8))
        if ALIGNED:
            p = tl.multiple_of(p, 16)
        v = tl.load(p + offs, mask=mask, other=0) if MASKED else tl.load(p + offs)
        if FMT == 0:
            bits = v.to(tl.int32, bitcast=True)
        elif FMT == 1:
            bits = v.to(tl.int32) << 16  # bf16 is the top half of fp32
        elif FMT == 2:
            bits = v.to(tl.float32).to(tl.int32, bitcast=True)
        elif FMT == 3:
            # e4m3fn: s eeee mmm, bias 7, no inf, NaN = s1111111, subnormal = m * 2**-9
            b = v.to(tl.int32)
            sign = (b & 0x80) << 24
            e = (b >> 3) & 0xF
            m = b & 7
            normal = sign | ((e + 120) << 23) | (m << 20)
            sub = sign | (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
            bits = tl.where(e == 0, sub, normal)
            bits = tl.where((b & 0x7F) == 0x7F, 0x7FC00000, bits)
        else:
            # e5m2 is the top byte of fp16
            h = (v.to(tl.uint16) << 8).to(tl.float16, bitcast=True)
            bits = h.to(tl.float32).to(tl.int32, bitcast=True)
        return bits

    @triton.jit
    def _count_where(count, cond):
        """``count`` (fp32 lanes) plus one where ``cond``: a compare that yields 1.0 or 0.0 and
        one add, both off the integer pipe that bounds the bf16 and fp16 loops. A lane counts at
        most 0xFFFF tiles, so its fp32 count stays exact."""
        return count + tl.where(cond, 1.0, 0.0)

    @triton.jit
    def _fast_tile(bits, mn, mx, s, sq, c_zero, c_own, c_uf, T_OWN, T_UF, SAME_UF: tl.constexpr):
        """Fold one tile as if all its values were finite. A non-finite value leaves its lane's
        ``s`` non-finite for good (Inf and NaN absorb every later sum), which is how the caller
        finds the chunks to read again with no per-value test: bf16 and fp16 tensors are bound by
        the ALU, not by memory, so every op per value counts."""
        x = bits.to(tl.float32, bitcast=True)
        ax = tl.abs(x)
        s += x
        sq += x * x
        mn = tl.minimum(mn, x)
        mx = tl.maximum(mx, x)
        c_zero = _count_where(c_zero, x == 0.0)
        c_own = _count_where(c_own, ax < T_OWN)
        if not SAME_UF:
            c_uf = _count_where(c_uf, ax < T_UF)
        return mn, mx, s, sq, c_zero, c_own, c_uf

    @triton.jit
    def _accumulate(
        bits, valid, mn, mx, s, sq, c_zero, c_own, c_uf, c_nonfin_nan, c_ninf,
        T_OWN, T_UF, SAME_UF: tl.constexpr, MASKED: tl.constexpr,
    ):  # fmt: skip
        """Fold one tile into the per-lane accumulators, excluding non-finite values from the
        moments and extremes (they become 0, resp. NaN, which min/max ignore) and counting them.
        Non-finite and NaN counts share one int32 (a lane sees one value per tile and a program
        reads at most 0xFFFF tiles)."""
        if MASKED:
            bits = tl.where(valid, bits, 0x3F800000)  # 1.0: counted nowhere, excluded below
        x = bits.to(tl.float32, bitcast=True)
        ab = bits & 0x7FFFFFFF
        fin = ab < 0x7F800000
        if MASKED:
            fin = fin & valid
        xf = tl.where(fin, x, 0.0)
        s += xf
        sq += xf * xf
        xn = tl.where(fin, x, float("nan"))
        mn = tl.minimum(mn, xn)
        mx = tl.maximum(mx, xn)
        ax = tl.abs(x)
        c_zero = _count_where(c_zero, x == 0.0)
        c_own = _count_where(c_own, ax < T_OWN)  # zeros included
        if not SAME_UF:
            c_uf = _count_where(c_uf, ax < T_UF)
        nonfin = (0x7F7FFFFF - ab) >> 31  # -1 where ab >= Inf
        nan = (0x7F800000 - ab) >> 31  # -1 where ab > Inf
        c_nonfin_nan -= nonfin + (nan << 16)
        c_ninf += tl.where(bits == -8388608, 1, 0)
        return mn, mx, s, sq, c_zero, c_own, c_uf, c_nonfin_nan, c_ninf

    # sizes vary with the tensor list: no value specialization, so one compile per format serves all
    @triton.jit(do_not_specialize=["n_tensors", "n_chunks_total", "chunk_base"])
    def _stats_partials_kernel(
        table_ptr,  # int64 sections: ptr, numel, iters, first, n_chunks, out_row; chunk t, start
        partials_ptr,  # (N_PARTIALS, n_chunks_total) fp32
        n_tensors,
        n_chunks_total,
        chunk_base,  # first global chunk of this launch
        T_OWN,  # fp32: the own dtype's smallest normal
        T_UF,  # fp32: the underflow dtype's smallest normal
        FMT: tl.constexpr,
        SAME_UF: tl.constexpr,
        ALIGNED: tl.constexpr,  # every tensor of this launch starts at a multiple of 16 bytes
        BLOCK: tl.constexpr,
        UNROLL: tl.constexpr,  # 2 or 4 tiles per step of the fast loop
    ):
        row = chunk_base + tl.program_id(0)
        chunk_sec = table_ptr + 6 * n_tensors
        t = tl.load(chunk_sec + row)
        start = tl.load(chunk_sec + n_chunks_total + row)  # int64 element offset
        base = tl.load(table_ptr + t)
        numel = tl.load(table_ptr + n_tensors + t)
        iters = tl.load(table_ptr + 2 * n_tensors + t)
        if ALIGNED:
            start = tl.multiple_of(start, BLOCK)
        offs = tl.arange(0, BLOCK)
        remaining = numel - start
        n_full = tl.minimum(iters, remaining // BLOCK)
        # Fast pass over the full tiles: every column as if all values were finite (zeros,
        # subnormals and values below the underflow threshold are counted exactly).
        mn = tl.full([BLOCK], float("inf"), tl.float32)
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        sq = tl.zeros([BLOCK], tl.float32)
        c_zero = tl.zeros([BLOCK], tl.float32)
        c_own = tl.zeros([BLOCK], tl.float32)
        c_uf = tl.zeros([BLOCK], tl.float32)
        c_nonfin_nan = tl.zeros([BLOCK], tl.int32)
        c_ninf = tl.zeros([BLOCK], tl.int32)
        # UNROLL tiles per step, their loads issued first: more bytes in flight per thread (the
        # 16- and 8-bit formats load half or a quarter of fp32's bytes per tile)
        for it in range(0, n_full - (UNROLL - 1), UNROLL):
            b0 = _load_bits(base, start + it * BLOCK + offs, None, FMT, False, ALIGNED)
            b1 = _load_bits(base, start + (it + 1) * BLOCK + offs, None, FMT, False, ALIGNED)
            if UNROLL == 4:
                b2 = _load_bits(base, start + (it + 2) * BLOCK + offs, None, FMT, False, ALIGNED)
                b3 = _load_bits(base, start + (it + 3) * BLOCK + offs, None, FMT, False, ALIGNED)
            mn, mx, s, sq, c_zero, c_own, c_uf = _fast_tile(
                b0, mn, mx, s, sq, c_zero, c_own, c_uf, T_OWN, T_UF, SAME_UF
            )
            mn, mx, s, sq, c_zero, c_own, c_uf = _fast_tile(
                b1, mn, mx, s, sq, c_zero, c_own, c_uf, T_OWN, T_UF, SAME_UF
            )
            if UNROLL == 4:
                mn, mx, s, sq, c_zero, c_own, c_uf = _fast_tile(
                    b2, mn, mx, s, sq, c_zero, c_own, c_uf, T_OWN, T_UF, SAME_UF
                )
                mn, mx, s, sq, c_zero, c_own, c_uf = _fast_tile(
                    b3, mn, mx, s, sq, c_zero, c_own, c_uf, T_OWN, T_UF, SAME_UF
                )
        for it in range(n_full - n_full % UNROLL, n_full):  # the tiles left over
            b0 = _load_bits(base, start + it * BLOCK + offs, None, FMT, False, ALIGNED)
            mn, mx, s, sq, c_zero, c_own, c_uf = _fast_tile(
                b0, mn, mx, s, sq, c_zero, c_own, c_uf, T_OWN, T_UF, SAME_UF
            )
        # Exact pass, only in a chunk holding Inf or NaN (a lane whose sum is not finite, as
        # s - s != 0 finds; an fp32 overflow of finite values also lands here, harmlessly).
        if tl.max((s - s != 0.0).to(tl.int32), 0) > 0:
            mn = tl.full([BLOCK], float("inf"), tl.float32)
            mx = tl.full([BLOCK], float("-inf"), tl.float32)
            s = tl.zeros([BLOCK], tl.float32)
            sq = tl.zeros([BLOCK], tl.float32)
            c_zero = tl.zeros([BLOCK], tl.float32)
            c_own = tl.zeros([BLOCK], tl.float32)
            c_uf = tl.zeros([BLOCK], tl.float32)
            for it in range(n_full):
                bits = _load_bits(base, start + it * BLOCK + offs, None, FMT, False, ALIGNED)
                mn, mx, s, sq, c_zero, c_own, c_uf, c_nonfin_nan, c_ninf = _accumulate(
                    bits, None, mn, mx, s, sq, c_zero, c_own, c_uf, c_nonfin_nan, c_ninf,
                    T_OWN, T_UF, SAME_UF, False,
                )  # fmt: skip
        tail = start + n_full * BLOCK
        if (n_full < iters) & (tail < numel):  # the tensor's last, partial tile: exact, masked
            idx = tail + offs
            valid = idx < numel
            bits = _load_bits(base, idx, valid, FMT, True, False)
            mn, mx, s, sq, c_zero, c_own, c_uf, c_nonfin_nan, c_ninf = _accumulate(
                bits, valid, mn, mx, s, sq, c_zero, c_own, c_uf, c_nonfin_nan, c_ninf,
                T_OWN, T_UF, SAME_UF, True,
            )  # fmt: skip
        out = partials_ptr + row
        tl.store(out, tl.min(mn, 0))
        tl.store(out + n_chunks_total, tl.max(mx, 0))
        tl.store(out + 2 * n_chunks_total, tl.sum(s, 0))
        tl.store(out + 3 * n_chunks_total, tl.sum(sq, 0))
        low_own = tl.sum(c_own.to(tl.int32), 0)
        low_uf = low_own if SAME_UF else tl.sum(c_uf.to(tl.int32), 0)
        tl.store(out + 4 * n_chunks_total, tl.sum(c_nonfin_nan & 0xFFFF, 0).to(tl.float32))
        tl.store(out + 5 * n_chunks_total, tl.sum((c_nonfin_nan >> 16) & 0xFFFF, 0).to(tl.float32))
        tl.store(out + 6 * n_chunks_total, tl.sum(c_ninf, 0).to(tl.float32))
        tl.store(out + 7 * n_chunks_total, tl.sum(c_zero.to(tl.int32), 0).to(tl.float32))
        tl.store(out + 8 * n_chunks_total, low_own.to(tl.float32))
        tl.store(out + 9 * n_chunks_total, low_uf.to(tl.float32))

    @triton.jit(do_not_specialize=["n_tensors", "n_chunks_total"])
    def _stats_finalize_kernel(
        table_ptr, partials_ptr, out_ptr, n_tensors, n_chunks_total, FINAL_BLOCK: tl.constexpr
    ):
        t = tl.program_id(0)
        numel = tl.load(table_ptr + n_tensors + t)
        first = tl.load(table_ptr + 3 * n_tensors + t)
        n_chunks = tl.load(table_ptr + 4 * n_tensors + t)
        out_row = tl.load(table_ptr + 5 * n_tensors + t)
        offs = tl.arange(0, FINAL_BLOCK)
        mn = tl.full([FINAL_BLOCK], float("inf"), tl.float32)
        mx = tl.full([FINAL_BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([FINAL_BLOCK], tl.float64)
        sq = tl.zeros([FINAL_BLOCK], tl.float64)
        nonfin = tl.zeros([FINAL_BLOCK], tl.float64)
        nan = tl.zeros([FINAL_BLOCK], tl.float64)
        ninf = tl.zeros([FINAL_BLOCK], tl.float64)
        zero = tl.zeros([FINAL_BLOCK], tl.float64)
        low_own = tl.zeros([FINAL_BLOCK], tl.float64)
        low_uf = tl.zeros([FINAL_BLOCK], tl.float64)
        for c0 in range(0, n_chunks, FINAL_BLOCK):
            m = c0 + offs < n_chunks
            p = partials_ptr + first + c0 + offs
            mn = tl.minimum(mn, tl.load(p, mask=m, other=float("inf")))
            mx = tl.maximum(mx, tl.load(p + n_chunks_total, mask=m, other=float("-inf")))
            s += tl.load(p + 2 * n_chunks_total, mask=m, other=0.0).to(tl.float64)
            sq += tl.load(p + 3 * n_chunks_total, mask=m, other=0.0).to(tl.float64)
            nonfin += tl.load(p + 4 * n_chunks_total, mask=m, other=0.0).to(tl.float64)
            nan += tl.load(p + 5 * n_chunks_total, mask=m, other=0.0).to(tl.float64)
            ninf += tl.load(p + 6 * n_chunks_total, mask=m, other=0.0).to(tl.float64)
            zero += tl.load(p + 7 * n_chunks_total, mask=m, other=0.0).to(tl.float64)
            low_own += tl.load(p + 8 * n_chunks_total, mask=m, other=0.0).to(tl.float64)
            low_uf += tl.load(p + 9 * n_chunks_total, mask=m, other=0.0).to(tl.float64)
        lo = tl.min(mn, 0).to(tl.float64)
        hi = tl.max(mx, 0).to(tl.float64)
        n_nan = tl.sum(nan, 0)
        n_ninf = tl.sum(ninf, 0)
        n_zero = tl.sum(zero, 0)
        o = out_ptr + out_row * 12
        tl.store(o + 0, numel.to(tl.float64))
        tl.store(o + 1, tl.maximum(tl.maximum(-lo, hi), 0.0))
        tl.store(o + 2, lo)
        tl.store(o + 3, hi)
        tl.store(o + 4, tl.sum(s, 0))
        tl.store(o + 5, tl.sum(sq, 0))
        tl.store(o + 6, n_nan)
        tl.store(o + 7, tl.sum(nonfin, 0) - n_nan - n_ninf)
        tl.store(o + 8, n_ninf)
        tl.store(o + 9, n_zero)
        tl.store(o + 10, tl.sum(low_own, 0) - n_zero)
        tl.store(o + 11, tl.sum(low_uf, 0) - n_zero)

    _launch_partials = Relauncher(_stats_partials_kernel)
    _launch_finalize = Relauncher(_stats_finalize_kernel)


@dataclass
class _Plan:
    """Device table and launch list of one tensor layout (sizes, dtypes, 16-byte alignment).

    The table's first ``n`` entries are the tensors' addresses, rewritten when they change:
    gradients reallocated every step (``zero_grad(set_to_none=True)``) rarely get the same
    addresses back, and rebuilding the whole table each step cost ~3 ms of host time on GPT-2.
    """

    table: torch.Tensor  # int64, layout in _stats_partials_kernel
    n_chunks: int
    launches: tuple[tuple[torch.dtype, int, int, bool], ...]  # dtype, chunk_base, n_chunks, aligned
    kernel_rows: int  # tensors handled by the kernel (the others go through the reference)
    order: tuple[int, ...]  # input index of each table row
    ptrs: tuple[int, ...] = ()  # addresses the table holds now, in input order


_DTYPE = operator.attrgetter("dtype")
_PLAN_CACHE: OrderedDict[tuple, _Plan] = OrderedDict()
_PLAN_CACHE_SIZE = 64


def _is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers ``numel`` consecutive elements from ``data_ptr`` (any dim order)."""
    if t.is_contiguous():
        return True
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _build_plan(
    kernel_tensors: list[tuple[int, torch.Tensor]], device: torch.device, cfg: _Config
) -> _Plan:
    """Group by storage format, biggest chunks first (they start first), and lay out the table
    (addresses are filled in by ``_point``)."""
    order = sorted(
        kernel_tensors,
        key=lambda it: (_FORMATS[it[1].dtype], -_chunk_iters(it[1].numel(), cfg), it[0]),
    )
    n = len(order)
    numel, iters, first, n_chunks = ([0] * n for _ in range(4))
    chunk_tensor: list[int] = []
    chunk_start: list[int] = []
    launches = []
    for j, (_, t) in enumerate(order):
        numel[j] = t.numel()
        iters[j] = _chunk_iters(numel[j], cfg)
        chunk = iters[j] * cfg.block
        first[j] = len(chunk_tensor)
        n_chunks[j] = -(-numel[j] // chunk)
        chunk_tensor.extend([j] * n_chunks[j])
        chunk_start.extend(range(0, numel[j], chunk))
        if j == 0 or order[j - 1][1].dtype != t.dtype:
            launches.append([t.dtype, first[j], 0, True])
        launches[-1][2] += n_chunks[j]
        launches[-1][3] &= t.data_ptr() % 16 == 0
    out_row = [row for row, _ in order]
    table = to_device(
        [0] * n + numel + iters + first + n_chunks + out_row + chunk_tensor + chunk_start,
        torch.int64,
        device,
    )
    return _Plan(
        table,
        len(chunk_tensor),
        tuple(tuple(lch) for lch in launches if lch[2] > 0),
        n,
        tuple(out_row),
    )


def _point(plan: _Plan, ptrs: tuple[int, ...]) -> None:
    """Write the tensors' addresses into the table (a no-op when they did not move)."""
    if ptrs == plan.ptrs:
        return
    host = [ptrs[i] for i in plan.order]
    if plan.table.device.type == "cuda":
        # pinned + non_blocking: no wait for the GPU; the copy runs in stream order after the
        # launches that read the old addresses (the caching host allocator keeps the pinned
        # block alive until the copy has run)
        pinned = torch.tensor(host, dtype=torch.int64, pin_memory=True)
        plan.table[: plan.kernel_rows].copy_(pinned, non_blocking=True)
    else:
        plan.table[: plan.kernel_rows] = torch.tensor(host, dtype=torch.int64)
    plan.ptrs = ptrs


def _check_inputs(tensors: Sequence[torch.Tensor], device: torch.device) -> None:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"tensor_stats backend='triton' runs on CUDA tensors (got {device}); on a CPU it "
            "needs TRITON_INTERPRET=1 (tests), otherwise use backend='torch' or 'auto'"
        )
    _check_tensors(tensors)


def _launch(
    plan: _Plan, n_rows: int, underflow_dtype: torch.dtype | None, cfg: _Config
) -> torch.Tensor:
    """The plan's launches: one partials launch per storage format, then the finalize; returns
    the (n_rows, N_STATS) output."""
    device = plan.table.device
    out = torch.empty(n_rows, N_STATS, dtype=torch.float64, device=device)
    partials = torch.empty(_N_PARTIALS, max(plan.n_chunks, 1), device=device)
    # torch allocations and plan tables start at multiples of 16 bytes, as the relaunch keys
    # assume (triton specializes pointers on it)
    for dtype, chunk_base, n_chunks, aligned in plan.launches:
        t_own = _threshold(dtype)
        t_uf = t_own if underflow_dtype is None else _threshold(underflow_dtype)
        fmt, same_uf = _FORMATS[dtype], t_own == t_uf
        _launch_partials(
            (fmt, same_uf, aligned, cfg), (n_chunks,),
            plan.table, partials, plan.kernel_rows, plan.n_chunks, chunk_base, t_own, t_uf,
            FMT=fmt, SAME_UF=same_uf, ALIGNED=aligned, BLOCK=cfg.block,
            UNROLL=2 if fmt == _FMT_FP32 else 4, num_warps=cfg.num_warps,
        )  # fmt: skip
    _launch_finalize(
        cfg, (plan.kernel_rows,),
        plan.table, partials, out, plan.kernel_rows, max(plan.n_chunks, 1),
        FINAL_BLOCK=cfg.final_block, num_warps=4,
    )  # fmt: skip
    return out


def _tensor_stats_triton(
    tensors: Sequence[torch.Tensor],
    underflow_dtype: torch.dtype | None = None,
    cfg: _Config = _CONFIG,
) -> torch.Tensor:
    """Fused path of ``tensor_stats``: one launch per storage format plus one finalize launch.

    Dtypes without a kernel format (fp64, fnuz fp8) go through the reference, row by row.
    Non-dense views (slices with gaps, overlapping strides) are copied with ``.contiguous()``.
    Tables are cached by layout (numel, dtype and alignment of every tensor); the addresses in
    a table are rewritten (one small pinned copy, no sync) when the tensors moved, as gradients
    reallocated by ``zero_grad(set_to_none=True)`` do. The launches are not captured as a CUDA
    graph: replaying one saved ~20 µs of host time a call, yet made GPT-2 training steps 0.3-0.4 %
    slower than plain launches in two H200 runs (overhead_gpt2_h200_interleaved_run16/17.json).
    """
    if triton is None:
        raise RuntimeError("tensor_stats backend='triton' needs triton installed; use 'torch'")
    if not tensors:
        raise ValueError("tensor_stats needs at least one tensor")
    device = tensors[0].device
    # Hot path (every step): the cache key is the device and the layout, read with C-level
    # maps; the checks below run only when a table is built. A table lives on its device: one
    # layout on two GPUs (a model split over them) needs two.
    if all(map(torch.Tensor.is_contiguous, tensors)):
        views = tensors
    else:
        views = [t if _is_dense(t) else t.contiguous() for t in tensors]  # copies live to launch
    ptrs = tuple(map(torch.Tensor.data_ptr, views))
    # the kernel's vectorized loads need 16-byte aligned tensors: one OR tells when all are
    aligned = not functools.reduce(operator.or_, ptrs) & 15
    key = (cfg, device, aligned, *map(torch.Tensor.numel, views), *map(_DTYPE, views))
    if not aligned:
        key += tuple(p % 16 == 0 for p in ptrs)
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        _check_inputs(views, device)
        kernel_tensors = [(i, t) for i, t in enumerate(views) if t.dtype in _FORMATS]
        plan = _build_plan(kernel_tensors, device, cfg)
        _PLAN_CACHE[key] = plan
        if len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
            _PLAN_CACHE.popitem(last=False)
    _point(plan, ptrs)
    switch = device.type == "cuda" and device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if switch else nullcontext():
        if not plan.kernel_rows:
            out = torch.empty(len(views), N_STATS, dtype=torch.float64, device=device)
        else:
            out = _launch(plan, len(views), underflow_dtype, cfg)
    if plan.kernel_rows < len(views):
        for i, t in enumerate(views):
            if t.dtype not in _FORMATS:
                out[i] = tensor_stats_reference([t], underflow_dtype)[0]
    return out


def tensor_stats(
    tensors: Sequence[torch.Tensor],
    underflow_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Statistics of each tensor (see ``tensor_stats_reference``) with the chosen backend.

    ``backend``: ``"torch"`` (reference), ``"triton"`` (fused kernel; on a CPU only under
    ``TRITON_INTERPRET=1``), ``"auto"`` (the fused kernel on CUDA when triton is installed,
    ``tensor_stats_cpu`` on a CPU, the reference elsewhere). Returns ``(len(tensors), N_STATS)``
    float64 on the tensors' device, without a host sync except on the CPU path (where reading a
    value waits for nothing). The kernel's sums accumulate in fp32 within a program (at most 2**24
    elements) and in float64 across programs, so a SUM (SUMSQ) whose fp32 partial passes 3.4e38
    reads +-inf where the reference's float64 does not (NaN where partials overflowed both
    ways: +inf and -inf lanes); its counts, extremes and numel are exact.
    A broadcast view (``expand``: stride 0 over a dim of size > 1) is measured on the elements it
    repeats, its counts and sums multiplied by the repetition: never materialized.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if all(map(torch.Tensor.is_contiguous, tensors)):  # the every-step case: nothing repeated
        return _dispatch(tensors, underflow_dtype, backend)
    bases, repeats = zip(*map(_unrepeated, tensors), strict=True)
    out = _dispatch(bases, underflow_dtype, backend)
    if any(r != 1 for r in repeats):
        factor = to_device(list(repeats), torch.float64, out.device)
        for c in range(N_STATS):  # column by column: a list index is a CPU tensor to copy
            if c not in MAX_COLUMNS + MIN_COLUMNS:
                out[:, c] *= factor
    return out


def _unrepeated(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` without its broadcast dims (stride 0, size > 1: kept at size 1), and how many
    times each of its elements appears in ``t``."""
    repeat, shape = 1, list(t.shape)
    for i, (stride, size) in enumerate(zip(t.stride(), t.shape, strict=True)):
        if stride == 0 and size > 1:
            repeat *= size
            shape[i] = 1
    return (t, 1) if repeat == 1 else (t.as_strided(shape, t.stride()), repeat)


def _dispatch(
    tensors: Sequence[torch.Tensor], underflow_dtype: torch.dtype | None, backend: str
) -> torch.Tensor:
    if backend == "auto":
        device_type = tensors[0].device.type if tensors else "cpu"
        if device_type == "cuda" and triton is not None:
            return _tensor_stats_triton(tensors, underflow_dtype)
        if device_type == "cpu":
            return tensor_stats_cpu(tensors, underflow_dtype)
        return tensor_stats_reference(tensors, underflow_dtype)
    if backend == "triton":
        return _tensor_stats_triton(tensors, underflow_dtype)
    return tensor_stats_reference(tensors, underflow_dtype)
