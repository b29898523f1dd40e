"""Spectral norms of many matrices at once by warm-started power iteration, one read per iteration.

The largest singular value sigma(A) of every weight (and of every attention head's slice of W_Q
and W_K) grows before attention-logit blow-ups. An exact SVD of GPT-2's weights takes seconds.
The textbook iteration (v = A^T u, then u = A v) reads each matrix twice; here each program owns
whole rows, so the two products share one read of them:

    w = A (c v)              (per block of rows, the rows held in registers)
    z = A^T w                (the same registers; partial sums per row segment)
    t = z c / ||w||,  sigma = ||t|| / c,  v <- t / ||t||,  c <- 2^-floor(log2 sigma)

With v of unit length, ``||t|| / c = ||A^T u||`` for ``u = w / ||w||``: a lower bound of
sigma(A) that rises to it, one whole iteration (``v <- A^T A v``) per read. The power of two ``c``
(per matrix, carried with v) keeps ``c * sigma`` in [1, 2), so the squares in the norms neither
underflow nor overflow float32 for any sigma from ~1e-36 to ~1e36, and, a power of two, it changes
no rounding. A matrix's first ``c`` comes from its largest magnitude. The vectors persist
between calls (warm start), so while the weights drift slowly one iteration per training step
tracks sigma closely. ``numwatch.distributed.ShardedPowerIteration`` runs the same iteration on
row-sharded weights.

A matrix's first v is A^T g / ||A^T g|| for a random g (half an iteration ahead of a random v).
When ``w`` is 0 (A == 0, or v orthogonal to A's rows) the estimate is 0; when it is not finite
(A holds Inf or NaN) the estimate is NaN; in both cases v restarts from its first value (a random
unit vector where that was 0) and ``c`` adapts (``failed_scale``), so a weight that recovers is
tracked again. A weight whose scale jumps by more than ~1e18 between two iterations (past what
``c`` covers) reads 0 or NaN until ``c`` has followed it (2^20 per iteration, within 2^+-40 of
its first scale).

``PowerIteration`` is what probes call. ``power_iteration_reference`` is the pure-torch path (the
CPU path and the oracle of the Triton kernels): it groups matrices of one shape and dtype into
batched matmuls. The Triton path runs every matrix of a dtype and row-length class in one launch,
reading strided views in place (pointer table); the last program to finish a row segment of a
matrix finishes that matrix (an atomic count per matrix), so no second launch is needed. The
launches of one iteration run side by side on CUDA streams.
Matrices whose rows are longer than ``MAX_ROW`` elements do not fit a program's registers: they
run on the torch path, the others on the Triton path, in the same call.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from operator import attrgetter
from typing import NamedTuple

import torch

from .host_copy import to_device
from .launch import Relauncher, capture_when_due, next_power_of_2, replay

_SHAPE, _DTYPE = attrgetter("shape"), attrgetter("dtype")
_TINY = 1.1754944e-38  # smallest normal fp32: ||w|| floor, so w == 0 stays 0 (no 0/0)
_EXP_MAX = 253  # largest biased fp32 exponent a scale is taken from: 2^(127 - 253) is normal
MAX_ROW = 16384  # longest row (elements) a Triton program holds in registers
GROUP_BYTES = 256 * 2**20  # torch path: float32 bytes of matrices batched into one matmul, at most
_FINISH_SEGS = 16  # a matrix's finish reads its segments' ||w||^2 this many at a time, at most

__all__ = [
    "MAX_ROW",
    "PowerIteration",
    "Vectors",
    "failed_scale",
    "head_views",
    "pow2_scale",
    "power_iteration_reference",
    "qk_logit_bound",
]


def head_views(weight: torch.Tensor, n_heads: int, out_dim: int = 0) -> torch.Tensor:
    """Per-head blocks of a projection weight as one strided ``(n_heads, ., .)`` view (no copy).

    ``out_dim`` is the weight's output-feature dimension: 0 for ``nn.Linear`` (``(out, in)``, the
    head's rows: ``(n_heads, head_dim, in)``), 1 for GPT-2's ``Conv1D`` (``(in, out)``, the head's
    columns: ``(n_heads, in, head_dim)``). A fused projection is sliced first, e.g. GPT-2's Q and K
    heads together: ``head_views(c_attn.weight[:, : 2 * d], 2 * n_head, out_dim=1)``.
    """
    if weight.dim() != 2 or out_dim not in (0, 1):
        raise ValueError(f"head_views needs a 2-D weight and out_dim 0 or 1, got {weight.shape}")
    d_out = weight.shape[out_dim]
    if d_out % n_heads:
        raise ValueError(f"{d_out} output features do not split into {n_heads} heads")
    dh = d_out // n_heads
    if out_dim == 0:
        return weight.view(n_heads, dh, weight.shape[1])
    return weight.view(weight.shape[0], n_heads, dh).permute(1, 0, 2)


def qk_logit_bound(
    sigma_q: torch.Tensor | float, sigma_k: torch.Tensor | float, scale: float
) -> torch.Tensor | float:
    """Bound on |q . k| * scale for unit-norm inputs: sigma(W_Q^h) * sigma(W_K^h) * scale."""
    return sigma_q * sigma_k * scale


class _Entry(NamedTuple):
    """One caller matrix batch, oriented so its last dim is the contiguous one."""

    view: torch.Tensor  # (n, m, k), stride(2) == 1 (or k == 1)
    transposed: bool  # view is the caller's batch transposed (sigma is the same)


def _orient(t: torch.Tensor) -> _Entry:
    """A 3-D view whose rows are contiguous: as is, transposed, or (last resort) copied."""
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3:
        raise ValueError(f"PowerIteration takes 2-D matrices or 3-D batches, got shape {t.shape}")
    if not t.is_floating_point():
        raise TypeError(f"PowerIteration needs floating-point matrices, got {t.dtype}")
    if t.numel() == 0:
        raise ValueError(f"PowerIteration needs non-empty matrices, got shape {t.shape}")
    if t.stride(2) == 1 or t.shape[2] == 1:
        return _Entry(t, False)
    if t.stride(1) == 1 or t.shape[1] == 1:
        return _Entry(t.transpose(1, 2), True)
    return _Entry(t.contiguous(), False)  # neither dim contiguous: one copy per step


def _signature(entries: Sequence[_Entry]) -> tuple:
    return tuple((e.view.shape, e.transposed) for e in entries)


class Vectors(NamedTuple):
    """Flat float32 buffers of a list of batches ``(n_i, m_i, k_i)``: each batch's ``(n_i, k_i)``
    unit vectors (current, restart) and its ``(n_i,)`` power-of-two scales (current, restart)."""

    v: torch.Tensor
    v0: torch.Tensor
    c: torch.Tensor
    c0: torch.Tensor


def power_iteration_reference(
    views: Sequence[torch.Tensor],
    vec: Vectors,
    iters: int,
    offsets: Sequence[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """``iters`` iterations over oriented batches ``views[i]`` ``(n_i, m_i, k_i)``; updates ``vec``.

    Batch i's vectors are at ``offsets[i][0]`` and its scales at ``offsets[i][1]`` of ``vec``'s
    buffers (default: packed in list order). Batches of one shape and dtype are concatenated (one
    float32 copy, at most ``GROUP_BYTES`` of it at a time: a large model's weights are not all
    copied at once) and run as one batched matmul. Returns the ``(sum n_i,)`` float32 estimates.
    """
    if offsets is None:
        offsets = _flat_offsets(views)
    groups: dict[tuple, list[int]] = {}
    for i, a in enumerate(views):
        groups.setdefault((a.shape[1], a.shape[2], a.dtype), []).append(i)
    sigma_parts: dict[int, torch.Tensor] = {}
    for members in (c for group in groups.values() for c in _chunks(views, group)):
        batch = [views[i] for i in members]
        a = (torch.cat(batch) if len(batch) > 1 else batch[0]).float()  # (B, m, k)
        k = a.shape[2]

        def gather(
            flat: torch.Tensor, j: int, width: int, members: list[int] = members
        ) -> torch.Tensor:
            ends = [(offsets[i][j], offsets[i][j] + views[i].shape[0] * width) for i in members]
            return torch.cat([flat[lo:hi] for lo, hi in ends]).view(-1, width)

        vv, c = gather(vec.v, 0, k), gather(vec.c, 1, 1)[:, 0]
        restart = (gather(vec.v0, 0, k), gather(vec.c0, 1, 1)[:, 0])
        for _ in range(iters):
            vv, c, sigma = _iteration(a, vv, c, restart)
        start = 0
        for i in members:
            n = views[i].shape[0]
            at, at_c = offsets[i]
            vec.v[at : at + n * k] = vv[start : start + n].reshape(-1)
            vec.c[at_c : at_c + n] = c[start : start + n]
            sigma_parts[i] = sigma[start : start + n]
            start += n
    return torch.cat([sigma_parts[i] for i in range(len(views))])


def _flat_offsets(views: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Where each batch's ``(n, k)`` vectors and ``(n,)`` scales start in the flat buffers, in
    list order."""
    offsets, at, at_c = [], 0, 0
    for a in views:
        offsets.append((at, at_c))
        at += a.shape[0] * a.shape[2]
        at_c += a.shape[0]
    return offsets


def _chunks(views: Sequence[torch.Tensor], members: list[int]) -> list[list[int]]:
    """``members`` in order, cut where a run's float32 bytes would pass ``GROUP_BYTES`` (a
    single larger batch stays whole)."""
    out: list[list[int]] = [[]]
    size = 0
    for i in members:
        nbytes = views[i].numel() * 4
        if out[-1] and size + nbytes > GROUP_BYTES:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


def _iteration(
    a: torch.Tensor, v: torch.Tensor, c: torch.Tensor, restart: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(v, c, sigma) after one iteration from the unit rows of ``v`` and scales ``c`` for a
    float32 batch (B, m, k): the Triton kernels' arithmetic."""
    w = torch.bmm(a, (v * c.unsqueeze(-1)).unsqueeze(-1))  # (B, m, 1)
    nw = w.square().sum((1, 2)).sqrt()
    z = torch.bmm(a.transpose(1, 2), w).squeeze(-1)
    t = z * (c / nw.clamp_min(_TINY)).unsqueeze(-1)
    nt = t.square().sum(-1).sqrt()  # c ||A^T u|| for the unit u = w / ||w||
    ok = (nw > 0) & torch.isfinite(nw) & (nt > 0) & torch.isfinite(nt)
    sigma = torch.where(nw == 0, 0.0, torch.where(ok, nt / c, float("nan")))
    v = torch.where(ok.unsqueeze(-1), t / torch.where(ok, nt, 1.0).unsqueeze(-1), restart[0])
    return v, torch.where(ok, pow2_scale(sigma), failed_scale(c, restart[1], nw, nt)), sigma


def failed_scale(
    c: torch.Tensor, c0: torch.Tensor, nw: torch.Tensor, nt: torch.Tensor
) -> torch.Tensor:
    """The scale after an iteration that gave no estimate: up 2^20 where ||w|| was 0 (A == 0,
    or A v underflowed: a weight that fell by more than the scale covers), down 2^20 where a
    norm overflowed, as it was otherwise (NaN in A: the scale of before the NaN still fits
    the weight that recovers); within 2^+-40 of the first scale ``c0`` (a zero-initialized
    weight that starts to train is read at once) and the normal float32 powers of two."""
    grow = torch.minimum(c * 2.0**20, c0 * 2.0**40).clamp_max(2.0**127)
    shrink = torch.maximum(c * 2.0**-20, c0 * 2.0**-40).clamp_min(2.0**-126)
    over = (nw == float("inf")) | (nt == float("inf"))
    return torch.where(nw == 0, grow, torch.where(over, shrink, c))


def pow2_scale(x: torch.Tensor) -> torch.Tensor:
    """2^-floor(log2 x) for positive float32 ``x`` (``x`` times it is in [1, 2)), from the exponent
    bits (the Triton kernels take the same bits), bounded to normal float32 powers of two."""
    e = (x.float().view(torch.int32) >> 23) & 0xFF
    return ((254 - e.clamp_max(_EXP_MAX)) << 23).view(torch.float32)


# --- Triton kernels ------------------------------------------------------------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs no triton
    triton = None

_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_DTYPES = {v: k for k, v in _FORMATS.items()}


class _Config(NamedTuple):
    """Tile shapes of the fused kernel."""

    tile: int = 8192  # elements a program holds per block of rows (rows = tile // padded row)
    elems: int = 131072  # elements per program, about (whole blocks of rows)
    num_warps: int = 4
    stages: int = 3  # software-pipelining stages of the row loop: loads run ahead of the sums
    streams: bool = True  # CUDA: the launches of an iteration run side by side (one per stream)


_CONFIG = _Config()


if triton is not None:

    @triton.jit
    def _matrix_ptr(base, FMT: tl.constexpr, ALIGN: tl.constexpr):
        """The matrix's typed pointer; 16-byte aligned when ALIGN > 1 (stated here: a hint
        applied to the returned pointer does not reach triton's vectorizer)."""
        if FMT == 0:
            p = base.to(tl.pointer_type(tl.float32))
        elif FMT == 1:
            p = base.to(tl.pointer_type(tl.bfloat16))
        else:
            p = base.to(tl.pointer_type(tl.float16))
        if ALIGN > 1:
            p = tl.multiple_of(p, 16)
        return p

    @triton.jit
    def _load_rows(a_ptr, r, r1, sm, cols, cmask, BM: tl.constexpr):
        """Rows [r, r + BM) of the segment ending at r1, as float32 (zeros past its end)."""
        rows = r + tl.arange(0, BM)
        a = tl.load(
            a_ptr + rows[:, None] * sm + cols[None, :],
            mask=(rows < r1)[:, None] & cmask[None, :],
            other=0.0,
        )
        return a.to(tl.float32)

    @triton.jit(do_not_specialize=["n_mats", "n_tiles", "tile_base"])
    def _pi_fused_kernel(
        table_ptr, v_ptr, v0_ptr, c_ptr, c0_ptr, zp_ptr, sq_ptr, done_ptr, sigma_ptr, n_mats,
        n_tiles, tile_base,
        FMT: tl.constexpr, ALIGN: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr,
        STAGES: tl.constexpr, SEGS: tl.constexpr,
    ):  # fmt: skip
        """For one row segment of one matrix: w = A (c v) and z = A^T w from one read of the rows
        (blocks of BM whole rows in registers); z into the segment's partial, ||w||^2 into
        ``sq[tile]``. The matrix's last segment to finish then finishes the matrix: ||w|| from
        the segments' squares, z = the sum of their partials, t = z c / ||w||,
        sigma = ||t|| / c, v <- t / ||t|| and c <- 2^-floor(log2 sigma) (or the restart values)."""
        tile = tile_base + tl.program_id(0)
        tiles = table_ptr + 9 * n_mats  # after ptr, m, k, stride_m, v_off, c_off, zp_off, n_seg,
        # first
        i = tl.load(tiles + tile)
        r0 = tl.load(tiles + n_tiles + tile)
        r1 = tl.load(tiles + 2 * n_tiles + tile)
        seg = tl.load(tiles + 3 * n_tiles + tile)
        a_ptr = _matrix_ptr(tl.load(table_ptr + i), FMT, ALIGN)
        k = tl.load(table_ptr + 2 * n_mats + i)
        sm = tl.load(table_ptr + 3 * n_mats + i)
        v_off = tl.load(table_ptr + 4 * n_mats + i)
        c_off = tl.load(table_ptr + 5 * n_mats + i)
        zp_off = tl.load(table_ptr + 6 * n_mats + i)
        n_seg = tl.load(table_ptr + 7 * n_mats + i)
        if ALIGN > 1:  # rows start and end on 16-byte boundaries: vector loads
            sm = tl.multiple_of(sm, ALIGN)
            k = tl.multiple_of(k, ALIGN)
        cols = tl.arange(0, KP)
        cmask = cols < k
        c = tl.load(c_ptr + c_off)
        v = tl.load(v_ptr + v_off + cols, mask=cmask, other=0.0) * c
        z = tl.zeros([KP], tl.float32)
        sq = tl.zeros([BM], tl.float32)
        for r in tl.range(r0, r1, BM, num_stages=STAGES):
            a = _load_rows(a_ptr, r, r1, sm, cols, cmask, BM)
            w = tl.sum(a * v[None, :], 1)
            sq += w * w
            z += tl.sum(a * w[:, None], 0)
        tl.store(zp_ptr + zp_off + seg * k + cols, z, mask=cmask)
        tl.store(sq_ptr + tile, tl.sum(sq, 0))
        # Release this segment's partials; the last of the matrix's segments acquires them all.
        # (A separate finishing launch, one program per matrix, took a fifth of the step.)
        if tl.atomic_add(done_ptr + i, 1, sem="acq_rel") == n_seg - 1:
            tl.store(done_ptr + i, 0)  # ready for the next iteration
            first = tl.load(table_ptr + 8 * n_mats + i)
            segs = tl.arange(0, SEGS)
            acc = tl.zeros([SEGS], tl.float32)
            for s0 in range(0, n_seg, SEGS):  # past L1 (.cg): other SMs wrote them
                smask = s0 + segs < n_seg
                acc += tl.load(
                    sq_ptr + first + s0 + segs, mask=smask, other=0.0, cache_modifier=".cg"
                )
            z = tl.zeros([KP], tl.float32)
            for s in tl.range(0, n_seg, num_stages=STAGES):  # in segment order
                z += tl.load(
                    zp_ptr + zp_off + s * k + cols, mask=cmask, other=0.0, cache_modifier=".cg"
                )
            # ||w||, t = z c / ||w||, sigma = ||t|| / c, v <- t / ||t||, c <- 2^-floor(log2 sigma)
            nw = tl.sqrt(tl.sum(acc, 0))
            t = z * (c / tl.maximum(nw, 1.1754944e-38))
            nt = tl.sqrt(tl.sum(t * t, 0))
            ok = (nw > 0) & (nw < float("inf")) & (nt > 0) & (nt < float("inf"))
            sigma = nt / c
            tl.store(sigma_ptr + i, tl.where(nw == 0, 0.0, tl.where(ok, sigma, float("nan"))))
            restart = tl.load(v0_ptr + v_off + cols, mask=cmask, other=0.0)
            v_new = tl.where(ok, t * (1.0 / tl.where(ok, nt, 1.0)), restart)
            tl.store(v_ptr + v_off + cols, v_new, mask=cmask)
            e = tl.minimum((sigma.to(tl.int32, bitcast=True) >> 23) & 0xFF, 253)
            c_new = ((254 - e) << 23).to(tl.float32, bitcast=True)
            # no estimate: failed_scale's arithmetic (2^20, 2^40, 2^127, 2^-126 as literals)
            c0 = tl.load(c0_ptr + c_off)
            grow = tl.minimum(
                tl.minimum(c * 1048576.0, c0 * 1099511627776.0), 1.7014118346046923e38
            )
            shrink = tl.maximum(
                tl.maximum(c * 9.5367431640625e-07, c0 * 9.094947017729282e-13),
                1.1754943508222875e-38,
            )
            over = (nw == float("inf")) | (nt == float("inf"))
            c_fail = tl.where(nw == 0, grow, tl.where(over, shrink, c))
            tl.store(c_ptr + c_off, tl.where(ok, c_new, c_fail))

    _launch_fused = Relauncher(_pi_fused_kernel)


class _Launch(NamedTuple):
    dtype: torch.dtype
    kp: int  # padded row length (constexpr)
    tile_base: int
    n_tiles: int
    align: int  # vector width (elements), 1 when some row is unaligned
    segs: int  # segments' squares the finish reads per load (constexpr)


class _Plan(NamedTuple):
    table: torch.Tensor  # int64 sections, layout in the kernels
    n_mats: int
    n_tiles: int
    launches: tuple[_Launch, ...]
    zp: torch.Tensor  # per row segment partials of z = A^T w
    sq: torch.Tensor  # per row segment ||w||^2
    done: torch.Tensor  # per matrix, int32: segments finished in this iteration (0 between)


def _build_plan(
    views: Sequence[torch.Tensor],
    offsets: Sequence[tuple[int, int]],
    device: torch.device,
    cfg: _Config,
) -> _Plan:
    """Tables of every matrix (one per batch element; its vector and scale at ``offsets[i]`` in
    the flat buffers) and of its row segments, grouped into one launch per dtype and padded row
    length."""
    mats: list[tuple[int, ...]] = []  # ptr, m, k, stride_m, v_off, c_off, dtype
    for a, (v_off, c_off) in zip(views, offsets, strict=True):
        n, m, k = a.shape
        for b in range(n):
            ptr = a.data_ptr() + b * a.stride(0) * a.element_size()
            mats.append((ptr, m, k, a.stride(1), v_off + b * k, c_off + b, _FORMATS[a.dtype]))
    n_mats = len(mats)
    zp_off, n_seg, first = ([0] * n_mats for _ in range(3))
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (_, _, k, _, _, _, fmt) in enumerate(mats):
        groups.setdefault((fmt, next_power_of_2(k)), []).append(i)
    tiles: list[tuple[int, int, int, int]] = []
    launches = []
    zp_size = 0
    for (fmt, kp), members in sorted(groups.items()):
        base, align = len(tiles), 16
        bm = max(1, cfg.tile // kp)
        for i in members:
            ptr, m, k, sm = mats[i][:4]
            align = _common_alignment(align, ptr, sm, k, _DTYPES[fmt].itemsize)
            rows = max(bm, -(-cfg.elems // k) // bm * bm)
            n_seg[i], first[i], zp_off[i] = -(-m // rows), len(tiles), zp_size
            zp_size += n_seg[i] * k
            tiles.extend((i, r0, min(m, r0 + rows), s) for s, r0 in enumerate(range(0, m, rows)))
        segs = min(_FINISH_SEGS, next_power_of_2(max(n_seg[i] for i in members)))
        launches.append(_Launch(_DTYPES[fmt], kp, base, len(tiles) - base, align, segs))
    columns = [[mat[j] for mat in mats] for j in range(6)]
    table = to_device(
        [x for col in columns for x in col]
        + zp_off
        + n_seg
        + first
        + [t[j] for j in range(4) for t in tiles],
        torch.int64,
        device,
    )
    zp = torch.empty(max(zp_size, 1), dtype=torch.float32, device=device)
    sq = torch.empty(max(len(tiles), 1), dtype=torch.float32, device=device)
    done = torch.zeros(n_mats, dtype=torch.int32, device=device)
    return _Plan(table, n_mats, len(tiles), tuple(launches), zp, sq, done)


def _common_alignment(align: int, ptr: int, stride_m: int, k: int, elem: int) -> int:
    """Vector width (elements) of a launch: 16 bytes when every row starts and ends aligned."""
    if align == 1 or ptr % 16 or (stride_m * elem) % 16 or (k * elem) % 16:
        return 1
    return 16 // elem


def _run_triton(plan: _Plan, vec: Vectors, iters: int, cfg: _Config) -> torch.Tensor:
    device = vec.v.device
    sigma = torch.empty(plan.n_mats, dtype=torch.float32, device=device)
    side = cfg.streams and vec.v.is_cuda and len(plan.launches) > 1
    with _on_device(device):
        for _ in range(iters):
            # The launches touch disjoint matrices: side by side, one's tail overlaps the others'
            # streaming (H200, GPT-2's 336 matrices: 0.118 against 0.141 ms in turn on one
            # stream). The next iteration, or the caller, waits for all of them.
            streams = _side_streams(device, len(plan.launches)) if side else None
            if streams:
                for stream in streams:
                    stream.wait_stream(torch.cuda.current_stream())
            for j, launch in enumerate(plan.launches):
                fmt = _FORMATS[launch.dtype]
                with torch.cuda.stream(streams[j]) if streams else nullcontext():
                    _launch_fused(
                        (fmt, launch.align, launch.kp, launch.segs, cfg), (launch.n_tiles,),
                        plan.table, *vec, plan.zp, plan.sq, plan.done, sigma, plan.n_mats,
                        plan.n_tiles, launch.tile_base,
                        FMT=fmt, ALIGN=launch.align, KP=launch.kp,
                        BM=max(1, cfg.tile // launch.kp), STAGES=cfg.stages, SEGS=launch.segs,
                        num_warps=cfg.num_warps,
                    )  # fmt: skip
            if streams:
                for stream in streams:
                    torch.cuda.current_stream().wait_stream(stream)
    return sigma


_SIDE: dict[torch.device, list[torch.cuda.Stream]] = {}


def _side_streams(device: torch.device, n: int) -> list[torch.cuda.Stream]:
    """``n`` streams of ``device`` for one iteration's launches, made once per process."""
    have = _SIDE.setdefault(device, [])
    while len(have) < n:
        have.append(torch.cuda.Stream(device))
    return have[:n]


def _run_split(state: _State, vec: Vectors, iters: int, cfg: _Config) -> torch.Tensor:
    """The Triton plan's matrices, then those it cannot hold (torch path), in list order."""
    sigma = _run_triton(state.plan, vec, iters, cfg)
    if not state.rest:
        return sigma
    views = [state.views[i] for i in state.rest]
    offsets = [state.offsets[i] for i in state.rest]
    with torch.no_grad():
        other = power_iteration_reference(views, vec, iters, offsets)
    return torch.cat([sigma, other]).index_select(0, state.order)


def _on_device(device: torch.device) -> AbstractContextManager:
    switch = device.type == "cuda" and device.index != torch.cuda.current_device()
    return torch.cuda.device(device) if switch else nullcontext()


@torch.no_grad()
def _start_vectors(view: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit start vectors ``(n, k)`` of a batch ``(n, m, k)`` and their scales ``(n,)``.

    The vector is A^T g for a random g (half an iteration ahead of a random v, its components
    already weighted by the singular values), or a random unit vector where A^T g is 0 or not
    finite; the scale is ``pow2_scale`` of the largest magnitude (1 where that is 0 or not
    finite). They are also the restart values."""
    n, m, k = view.shape
    a = view.float()
    amax = a.abs().amax((1, 2))
    c = torch.where((amax > 0) & torch.isfinite(amax), pow2_scale(amax), 1.0)
    g = torch.randn(n, 1, m, generator=gen, device=view.device)
    t = torch.bmm(g, a * c[:, None, None]).squeeze(1)
    norm = t.square().sum(-1, keepdim=True).sqrt()
    rnd = torch.randn(n, k, generator=gen, device=view.device)
    rnd = rnd / rnd.norm(dim=-1, keepdim=True)
    ok = (norm > 0) & torch.isfinite(norm)
    return torch.where(ok, t / norm.clamp_min(_TINY), rnd), c


class _State(NamedTuple):
    """What a step over one list layout needs, valid while the vectors keep ``signature``."""

    signature: tuple
    plan: _Plan | None  # Triton path (None: torch path)
    views: list[torch.Tensor]  # the oriented batches (they also keep copies alive to the launch)
    offsets: list[tuple[int, int]]  # where each batch's vectors and scales start
    rest: list[int]  # with a plan: the batches it cannot hold (torch path)
    order: torch.Tensor | None  # with rest: list positions of [plan's estimates, rest's]
    cacheable: bool  # False when an entry had to be copied (its address changes every call)
    # Triton path, CUDA: by number of iterations, its plain runs so far and its captured
    # (graph, sigma) (None: capture failed)
    runs: Counter[Hashable]
    graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor] | None]


# Iterations of a call whose vectors are new (the first, or a list whose shapes changed) or
# restarted (``warm_up``): at one iteration per call, estimates of GPT-2-sized weights start
# 20-25 % low and take ~10 calls to come within 2 % (a lower bound that converges: read as growth
# by a trend rule). 30 iterations once cost one sample's time 30 times, once.
WARMUP_ITERS = 30


class PowerIteration:
    """Warm-started largest-singular-value estimates of a fixed list of matrix batches.

    ``step(matrices)`` takes the same list every call: 2-D ``(m, k)`` matrices and/or 3-D
    ``(n, m, k)`` batches (any strides; e.g. ``head_views`` of a fused qkv weight) and returns the
    ``(sum of batch sizes,)`` float32 estimates in list order, on the matrices' device, without a
    host sync. Vectors persist between calls; an entry whose shape (or orientation) changes is
    re-initialized, the others keep theirs. ``iters`` iterations run per call, each reading every
    matrix once; ``WARMUP_ITERS`` at least at the first call, after a change of shapes, and
    after ``warm_up()`` (a restart seen in ``age``).

    ``backend``: ``"triton"`` (one launch per dtype and row-length class over every matrix; on a
    CPU only under ``TRITON_INTERPRET=1``), ``"torch"``
    (``power_iteration_reference``), ``"auto"`` (triton on CUDA when installed, torch elsewhere).
    Supported kernel dtypes: fp32, bf16, fp16, with rows (the contiguous dim) of at most
    ``MAX_ROW`` elements; other matrices go through torch in the same call. Arithmetic is float32.
    """

    def __init__(self, iters: int = 1, backend: str = "auto", seed: int = 0) -> None:
        if iters < 1:
            raise ValueError(f"PowerIteration iters must be >= 1, got {iters}")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        self.iters = iters
        self.backend = backend
        self.seed = seed
        self._signature: tuple = ()
        self._vec: Vectors | None = None  # flat vectors and scales (initial: restart values)
        # the list's memory layout (data pointers, shapes, strides, dtypes) and its state
        self._state: tuple[tuple, _State] | None = None
        self._cfg = _CONFIG
        self._age: torch.Tensor | None = None  # (N,) float32, see ``age``
        self._warm_next = False  # ``warm_up()`` was called: the next step warms up

    def reset(self) -> None:
        """Forget every vector; the next step starts from fresh random ones."""
        self._signature, self._vec, self._state, self._age = (), None, None, None

    @property
    def age(self) -> torch.Tensor | None:
        """``(N,)`` float32, on the matrices' device: the iterations each estimate has had since
        its vector last restarted. 0 where the last step's estimate was 0 or NaN (a zero or
        non-finite matrix: its vector restarts from its first value), below ``WARMUP_ITERS``
        for an estimate still rising from such a restart (a weight that starts to train from
        0, or recovers from a NaN): a lower bound ~20 % low that creeps up at one iteration a
        step. Read it with the estimates (one sync), then ``warm_up()``."""
        return self._age

    def warm_up(self) -> None:
        """Run at least ``WARMUP_ITERS`` iterations at the next step, as for new vectors: for a
        restarted estimate, seen in ``age``."""
        self._warm_next = True

    def step(self, matrices: Sequence[torch.Tensor], iters: int | None = None) -> torch.Tensor:
        """Run ``iters`` (default ``self.iters``) iterations; ``(N,)`` float32 estimates."""
        if not matrices:
            raise ValueError("PowerIteration.step needs at least one matrix")
        iters = self.iters if iters is None else iters
        if iters < 1:
            raise ValueError(f"PowerIteration.step iters must be >= 1, got {iters}")
        # hot path: a list laid out as before reuses its table (weights do not move)
        key = (
            tuple(map(torch.Tensor.data_ptr, matrices)),
            tuple(map(_SHAPE, matrices)),
            tuple(map(torch.Tensor.stride, matrices)),
            tuple(map(_DTYPE, matrices)),
        )
        cached = self._state
        if cached is not None and cached[0] == key and cached[1].signature is self._signature:
            state = cached[1]
        else:
            state = self._prepare(matrices)
            # One layout is kept: a new one means the matrices moved (model.half(), .to(device),
            # a swapped or reloaded Parameter), and the old views would keep the old weights'
            # memory alive. Nothing refers to the caller's tensors (a weak reference to a
            # Parameter makes torch.utils.swap_tensors refuse it: model.to() and
            # load_state_dict under swap_module_params_on_conversion, tensor subclasses).
            self._state = (key, state) if state.cacheable else None
        fresh = self._age is None  # new vectors (the first call, a list whose shapes changed)
        if fresh or self._warm_next:  # or restarted ones: converge once, or the first
            # estimates read ~20 % low and "grow" over the next samples (weights constant)
            iters = max(iters, WARMUP_ITERS)
            self._warm_next = False
        if state.plan is not None:
            run = functools.partial(_run_split, state, self._vec, iters, self._cfg)
            sigma = self._run(state, iters, run)
        else:
            with torch.no_grad():
                sigma = power_iteration_reference(state.views, self._vec, iters)
        self._age = torch.where(sigma > 0, iters if fresh else self._age + iters, 0.0)
        return sigma

    @staticmethod
    def _run(state: _State, kind: Hashable, launches: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``launches()``, replayed as a CUDA graph from the third run of this kind on (the
        weights, vectors and tables stay where they are; an eager loop is often bound by the
        host, and a replay is one call where the launches were two or more)."""
        sigma = replay(state.graphs, kind)
        if sigma is None:
            sigma = launches()
            state.runs[kind] += 1
            capture_when_due(state.graphs, kind, state.runs[kind], sigma.device, launches)
        return sigma

    def _prepare(self, matrices: Sequence[torch.Tensor]) -> _State:
        """Orient and check the list, (re)build the vectors, choose the path, build the table."""
        entries = [_orient(t.detach()) for t in matrices]
        device = entries[0].view.device
        if any(e.view.device != device for e in entries):
            raise ValueError("PowerIteration.step needs all matrices on one device")
        self._ensure_vectors(entries, device)
        copied = [e.view.data_ptr() != t.data_ptr() for e, t in zip(entries, matrices, strict=True)]
        cacheable = not any(copied)
        use_triton = self.backend == "triton" or (
            self.backend == "auto" and device.type == "cuda" and triton is not None
        )
        views = [e.view for e in entries]
        offsets = _flat_offsets(views)
        plan, rest, order = None, [], None
        if use_triton:
            if triton is None:
                raise RuntimeError("PowerIteration backend='triton' needs triton installed")
            if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
                raise ValueError(
                    f"PowerIteration backend='triton' runs on CUDA tensors (got {device}); on a "
                    "CPU it needs TRITON_INTERPRET=1, otherwise use backend='torch' or 'auto'"
                )
            held = [i for i, a in enumerate(views) if a.dtype in _FORMATS and a.shape[2] <= MAX_ROW]
            if held:
                plan = _build_plan(
                    [views[i] for i in held], [offsets[i] for i in held], device, self._cfg
                )
                rest = sorted(set(range(len(views))) - set(held))
            if rest:
                starts = [0, *itertools.accumulate(a.shape[0] for a in views)]
                src = [j for i in held + rest for j in range(starts[i], starts[i + 1])]
                order = to_device(src, torch.long, device).argsort()
        return _State(self._signature, plan, views, offsets, rest, order, cacheable, Counter(), {})

    def _ensure_vectors(self, entries: Sequence[_Entry], device: torch.device) -> None:
        """(Re)build the vector buffers when the list's shapes changed, keeping what still fits."""
        signature = _signature(entries)
        if signature == self._signature and self._vec is not None and self._vec.v.device == device:
            return
        gen = torch.Generator(device=device).manual_seed(self.seed)
        old = self._split(self._signature, self._vec) if self._vec is not None else []
        parts: list[tuple[torch.Tensor, ...]] = []
        for j, e in enumerate(entries):
            keep = j < len(old) and self._signature[j] == signature[j]
            keep = keep and old[j][0].device == device
            if keep:
                parts.append(old[j])
            else:
                v, c = _start_vectors(e.view, gen)
                parts.append((v.reshape(-1), v.reshape(-1), c, c))
        self._vec = Vectors(*(torch.cat(column) for column in zip(*parts, strict=True)))
        self._signature = signature
        self._state, self._age = None, None

    @staticmethod
    def _split(signature: tuple, vec: Vectors) -> list[tuple[torch.Tensor, ...]]:
        """Each batch's (v, v0, c, c0) slices of ``vec``."""
        sizes = [shape[0] * shape[2] for shape, _ in signature]
        counts = [shape[0] for shape, _ in signature]
        vs, v0s = vec.v.split(sizes), vec.v0.split(sizes)
        cs, c0s = vec.c.split(counts), vec.c0.split(counts)
        return list(zip(vs, v0s, cs, c0s, strict=True))
