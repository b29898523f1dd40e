"""Spectral norms of many matrices at once by warm-started power iteration.

The largest singular value sigma(A) of every weight (and of every attention head's slice of W_Q
and W_K) grows before attention-logit blow-ups. An exact SVD of GPT-2's weights takes seconds;
one power-iteration step reads each matrix twice. The vectors persist between calls (warm start),
so while the weights drift slowly a single iteration per training step tracks sigma closely.

One iteration on a matrix A (m, k) with unit vector u (m,):
    v = A^T u            (pass 1: per column block and row segment; partial sums over segments)
    v <- v / ||v||       (per matrix: the segments summed once)
    w = A v              (pass 2: per row block)
    sigma = ||w||,  u <- w / sigma
``sigma = ||A A^T u|| / ||A^T u||`` is a lower bound of sigma(A) that rises to it. When ``v`` is 0
(A == 0, or u orthogonal to A's columns) the estimate is 0; when it is not finite (A holds Inf or
NaN) the estimate is NaN; in both cases u restarts from its initial random vector, so a weight
that recovers is tracked again.

Alternating mode (``PowerIteration(alternate=True)``): each call runs one of the two passes,
in turn. A v-pass sets v <- A^T u / ||A^T u|| and estimates sigma by ||A^T u||; a u-pass sets
u <- A v / ||A v|| and estimates it by ||A v||. Two calls are one iteration exactly, each reads
every matrix once: an estimate every call at half the bytes, with the convergence per byte of
one iteration every other call.

``PowerIteration`` is what probes call. ``power_iteration_reference`` is the pure-torch path (the
CPU path and the oracle of the Triton kernels): it groups matrices of one shape and dtype into one
batched matmul. The Triton path runs every matrix of a dtype in one launch per pass, reading
strided views in place (pointer table), four launches per iteration in all.
"""

from __future__ import annotations

import functools
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from operator import attrgetter
from typing import NamedTuple

import torch

from .host_copy import to_device
from .launch import Relauncher, capture_when_due, replay

_SHAPE, _DTYPE = attrgetter("shape"), attrgetter("dtype")
_TORCH_V = object()  # alternate mode: the unit v lives in the torch path's buffer
_TINY = 1.1754944e-38  # smallest normal fp32: ||v||^2 floor, so v == 0 stays 0 (no 0/0)

__all__ = [
    "PowerIteration",
    "head_views",
    "power_iteration_reference",
    "power_pass_reference",
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


def qk_logit_bound(sigma_q: torch.Tensor, sigma_k: torch.Tensor, scale: float) -> torch.Tensor:
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


def power_iteration_reference(
    views: Sequence[torch.Tensor],
    u: torch.Tensor,
    u0: torch.Tensor,
    iters: int,
) -> torch.Tensor:
    """``iters`` iterations over oriented batches ``views[i]`` ``(n_i, m_i, k_i)``; updates ``u``.

    ``u`` and ``u0`` are flat float32 buffers holding each batch's ``(n_i, m_i)`` unit vectors in
    order (current and restart). Batches of one shape and dtype are concatenated (one copy) and
    run as one batched matmul in float32. Returns the ``(sum n_i,)`` float32 estimates.
    """
    offsets, row = [], 0
    for a in views:
        offsets.append(row)
        row += a.shape[0] * a.shape[1]
    groups: dict[tuple, list[int]] = {}
    for i, a in enumerate(views):
        groups.setdefault((a.shape[1], a.shape[2], a.dtype), []).append(i)
    sigma_parts: dict[int, torch.Tensor] = {}
    for members in groups.values():
        a = torch.cat([views[i] for i in members]).float()  # (B, m, k)
        m = a.shape[1]
        uu = torch.cat([u[offsets[i] : offsets[i] + views[i].shape[0] * m] for i in members])
        uu = uu.view(-1, m)
        restart = torch.cat([u0[offsets[i] : offsets[i] + views[i].shape[0] * m] for i in members])
        restart = restart.view(-1, m)
        for _ in range(iters):
            v, nv2 = _v_half(a, uu)
            uu, sigma = _u_half(a, v, nv2, restart)
        start = 0
        for i in members:
            n = views[i].shape[0]
            u[offsets[i] : offsets[i] + n * m] = uu[start : start + n].reshape(-1)
            sigma_parts[i] = sigma[start : start + n]
            start += n
    return torch.cat([sigma_parts[i] for i in range(len(views))])


def _v_half(a: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v = A^T u / ||A^T u|| (0 where A^T u = 0) and ||A^T u||^2 for a float32 batch a (B, m, k)."""
    t = torch.bmm(a.transpose(1, 2), u.unsqueeze(-1)).squeeze(-1)  # (B, k)
    nv2 = t.square().sum(-1)
    return t / nv2.clamp_min(_TINY).sqrt().unsqueeze(-1), nv2


def _u_half(
    a: torch.Tensor, v: torch.Tensor, nv2: torch.Tensor, restart: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, sigma) from the unit v: w = A v, sigma = ||w|| (0 where the v-half found A^T u = 0,
    NaN on a breakdown), u = w / sigma, or ``restart`` on a breakdown."""
    w = torch.bmm(a, v.unsqueeze(-1)).squeeze(-1)  # (B, m)
    s = w.norm(dim=-1)
    ok = (nv2 > 0) & torch.isfinite(nv2) & (s > 0) & torch.isfinite(s)
    sigma = torch.where(nv2 == 0, 0.0, torch.where(ok, s, float("nan")))
    return torch.where(ok.unsqueeze(-1), w / s.unsqueeze(-1), restart), sigma


def power_pass_reference(
    views: Sequence[torch.Tensor],
    u: torch.Tensor,
    v: torch.Tensor,
    nv2: torch.Tensor,
    u0: torch.Tensor,
    to_v: bool,
) -> torch.Tensor:
    """One pass of the alternating iteration over oriented batches ``views[i]`` ``(n_i, m_i,
    k_i)``; returns the ``(sum n_i,)`` float32 estimates.

    ``to_v``: v <- A^T u / ||A^T u||, ``nv2`` <- ||A^T u||^2, estimate ||A^T u|| (NaN when not
    finite). Otherwise the u-half of ``power_iteration_reference``'s iteration from this v.
    ``u``, ``u0`` (sum n*m), ``v`` (sum n*k) and ``nv2`` (sum n) are flat float32 buffers in
    list order, updated in place.
    """
    out = []
    iu = iv = row = 0
    for a in views:
        n, m, k = a.shape
        af = a.float()
        uu, vv = u[iu : iu + n * m].view(n, m), v[iv : iv + n * k].view(n, k)
        n2 = nv2[row : row + n]
        if to_v:
            new_v, new_n2 = _v_half(af, uu)
            vv.copy_(new_v)
            n2.copy_(new_n2)
            out.append(torch.where(torch.isfinite(n2), n2.sqrt(), float("nan")))
        else:
            new_u, sigma = _u_half(af, vv, n2, u0[iu : iu + n * m].view(n, m))
            uu.copy_(new_u)
            out.append(sigma)
        iu, iv, row = iu + n * m, iv + n * k, row + n
    return torch.cat(out)


# --- Triton kernels ------------------------------------------------------------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs no triton
    triton = None

_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_DTYPES = {v: k for k, v in _FORMATS.items()}
_MAT_FIELDS = 9  # ptr, m, k, stride_m, u_off, vp_off, n_seg, first pass-2 tile, pass-2 tiles


class _Config(NamedTuple):
    """Tile shapes of the three kernels."""

    bm1: int = 32  # pass 1 tile rows
    bk1: int = 64  # pass 1 tile columns (one program per column block and row segment)
    seg_min: int = 1024  # pass 1 rows per program at least
    max_segs: int = 16  # pass 1 row segments per matrix at most
    bm2: int = 32  # pass 2 tile rows
    bk2: int = 64  # pass 2 tile columns
    elems2: int = 32768  # pass 2 elements per program, about (whole row blocks)
    num_warps: int = 4


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

    @triton.jit(do_not_specialize=["n_mats", "n_tiles1", "tile_base"])
    def _pi_pass1_kernel(
        table_ptr, u_ptr, vp_ptr, n_mats, n_tiles1, tile_base,
        FMT: tl.constexpr, ALIGN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """vp[seg, cols] = A[seg rows, cols]^T u[seg rows] for one (column block, row segment)."""
        tile = tile_base + tl.program_id(0)
        tiles = table_ptr + 9 * n_mats
        i = tl.load(tiles + tile)
        cb = tl.load(tiles + n_tiles1 + tile)
        r0 = tl.load(tiles + 2 * n_tiles1 + tile)
        r1 = tl.load(tiles + 3 * n_tiles1 + tile)
        seg = tl.load(tiles + 4 * n_tiles1 + tile)
        a_ptr = _matrix_ptr(tl.load(table_ptr + i), FMT, ALIGN)
        k = tl.load(table_ptr + 2 * n_mats + i)
        sm = tl.load(table_ptr + 3 * n_mats + i)
        u_off = tl.load(table_ptr + 4 * n_mats + i)
        vp_off = tl.load(table_ptr + 5 * n_mats + i)
        if ALIGN > 1:  # rows start and end on 16-byte boundaries: vector loads
            sm = tl.multiple_of(sm, ALIGN)
            k = tl.multiple_of(k, ALIGN)
        cols = cb * BK + tl.arange(0, BK)
        cmask = cols < k
        acc = tl.zeros([BM, BK], tl.float32)
        for r in range(r0, r1, BM):
            rows = r + tl.arange(0, BM)
            rmask = rows < r1
            a = tl.load(
                a_ptr + rows[:, None] * sm + cols[None, :],
                mask=rmask[:, None] & cmask[None, :],
                other=0.0,
            ).to(tl.float32)
            uu = tl.load(u_ptr + u_off + rows, mask=rmask, other=0.0)
            acc += a * uu[:, None]
        tl.store(vp_ptr + vp_off + seg * k + cols, tl.sum(acc, 0), mask=cmask)

    @triton.jit
    def _load_v(vp_ptr, vp_off, n_seg, k, cols, cmask):
        """v[cols]: the sum of pass 1's row-segment partials, in segment order."""
        v = tl.load(vp_ptr + vp_off + cols, mask=cmask, other=0.0)
        for s in range(1, n_seg):
            v += tl.load(vp_ptr + vp_off + s * k + cols, mask=cmask, other=0.0)
        return v

    @triton.jit(do_not_specialize=["n_mats"])
    def _pi_vnorm_kernel(table_ptr, vp_ptr, nv2_ptr, sigma_ptr, n_mats, BLOCK: tl.constexpr):
        """v = the sum of pass 1's row-segment partials, scaled to unit length and written over
        segment 0 (all pass 2 reads, so that its row blocks never re-add segments); ||v||^2, and
        ||v|| as the v-pass estimate (NaN when not finite; a u-pass overwrites it)."""
        i = tl.program_id(0)
        k = tl.load(table_ptr + 2 * n_mats + i)
        vp_off = tl.load(table_ptr + 5 * n_mats + i)
        n_seg = tl.load(table_ptr + 6 * n_mats + i)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for c in range(0, k, BLOCK):
            cols = c + offs
            v = _load_v(vp_ptr, vp_off, n_seg, k, cols, cols < k)
            acc += v * v
        nv2 = tl.sum(acc, 0)
        inv = 1.0 / tl.sqrt(tl.maximum(nv2, 1.1754944e-38))  # v == 0: w = 0, sigma 0
        for c in range(0, k, BLOCK):
            cols = c + offs
            cmask = cols < k
            v = _load_v(vp_ptr, vp_off, n_seg, k, cols, cmask)
            tl.store(vp_ptr + vp_off + cols, v * inv, mask=cmask)
        tl.store(nv2_ptr + i, nv2)
        tl.store(sigma_ptr + i, tl.where(nv2 < float("inf"), tl.sqrt(nv2), float("nan")))

    @triton.jit(do_not_specialize=["n_mats", "n_tiles1", "n_tiles2", "tile_base"])
    def _pi_pass2_kernel(
        table_ptr, u_ptr, vp_ptr, sq_ptr, n_mats, n_tiles1, n_tiles2, tile_base,
        FMT: tl.constexpr, ALIGN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """u[rows] = A[rows] v (v of unit length) for a range of rows; sum of squares of those
        rows."""
        tile = tile_base + tl.program_id(0)
        tiles = table_ptr + 9 * n_mats + 5 * n_tiles1
        i = tl.load(tiles + tile)
        r0 = tl.load(tiles + n_tiles2 + tile)
        r1 = tl.load(tiles + 2 * n_tiles2 + tile)
        a_ptr = _matrix_ptr(tl.load(table_ptr + i), FMT, ALIGN)
        k = tl.load(table_ptr + 2 * n_mats + i)
        sm = tl.load(table_ptr + 3 * n_mats + i)
        u_off = tl.load(table_ptr + 4 * n_mats + i)
        vp_off = tl.load(table_ptr + 5 * n_mats + i)
        if ALIGN > 1:
            sm = tl.multiple_of(sm, ALIGN)
            k = tl.multiple_of(k, ALIGN)
        offs_k = tl.arange(0, BK)
        sq = tl.zeros([BM], tl.float32)
        for r in range(r0, r1, BM):
            rows = r + tl.arange(0, BM)
            rmask = rows < r1
            acc = tl.zeros([BM, BK], tl.float32)
            for c in range(0, k, BK):
                cols = c + offs_k
                cmask = cols < k
                v = tl.load(vp_ptr + vp_off + cols, mask=cmask, other=0.0)
                a = tl.load(
                    a_ptr + rows[:, None] * sm + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :],
                    other=0.0,
                ).to(tl.float32)
                acc += a * v[None, :]
            w = tl.sum(acc, 1)
            tl.store(u_ptr + u_off + rows, w, mask=rmask)
            sq += tl.where(rmask, w * w, 0.0)
        tl.store(sq_ptr + tile, tl.sum(sq, 0))

    @triton.jit(do_not_specialize=["n_mats"])
    def _pi_normalize_kernel(
        table_ptr, u_ptr, u0_ptr, sq_ptr, nv2_ptr, sigma_ptr, n_mats, BLOCK: tl.constexpr
    ):
        """sigma = ||w||; u <- w / sigma, or the restart vector when the iteration broke down."""
        i = tl.program_id(0)
        m = tl.load(table_ptr + n_mats + i)
        u_off = tl.load(table_ptr + 4 * n_mats + i)
        first = tl.load(table_ptr + 7 * n_mats + i)
        n_t2 = tl.load(table_ptr + 8 * n_mats + i)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for t0 in range(0, n_t2, BLOCK):
            acc += tl.load(sq_ptr + first + t0 + offs, mask=t0 + offs < n_t2, other=0.0)
        s = tl.sqrt(tl.sum(acc, 0))
        nv2 = tl.load(nv2_ptr + i)
        ok = (nv2 > 0) & (nv2 < float("inf")) & (s > 0) & (s < float("inf"))
        sigma = tl.where(nv2 == 0, 0.0, tl.where(ok, s, float("nan")))
        tl.store(sigma_ptr + i, sigma)
        inv = 1.0 / tl.where(ok, s, 1.0)
        for r in range(0, m, BLOCK):
            rows = r + offs
            rmask = rows < m
            w = tl.load(u_ptr + u_off + rows, mask=rmask, other=0.0)
            restart = tl.load(u0_ptr + u_off + rows, mask=rmask, other=0.0)
            tl.store(u_ptr + u_off + rows, tl.where(ok, w * inv, restart), mask=rmask)

    _launch_pass1 = Relauncher(_pi_pass1_kernel)
    _launch_vnorm = Relauncher(_pi_vnorm_kernel)
    _launch_pass2 = Relauncher(_pi_pass2_kernel)
    _launch_normalize = Relauncher(_pi_normalize_kernel)


class _Plan(NamedTuple):
    table: torch.Tensor  # int64 sections, layout in the kernels
    n_mats: int
    n_tiles1: int
    n_tiles2: int
    vp_size: int
    launches: tuple[tuple[torch.dtype, int, int, int, int, int], ...]
    # dtype, pass-1 tile base, pass-1 tiles, pass-2 tile base, pass-2 tiles, alignment (elements)
    vp: torch.Tensor  # pass 1's partials; segment 0 holds the unit v (kept for alternate passes)
    nv2: torch.Tensor  # ||A^T u||^2 per matrix, from the last pass 1
    vp_layout: tuple[int, ...]  # vp_off and n_seg of every matrix: plans that agree share vp


def _build_plan(entries: Sequence[_Entry], device: torch.device, cfg: _Config) -> _Plan:
    """Tables of every matrix (one per batch element) and of the tiles of both passes."""
    mats: list[list[int]] = []  # per matrix: ptr, m, k, stride_m, u_off, dtype index, entry order
    u_off = 0
    for e in entries:
        a = e.view
        n, m, k = a.shape
        for b in range(n):
            ptr = a.data_ptr() + b * a.stride(0) * a.element_size()
            mats.append([ptr, m, k, a.stride(1), u_off, _FORMATS[a.dtype]])
            u_off += m
    n_mats = len(mats)
    dtypes = sorted({mat[5] for mat in mats})
    order = sorted(range(n_mats), key=lambda i: mats[i][5])  # group the tiles by dtype
    vp_off, n_seg, first2, n_t2 = ([0] * n_mats for _ in range(4))
    tiles1: list[tuple[int, int, int, int, int]] = []
    tiles2: list[tuple[int, int, int]] = []
    launches = []
    vp_size = 0
    for fmt in dtypes:
        base1, base2, align = len(tiles1), len(tiles2), 16
        for i in order:
            ptr, m, k, sm, _, f = mats[i]
            if f != fmt:
                continue
            elem = torch.empty((), dtype=_DTYPES[f]).element_size()
            align = _common_alignment(align, ptr, sm, k, elem)
            seg_rows = max(cfg.seg_min, -(-m // cfg.max_segs))
            seg_rows = -(-seg_rows // cfg.bm1) * cfg.bm1
            n_seg[i] = -(-m // seg_rows)
            vp_off[i] = vp_size
            vp_size += n_seg[i] * k
            for s in range(n_seg[i]):
                r0, r1 = s * seg_rows, min(m, (s + 1) * seg_rows)
                tiles1.extend((i, cb, r0, r1, s) for cb in range(-(-k // cfg.bk1)))
            rows2 = max(cfg.bm2, -(-cfg.elems2 // k) // cfg.bm2 * cfg.bm2)
            first2[i] = len(tiles2)
            tiles2.extend((i, r0, min(m, r0 + rows2)) for r0 in range(0, m, rows2))
            n_t2[i] = len(tiles2) - first2[i]
        launches.append(
            (_DTYPES[fmt], base1, len(tiles1) - base1, base2, len(tiles2) - base2, align)
        )
    columns = [[mat[j] for mat in mats] for j in range(5)]
    table = to_device(
        [x for col in columns for x in col]
        + vp_off
        + n_seg
        + first2
        + n_t2
        + [t[j] for j in range(5) for t in tiles1]
        + [t[j] for j in range(3) for t in tiles2],
        torch.int64,
        device,
    )
    vp = torch.empty(max(vp_size, 1), dtype=torch.float32, device=device)
    nv2 = torch.empty(n_mats, dtype=torch.float32, device=device)
    layout = (*vp_off, *n_seg)
    return _Plan(table, n_mats, len(tiles1), len(tiles2), vp_size, tuple(launches), vp, nv2, layout)


def _common_alignment(align: int, ptr: int, stride_m: int, k: int, elem: int) -> int:
    """Vector width (elements) of a launch: 16 bytes when every row starts and ends aligned."""
    if align == 1 or ptr % 16 or (stride_m * elem) % 16 or (k * elem) % 16:
        return 1
    return 16 // elem


def _run_triton(
    plan: _Plan, u: torch.Tensor, u0: torch.Tensor, iters: int, cfg: _Config
) -> torch.Tensor:
    sigma = torch.empty(plan.n_mats, dtype=torch.float32, device=u.device)
    with _on_device(u.device):
        for _ in range(iters):
            _v_pass(plan, u, sigma, cfg)
            _u_pass(plan, u, u0, sigma, cfg)
    return sigma


def _run_triton_pass(
    plan: _Plan, u: torch.Tensor, u0: torch.Tensor, to_v: bool, cfg: _Config
) -> torch.Tensor:
    """One pass of the alternating iteration (see ``power_pass_reference``)."""
    sigma = torch.empty(plan.n_mats, dtype=torch.float32, device=u.device)
    with _on_device(u.device):
        if to_v:
            _v_pass(plan, u, sigma, cfg)
        else:
            _u_pass(plan, u, u0, sigma, cfg)
    return sigma


def _on_device(device: torch.device) -> AbstractContextManager:
    switch = device.type == "cuda" and device.index != torch.cuda.current_device()
    return torch.cuda.device(device) if switch else nullcontext()


def _v_pass(plan: _Plan, u: torch.Tensor, sigma: torch.Tensor, cfg: _Config) -> None:
    """v <- A^T u / ||A^T u|| into ``plan.vp``'s segment 0, ||A^T u||^2 into ``plan.nv2``, the
    estimate ||A^T u|| into ``sigma``."""
    for dtype, base1, n1, _, _, align in plan.launches:
        fmt = _FORMATS[dtype]
        _launch_pass1(
            (fmt, align, cfg), (n1,), plan.table, u, plan.vp, plan.n_mats, plan.n_tiles1, base1,
            FMT=fmt, ALIGN=align, BM=cfg.bm1, BK=cfg.bk1,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    _launch_vnorm(
        None, (plan.n_mats,),
        plan.table, plan.vp, plan.nv2, sigma, plan.n_mats, BLOCK=256, num_warps=4,
    )  # fmt: skip


def _u_pass(
    plan: _Plan, u: torch.Tensor, u0: torch.Tensor, sigma: torch.Tensor, cfg: _Config
) -> None:
    """w = A v from ``plan.vp``; sigma = ||w||; u <- w / sigma, or the restart vector."""
    sq = torch.empty(max(plan.n_tiles2, 1), dtype=torch.float32, device=u.device)
    for dtype, _, _, base2, n2, align in plan.launches:
        fmt = _FORMATS[dtype]
        _launch_pass2(
            (fmt, align, cfg), (n2,),
            plan.table, u, plan.vp, sq, plan.n_mats, plan.n_tiles1, plan.n_tiles2, base2,
            FMT=fmt, ALIGN=align, BM=cfg.bm2, BK=cfg.bk2,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    _launch_normalize(
        None, (plan.n_mats,),
        plan.table, u, u0, sq, plan.nv2, sigma, plan.n_mats, BLOCK=256, num_warps=4,
    )  # fmt: skip


class _State(NamedTuple):
    """What a step over one list layout needs, valid while the vectors keep ``signature``."""

    signature: tuple
    plan: _Plan | None  # Triton path (None: torch path)
    views: list[torch.Tensor]  # the oriented batches (they also keep copies alive to the launch)
    cacheable: bool  # False when an entry had to be copied (its address changes every call)
    # Triton path, CUDA: by kind of launch sequence ("v"/"u" pass, or a number of iterations),
    # its plain runs so far and its captured (graph, sigma) (None: capture failed)
    runs: Counter[Hashable]
    graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor] | None]


class PowerIteration:
    """Warm-started largest-singular-value estimates of a fixed list of matrix batches.

    ``step(matrices)`` takes the same list every call: 2-D ``(m, k)`` matrices and/or 3-D
    ``(n, m, k)`` batches (any strides; e.g. ``head_views`` of a fused qkv weight) and returns the
    ``(sum of batch sizes,)`` float32 estimates in list order, on the matrices' device, without a
    host sync. Vectors persist between calls; an entry whose shape (or orientation) changes is
    re-initialized, the others keep theirs. ``iters`` iterations run per call; with
    ``alternate=True`` one pass runs per call instead (module docstring), a v-pass first.

    ``backend``: ``"triton"`` (one launch per pass and dtype over every matrix; on a CPU only
    under ``TRITON_INTERPRET=1``), ``"torch"`` (``power_iteration_reference``), ``"auto"``
    (triton on CUDA when installed, torch elsewhere). Supported kernel dtypes: fp32, bf16, fp16
    (others go through torch). Arithmetic is float32.
    """

    def __init__(
        self, iters: int = 1, backend: str = "auto", seed: int = 0, alternate: bool = False
    ) -> None:
        if iters < 1:
            raise ValueError(f"PowerIteration iters must be >= 1, got {iters}")
        if alternate and iters != 1:
            raise ValueError("PowerIteration(alternate=True) runs one pass per call: iters=1")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        self.iters = iters
        self.backend = backend
        self.seed = seed
        self.alternate = alternate
        # alternate mode: where the unit v of the last v-pass lives (None: run a v-pass next)
        self._v_home: object | None = None
        self._v: torch.Tensor | None = None  # torch path: flat (sum n*k,) v, and ||A^T u||^2
        self._nv2: torch.Tensor | None = None
        self._signature: tuple = ()
        self._u: torch.Tensor | None = None  # flat (sum n*m,) float32 unit vectors
        self._u0: torch.Tensor | None = None  # their initial values: the restart vectors
        self._states: OrderedDict[tuple, _State] = OrderedDict()  # by memory layout of the list
        self._cfg = _CONFIG

    def reset(self) -> None:
        """Forget every vector; the next step starts from fresh random ones."""
        self._signature, self._u, self._u0 = (), None, None
        self._v_home = None

    def step(self, matrices: Sequence[torch.Tensor], iters: int | None = None) -> torch.Tensor:
        """Run ``iters`` (default ``self.iters``) iterations; ``(N,)`` float32 estimates."""
        if not matrices:
            raise ValueError("PowerIteration.step needs at least one matrix")
        iters = self.iters if iters is None else iters
        # hot path: a list laid out as before reuses its table (weights do not move)
        key = (
            tuple(map(torch.Tensor.data_ptr, matrices)),
            tuple(map(_SHAPE, matrices)),
            tuple(map(torch.Tensor.stride, matrices)),
            tuple(map(_DTYPE, matrices)),
        )
        state = self._states.get(key)
        if state is None or state.signature is not self._signature:
            state = self._prepare(matrices)
            if state.cacheable:
                self._states[key] = state
                if len(self._states) > 8:
                    self._states.popitem(last=False)
        if self.alternate:
            return self._pass(state)
        if state.plan is not None:
            run = functools.partial(_run_triton, state.plan, self._u, self._u0, iters, self._cfg)
            return self._run(state, iters, run)
        with torch.no_grad():
            return power_iteration_reference(state.views, self._u, self._u0, iters)

    def _pass(self, state: _State) -> torch.Tensor:
        """One pass of the alternating iteration: a u-pass only where the last v-pass left its v
        (the buffer of the tables of this layout, or the torch path's), a v-pass otherwise."""
        home = state.plan.vp if state.plan is not None else _TORCH_V
        to_v = self._v_home is not home
        self._v_home = home if to_v else None
        if state.plan is not None:
            run = functools.partial(
                _run_triton_pass, state.plan, self._u, self._u0, to_v, self._cfg
            )
            return self._run(state, "v" if to_v else "u", run)
        if to_v:
            n_k = sum(v.shape[0] * v.shape[2] for v in state.views)
            n = sum(v.shape[0] for v in state.views)
            self._v = torch.empty(n_k, dtype=torch.float32, device=self._u.device)
            self._nv2 = torch.empty(n, dtype=torch.float32, device=self._u.device)
        with torch.no_grad():
            return power_pass_reference(state.views, self._u, self._v, self._nv2, self._u0, to_v)

    @staticmethod
    def _run(state: _State, kind: Hashable, launches: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``launches()``, replayed as a CUDA graph from the third run of this kind on (the
        weights, vectors and tables stay where they are; an eager loop is often bound by the
        host, and a replay is one call where the launches were four or more)."""
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
        plan = None
        if use_triton:
            if triton is None:
                raise RuntimeError("PowerIteration backend='triton' needs triton installed")
            if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
                raise ValueError(
                    f"PowerIteration backend='triton' runs on CUDA tensors (got {device}); on a "
                    "CPU it needs TRITON_INTERPRET=1, otherwise use backend='torch' or 'auto'"
                )
            if all(e.view.dtype in _FORMATS for e in entries):
                plan = _build_plan(entries, device, self._cfg)
                # matrices that moved keep their v: a table of the same layout shares its buffers
                for other in self._states.values():
                    if other.plan is not None and other.plan.vp_layout == plan.vp_layout:
                        plan = plan._replace(vp=other.plan.vp, nv2=other.plan.nv2)
                        break
        views = [e.view for e in entries]
        return _State(self._signature, plan, views, cacheable, Counter(), {})

    def _ensure_vectors(self, entries: Sequence[_Entry], device: torch.device) -> None:
        """(Re)build the vector buffers when the list's shapes changed, keeping what still fits."""
        signature = _signature(entries)
        if signature == self._signature and self._u is not None and self._u.device == device:
            return
        gen = torch.Generator(device=device).manual_seed(self.seed)
        old = self._split(self._signature, self._u) if self._u is not None else []
        old0 = self._split(self._signature, self._u0) if self._u0 is not None else []
        parts, parts0 = [], []
        for j, e in enumerate(entries):
            n, m, _ = e.view.shape
            fresh = torch.randn(n, m, generator=gen, device=device)
            fresh = fresh / fresh.norm(dim=-1, keepdim=True)
            keep = j < len(old) and self._signature[j] == signature[j] and old[j].device == device
            parts.append(old[j] if keep else fresh.reshape(-1))
            parts0.append(old0[j] if keep else fresh.reshape(-1))
        self._u = torch.cat(parts)
        self._u0 = torch.cat(parts0)
        self._signature = signature
        self._states.clear()
        self._v_home = None

    @staticmethod
    def _split(signature: tuple, flat: torch.Tensor) -> list[torch.Tensor]:
        sizes = [shape[0] * shape[1] for shape, _ in signature]
        return list(flat.split(sizes))
