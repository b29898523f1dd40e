"""Triton kernels of numwatch's flash attention: forward, backward (dK/dV and dQ), launch configs.

The algorithm, its stabilization and the ``paper_repro`` emulation are defined (and documented)
by the pure-torch ``flash_attention_torch``; these kernels compute the same thing tile by tile.
Every tile moves through TMA tensor descriptors (4-D, made once per launch on the host; see
``_head_desc``), so any strides with a unit last stride work, and rows past T (odd lengths) and
columns past the head dim (32/80/96 padded to a power of two) are zero-filled on load and
clipped on store.

Two worlds (DESIGN.md §3): compiled on a GPU, and the interpreter on CPU (``TRITON_INTERPRET=1``),
where ``INTERPRET`` upcasts dot operands to fp32 and rounds fp32 -> bf16 to nearest even by
integer ops (the interpreter's cast truncates).
"""

from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from .flash_attention_torch import (
    LOG2E,
    MODE_PAPER,
    MODE_PLAIN,
    PAPER_MODES,
    SATURATION_LN,
    SHIFT_MAX_LN,
    SHIFT_MIN_LN,
    SPLIT_LOG2,
    STABILIZED_MODES,
)
from .launch import Relauncher, cdiv, direct_constructor, next_power_of_2

# triton.jit reads TRITON_INTERPRET when it decorates, so this is fixed at import time too.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_SPLIT_LOG2 = tl.constexpr(SPLIT_LOG2)  # a global a compiled kernel may read

# Sizes that only bound loops and masks: not specialized on (divisibility by 16, == 1), so one
# binary serves every length and head count.
_RUNTIME_INTS = ["H", "GROUP", "T_Q", "T_K"]

MASK_NONE = 0
MASK_BOOL = 1
MASK_ADD = 2


# ----------------------------------------------------------------------------- helpers


@triton.jit
def _round_f32(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x`` rounded to DTYPE (round-to-nearest-even), returned as fp32."""
    if INTERPRET and tl.bfloat16 == DTYPE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _to_lo(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> DTYPE, round-to-nearest-even in both worlds."""
    if INTERPRET and tl.bfloat16 == DTYPE:
        return _round_f32(x, DTYPE, INTERPRET).to(DTYPE)
    else:
        return x.to(DTYPE)


@triton.jit
def _mm(a, b, INTERPRET: tl.constexpr):
    """a @ b with fp32 accumulation (bf16/fp16 dots are wrong in the interpreter: upcast)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _mm_acc(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b, accumulated in place by the tensor cores on a GPU."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _head_desc(
    X,
    b,
    h,
    stride_b,
    stride_h,
    stride_t,
    T,
    HEAD_DIM,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """The tiles of one (batch, head) slice (T, HEAD_DIM) of a 4-D tensor.

    On a GPU, X already is a descriptor over the whole tensor, made once on the host: making one
    per program costs every program a tensor-map write and fence (8-21 % of the forward at
    T 1024: flash_attention_h200_descriptor_ab.json). The interpreter reads bf16 wrongly through
    host descriptors (triton 3.9), so there each program makes a 2-D one over its slice.
    """
    if INTERPRET:
        base = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
        return tl.make_tensor_descriptor(
            base, shape=[T, HEAD_DIM], strides=[stride_t, 1], block_shape=[BLOCK_T, BLOCK_D]
        )
    else:
        return X


@triton.jit
def _load_rows(desc, b, h, t0, INTERPRET: tl.constexpr):
    """The (BLOCK_T, BLOCK_D) tile at row t0 of head (b, h): zeros past T and HEAD_DIM."""
    if INTERPRET:
        return desc.load([t0, 0])
    else:
        x = desc.load([b, h, t0, 0])
        return x.reshape(x.shape[2], x.shape[3])


@triton.jit
def _store_rows(desc, b, h, t0, x, INTERPRET: tl.constexpr):
    """x (fp32) rounded to the tensor's dtype into rows t0.. of head (b, h), clipped at T."""
    x = _to_lo(x, desc.dtype, INTERPRET)
    if INTERPRET:
        desc.store([t0, 0], x)
    else:
        desc.store([b, h, t0, 0], x.reshape(1, 1, x.shape[0], x.shape[1]))


@triton.jit
def _logits(
    qk,
    offs_m,
    offs_n,
    MASK,
    mask_base,
    stride_mq,
    stride_mk,
    T_Q,
    T_K,
    sm_scale,
    MODE: tl.constexpr,
    MASK_KIND: tl.constexpr,
    EDGE: tl.constexpr,
    CAUSAL: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    DTYPE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Masked logits in log2 units from raw q.k products (rows = queries unless TRANSPOSED).

    Returns (x, xs) with logits = x * xs: without an additive mask or the paper's rounding of S,
    x is the raw product and the scale folds into the exp2's FMA (xs > 0 keeps max/compare valid).
    """
    if TRANSPOSED:
        rows_q = offs_m[None, :]
        cols_k = offs_n[:, None]
    else:
        rows_q = offs_m[:, None]
        cols_k = offs_n[None, :]
    PRESCALED: tl.constexpr = MODE % 4 >= 2 or MASK_KIND == 2
    if MASK_KIND != 0:
        mv = tl.load(
            MASK + mask_base + rows_q * stride_mq + cols_k * stride_mk,
            mask=(rows_q < T_Q) & (cols_k < T_K),
            other=0,
        )
    if PRESCALED:
        s = qk * sm_scale
        if MASK_KIND == 2:  # at or below MASK_SWAMPS: SWAMPED_LOGIT (see their comment)
            mv = mv.to(tl.float32)
            swamped = (mv <= -1.2676506002282294e30) & (mv != float("-inf"))
            s = tl.where(swamped, -22713.046875, s + mv)
        if MODE % 4 >= 2:  # the paper's kernel holds S in the input dtype
            s = _round_f32(s, DTYPE, INTERPRET)
        x = s * 1.4426950408889634
        xs = 1.0
    else:
        x = qk
        xs = sm_scale * 1.4426950408889634
    if MASK_KIND == 1:
        x = tl.where(mv != 0, x, float("-inf"))
    if EDGE:
        valid = cols_k < T_K
        if CAUSAL:
            valid = valid & (cols_k <= rows_q)
        x = tl.where(valid, x, float("-inf"))
    return x, xs


# ----------------------------------------------------------------------------- forward


@triton.jit
def _fwd_block(
    acc,
    l_r,
    acc_far,
    l_far,
    l_e,
    m_raw,
    m_sh,
    cnt,
    q,
    k_desc,
    v_desc,
    b,
    hk,
    n0,
    offs_m,
    arange_n,
    MASK,
    mask_base,
    stride_mq,
    stride_mk,
    T_Q,
    T_K,
    sm_scale,
    beta_m1,
    dmin2,
    dmax2,
    SAT2: tl.constexpr,
    MODE: tl.constexpr,
    MASK_KIND: tl.constexpr,
    EDGE: tl.constexpr,
    CAUSAL: tl.constexpr,
    DTYPE: tl.constexpr,
    ROWSUM_MMA: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One key block of the online softmax (see flash_attention_torch.reference_forward).

    ROWSUM_MMA: the row sum of P̄ on the tensor cores, which takes an upcast and an add per score
    off the ALU pipes (SASS at D 64, 64x64 tiles: -28 % plain, -22 % stabilized instructions per
    key block) for 4 KB more shared memory (too much for the 3-stage D 128 tiles).
    acc_far, l_far: the split sum's second part (MODE_SPLIT), P̄V and the row sum of the entries
    more than 2^-SPLIT_LOG2 below the row's raw maximum.
    """
    k = _load_rows(k_desc, b, hk, n0, INTERPRET)  # (BLOCK_N, BLOCK_D)
    v = _load_rows(v_desc, b, hk, n0, INTERPRET)
    qk = _mm(q, tl.trans(k), INTERPRET)  # (BLOCK_M, BLOCK_N) fp32
    x, xs = _logits(
        qk,
        offs_m,
        n0 + arange_n,
        MASK,
        mask_base,
        stride_mq,
        stride_mk,
        T_Q,
        T_K,
        sm_scale,
        MODE,
        MASK_KIND,
        EDGE,
        CAUSAL,
        False,
        DTYPE,
        INTERPRET,
    )
    m_raw_new = tl.maximum(m_raw, tl.max(x, 1) * xs)  # (BLOCK_M,) log2 units
    if MODE % 2 == 1:  # the stabilizing shift (stabilized, and paper_repro_stabilized)
        # Entries whose exp2(s - m) rounds to 1.0 in DTYPE; the count carries across blocks
        # while the earlier maximum stays within the saturation window of the new one. Counted
        # in fp32 (exact below 2^24): a compare that yields 1.0/0.0 plus an add per score, where
        # an int32 count takes a third instruction (measured in the sm_90 SASS).
        thr = m_raw_new + SAT2
        saturated = tl.sum(tl.where(x >= (thr / xs)[:, None], 1.0, 0.0), 1)
        cnt = tl.where(m_raw >= thr, cnt, 0) + saturated
        extra = tl.where(m_raw_new > 0, beta_m1 * m_raw_new, -m_raw_new)
        extra = tl.minimum(tl.maximum(extra, dmin2), dmax2)
        m_new = tl.maximum(m_sh, tl.where(cnt >= 2, m_raw_new + extra, m_raw_new))
    else:
        m_new = tl.maximum(m_sh, m_raw_new)
    m_use = m_new
    if MASK_KIND != 0:  # a row may have seen only masked keys so far
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_sh - m_use)
    p = tl.math.exp2(x * xs - m_use[:, None])  # (BLOCK_M, BLOCK_N) fp32
    p_lo = _to_lo(p, DTYPE, INTERPRET)
    if MODE >= 4:  # the split sum: the far entries into their own accumulators
        near = x >= ((m_raw_new - _SPLIT_LOG2) / xs)[:, None]
        zero = tl.zeros_like(p_lo)
        p_far = tl.where(near, zero, p_lo)
        p_lo = tl.where(near, p_lo, zero)
        if ROWSUM_MMA:
            ones_far = tl.full([p_far.shape[1], 16], 1.0, DTYPE)
            l_far = _mm_acc(p_far, ones_far, l_far * alpha[:, None], INTERPRET)
        else:
            l_far = l_far * alpha + tl.sum(p_far.to(tl.float32), 1)
        acc_far = _mm_acc(p_far, v, acc_far * alpha[:, None], INTERPRET)
    if MODE % 4 >= 2:
        # Emulation of the paper's failing kernel: P̄V, O and l rounded to DTYPE per block.
        pv = _round_f32(_mm(p_lo, v, INTERPRET), DTYPE, INTERPRET)
        alpha_r = _round_f32(alpha, DTYPE, INTERPRET)
        acc = _round_f32(
            _round_f32(acc * alpha_r[:, None], DTYPE, INTERPRET) + pv, DTYPE, INTERPRET
        )
        l_blk = _round_f32(tl.sum(p_lo.to(tl.float32), 1), DTYPE, INTERPRET)
        l_r = _round_f32(_round_f32(l_r * alpha_r, DTYPE, INTERPRET) + l_blk, DTYPE, INTERPRET)
    else:
        # O is normalized by the sum of the same rounded P̄ that enter the P̄V product.
        if ROWSUM_MMA:  # on the tensor cores: P̄ times a ones block, every column the row sum
            ones = tl.full([p_lo.shape[1], 16], 1.0, DTYPE)
            l_r = _mm_acc(p_lo, ones, l_r * alpha[:, None], INTERPRET)
        else:
            l_r = l_r * alpha + tl.sum(p_lo.to(tl.float32), 1)
        acc = acc * alpha[:, None]
        acc = _mm_acc(p_lo, v, acc, INTERPRET)
    if MODE % 4 >= 2:  # the emulated kernel's LSE comes from the fp32 P̄, its l_r being rounded
        l_e = l_e * alpha + tl.sum(p, 1)
    return acc, l_r, acc_far, l_far, l_e, m_raw_new, m_new, cnt


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    MASK,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_mb,
    stride_mh,
    stride_mq,
    stride_mk,
    H,
    GROUP,
    T_Q,
    T_K,
    HEAD_DIM,
    sm_scale,
    beta_m1,
    dmin2,
    dmax2,
    SAT2: tl.constexpr,
    MODE: tl.constexpr,
    MASK_KIND: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    ROWSUM_MMA: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    DTYPE: tl.constexpr = Q.dtype.element_ty if INTERPRET else Q.dtype  # descriptor: element type
    pid_m = tl.program_id(0)
    if CAUSAL:  # longest rows first: fewer idle SMs at the tail
        pid_m = tl.cdiv(T_Q, BLOCK_M) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    q_desc = _head_desc(
        Q, b, h, stride_qb, stride_qh, stride_qt, T_Q, HEAD_DIM, BLOCK_M, BLOCK_D, INTERPRET
    )
    k_desc = _head_desc(
        K, b, hk, stride_kb, stride_kh, stride_kt, T_K, HEAD_DIM, BLOCK_N, BLOCK_D, INTERPRET
    )
    v_desc = _head_desc(
        V, b, hk, stride_vb, stride_vh, stride_vt, T_K, HEAD_DIM, BLOCK_N, BLOCK_D, INTERPRET
    )
    o_desc = _head_desc(
        Out, b, h, stride_ob, stride_oh, stride_ot, T_Q, HEAD_DIM, BLOCK_M, BLOCK_D, INTERPRET
    )
    mask_base = b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    q = _load_rows(q_desc, b, h, m0, INTERPRET)  # (BLOCK_M, BLOCK_D), stays on chip
    m_raw = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m_sh = tl.full([BLOCK_M], float("-inf"), tl.float32)
    cnt = tl.zeros([BLOCK_M], tl.float32)
    if MODE % 4 < 2 and ROWSUM_MMA:
        l_r = tl.zeros([BLOCK_M, 16], tl.float32)  # 16 equal columns: see _fwd_block
    else:
        l_r = tl.zeros([BLOCK_M], tl.float32)
    l_e = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if MODE >= 4:  # the split sum's far part
        acc_far = tl.zeros_like(acc)
        l_far = tl.zeros_like(l_r)
    else:  # unused
        acc_far = tl.zeros([1, 1], tl.float32)
        l_far = tl.zeros([1], tl.float32)

    # Key blocks that need no causal/bounds mask, then the edge blocks (diagonal, tail).
    full_hi = (T_K // BLOCK_N) * BLOCK_N
    hi = T_K
    if CAUSAL:
        full_hi = tl.minimum(full_hi, m0)
        hi = tl.minimum(T_K, m0 + BLOCK_M)
    for n0 in tl.range(0, full_hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        acc, l_r, acc_far, l_far, l_e, m_raw, m_sh, cnt = _fwd_block(
            acc,
            l_r,
            acc_far,
            l_far,
            l_e,
            m_raw,
            m_sh,
            cnt,
            q,
            k_desc,
            v_desc,
            b,
            hk,
            n0,
            offs_m,
            arange_n,
            MASK,
            mask_base,
            stride_mq,
            stride_mk,
            T_Q,
            T_K,
            sm_scale,
            beta_m1,
            dmin2,
            dmax2,
            SAT2,
            MODE,
            MASK_KIND,
            False,
            CAUSAL,
            DTYPE,
            ROWSUM_MMA,
            INTERPRET,
        )
    for n0 in tl.range(full_hi, hi, BLOCK_N):
        acc, l_r, acc_far, l_far, l_e, m_raw, m_sh, cnt = _fwd_block(
            acc,
            l_r,
            acc_far,
            l_far,
            l_e,
            m_raw,
            m_sh,
            cnt,
            q,
            k_desc,
            v_desc,
            b,
            hk,
            n0,
            offs_m,
            arange_n,
            MASK,
            mask_base,
            stride_mq,
            stride_mk,
            T_Q,
            T_K,
            sm_scale,
            beta_m1,
            dmin2,
            dmax2,
            SAT2,
            MODE,
            MASK_KIND,
            True,
            CAUSAL,
            DTYPE,
            ROWSUM_MMA,
            INTERPRET,
        )

    m_fin = tl.where(m_sh == float("-inf"), 0.0, m_sh)
    # Fully masked rows (attn_mask only) give O = 0 like SDPA, and LSE = +inf so that the
    # backward's P = exp2(S - LSE) is 0 there.
    if MODE >= 4:
        acc += acc_far
        l_r += l_far
    if MODE % 4 < 2 and ROWSUM_MMA:
        l_r = tl.max(l_r, 1)
    # One IEEE reciprocal per row and a multiply per element: the per-element division took ~500
    # instructions a program (SASS), and differs from it by at most one bf16 ulp, rarely.
    o = acc * tl.math.div_rn(1.0, tl.where(l_r > 0, l_r, 1.0))[:, None]
    # The LSE comes from the same row sum that normalizes O (an add per score fewer), so the
    # backward's P = exp2(S - LSE) sums to what the forward weighted V with.
    l_lse = l_e if MODE % 4 >= 2 else l_r
    lse = tl.where(l_lse > 0, m_fin + tl.math.log2(tl.where(l_lse > 0, l_lse, 1.0)), float("inf"))
    _store_rows(o_desc, b, h, m0, o, INTERPRET)
    tl.store(LSE + pid_bh.to(tl.int64) * T_Q + offs_m, lse, mask=offs_m < T_Q)


# ----------------------------------------------------------------------------- backward


@triton.jit
def _bwd_delta_kernel(
    Out,
    DO,
    DELTA,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_db,
    stride_dh,
    stride_dt,
    H,
    T_Q,
    HEAD_DIM,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """delta = rowsum(dO * O) in fp32, the softmax-gradient correction per query row."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    inb = (offs_m < T_Q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(
        Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
        mask=inb,
        other=0.0,
    )
    do = tl.load(
        DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_dt + offs_d[None, :],
        mask=inb,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * T_Q + offs_m, delta, mask=offs_m < T_Q)


@triton.jit
def _dkdv_block(
    dk,
    dv,
    k,
    v,
    q_desc,
    do_desc,
    b,
    h,
    m0,
    offs_n,
    arange_m,
    LSE_row,
    DELTA_row,
    MASK,
    mask_base,
    stride_mq,
    stride_mk,
    T_Q,
    T_K,
    sm_scale,
    MODE: tl.constexpr,
    MASK_KIND: tl.constexpr,
    EDGE: tl.constexpr,
    CAUSAL: tl.constexpr,
    DTYPE: tl.constexpr,
    EVEN_Q: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Contribution of one query block to dK, dV of one key block (transposed tiles).

    EVEN_Q: T_Q is a multiple of BLOCK_M, so no query block reaches past it and the LSE and
    delta loads need no per-element masks (about a third of the loop's ALU instructions at
    D 128 in the sm_90 SASS)."""
    offs_m = m0 + arange_m
    q = _load_rows(q_desc, b, h, m0, INTERPRET)  # (BLOCK_M, BLOCK_D)
    do = _load_rows(do_desc, b, h, m0, INTERPRET)
    # Rows past T_Q: LSE = +inf makes P = 0 there.
    if EVEN_Q:
        lse = tl.load(LSE_row + offs_m)
        dlt = tl.load(DELTA_row + offs_m)
    else:
        lse = tl.load(LSE_row + offs_m, mask=offs_m < T_Q, other=float("inf"))
        dlt = tl.load(DELTA_row + offs_m, mask=offs_m < T_Q, other=0.0)
    qk_t = _mm(k, tl.trans(q), INTERPRET)  # (BLOCK_N, BLOCK_M)
    x, xs = _logits(
        qk_t,
        offs_m,
        offs_n,
        MASK,
        mask_base,
        stride_mq,
        stride_mk,
        T_Q,
        T_K,
        sm_scale,
        MODE,
        MASK_KIND,
        EDGE,
        CAUSAL,
        True,
        DTYPE,
        INTERPRET,
    )
    p_t = tl.math.exp2(x * xs - lse[None, :])
    dv = _mm_acc(_to_lo(p_t, DTYPE, INTERPRET), do, dv, INTERPRET)
    dp_t = _mm(v, tl.trans(do), INTERPRET)
    ds_t = p_t * (dp_t - dlt[None, :])
    dk = _mm_acc(_to_lo(ds_t, DTYPE, INTERPRET), q, dk, INTERPRET)
    return dk, dv


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    LSE,
    DELTA,
    MASK,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_dob,
    stride_doh,
    stride_dot,
    stride_dkb,
    stride_dkh,
    stride_dkt,
    stride_dvb,
    stride_dvh,
    stride_dvt,
    stride_mb,
    stride_mh,
    stride_mq,
    stride_mk,
    H,
    GROUP,
    T_Q,
    T_K,
    HEAD_DIM,
    sm_scale,
    MODE: tl.constexpr,
    MASK_KIND: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_Q: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """dK, dV of one key block for one query head (GQA: the host sums the group's heads)."""
    DTYPE: tl.constexpr = Q.dtype.element_ty if INTERPRET else Q.dtype  # descriptor: element type
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    q_desc = _head_desc(
        Q, b, h, stride_qb, stride_qh, stride_qt, T_Q, HEAD_DIM, BLOCK_M, BLOCK_D, INTERPRET
    )
    do_desc = _head_desc(
        DO, b, h, stride_dob, stride_doh, stride_dot, T_Q, HEAD_DIM, BLOCK_M, BLOCK_D, INTERPRET
    )
    k_desc = _head_desc(
        K, b, hk, stride_kb, stride_kh, stride_kt, T_K, HEAD_DIM, BLOCK_N, BLOCK_D, INTERPRET
    )
    v_desc = _head_desc(
        V, b, hk, stride_vb, stride_vh, stride_vt, T_K, HEAD_DIM, BLOCK_N, BLOCK_D, INTERPRET
    )
    dk_desc = _head_desc(
        DK, b, h, stride_dkb, stride_dkh, stride_dkt, T_K, HEAD_DIM, BLOCK_N, BLOCK_D, INTERPRET
    )
    dv_desc = _head_desc(
        DV, b, h, stride_dvb, stride_dvh, stride_dvt, T_K, HEAD_DIM, BLOCK_N, BLOCK_D, INTERPRET
    )
    mask_base = b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    LSE_row = LSE + pid_bh.to(tl.int64) * T_Q
    DELTA_row = DELTA + pid_bh.to(tl.int64) * T_Q

    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    arange_m = tl.arange(0, BLOCK_M)
    # (BLOCK_N, BLOCK_D), stays on chip; rows past T_K are zeros and only feed dK/dV rows that
    # the store clips
    k = _load_rows(k_desc, b, hk, n0, INTERPRET)
    v = _load_rows(v_desc, b, hk, n0, INTERPRET)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:
        # Query rows < n0 see none of these keys; rows in [n0, n0 + BLOCK_N) need the mask.
        lo = n0 + BLOCK_N
        for m0 in tl.range(n0, tl.minimum(lo, T_Q), BLOCK_M):
            dk, dv = _dkdv_block(
                dk,
                dv,
                k,
                v,
                q_desc,
                do_desc,
                b,
                h,
                m0,
                offs_n,
                arange_m,
                LSE_row,
                DELTA_row,
                MASK,
                mask_base,
                stride_mq,
                stride_mk,
                T_Q,
                T_K,
                sm_scale,
                MODE,
                MASK_KIND,
                True,
                CAUSAL,
                DTYPE,
                EVEN_Q,
                INTERPRET,
            )
    for m0 in tl.range(lo, T_Q, BLOCK_M):
        dk, dv = _dkdv_block(
            dk,
            dv,
            k,
            v,
            q_desc,
            do_desc,
            b,
            h,
            m0,
            offs_n,
            arange_m,
            LSE_row,
            DELTA_row,
            MASK,
            mask_base,
            stride_mq,
            stride_mk,
            T_Q,
            T_K,
            sm_scale,
            MODE,
            MASK_KIND,
            False,
            CAUSAL,
            DTYPE,
            EVEN_Q,
            INTERPRET,
        )
    _store_rows(dk_desc, b, h, n0, dk * sm_scale, INTERPRET)
    _store_rows(dv_desc, b, h, n0, dv, INTERPRET)


@triton.jit
def _dq_block(
    dq,
    q,
    do,
    lse,
    dlt,
    k_desc,
    v_desc,
    b,
    hk,
    n0,
    offs_m,
    arange_n,
    MASK,
    mask_base,
    stride_mq,
    stride_mk,
    T_Q,
    T_K,
    sm_scale,
    MODE: tl.constexpr,
    MASK_KIND: tl.constexpr,
    EDGE: tl.constexpr,
    CAUSAL: tl.constexpr,
    DTYPE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Contribution of one key block to dQ of one query block."""
    k = _load_rows(k_desc, b, hk, n0, INTERPRET)  # (BLOCK_N, BLOCK_D)
    v = _load_rows(v_desc, b, hk, n0, INTERPRET)
    qk = _mm(q, tl.trans(k), INTERPRET)  # (BLOCK_M, BLOCK_N)
    x, xs = _logits(
        qk,
        offs_m,
        n0 + arange_n,
        MASK,
        mask_base,
        stride_mq,
        stride_mk,
        T_Q,
        T_K,
        sm_scale,
        MODE,
        MASK_KIND,
        EDGE,
        CAUSAL,
        False,
        DTYPE,
        INTERPRET,
    )
    p = tl.math.exp2(x * xs - lse[:, None])
    dp = _mm(do, tl.trans(v), INTERPRET)
    ds = p * (dp - dlt[:, None])
    return _mm_acc(_to_lo(ds, DTYPE, INTERPRET), k, dq, INTERPRET)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    LSE,
    DELTA,
    MASK,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_dob,
    stride_doh,
    stride_dot,
    stride_dqb,
    stride_dqh,
    stride_dqt,
    stride_mb,
    stride_mh,
    stride_mq,
    stride_mk,
    H,
    GROUP,
    T_Q,
    T_K,
    HEAD_DIM,
    sm_scale,
    MODE: tl.constexpr,
    MASK_KIND: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """dQ of one query block, looping over the key blocks it sees."""
    DTYPE: tl.constexpr = Q.dtype.element_ty if INTERPRET else Q.dtype  # descriptor: element type
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.cdiv(T_Q, BLOCK_M) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    q_desc = _head_desc(
        Q, b, h, stride_qb, stride_qh, stride_qt, T_Q, HEAD_DIM, BLOCK_M, BLOCK_D, INTERPRET
    )
    do_desc = _head_desc(
        DO, b, h, stride_dob, stride_doh, stride_dot, T_Q, HEAD_DIM, BLOCK_M, BLOCK_D, INTERPRET
    )
    k_desc = _head_desc(
        K, b, hk, stride_kb, stride_kh, stride_kt, T_K, HEAD_DIM, BLOCK_N, BLOCK_D, INTERPRET
    )
    v_desc = _head_desc(
        V, b, hk, stride_vb, stride_vh, stride_vt, T_K, HEAD_DIM, BLOCK_N, BLOCK_D, INTERPRET
    )
    dq_desc = _head_desc(
        DQ, b, h, stride_dqb, stride_dqh, stride_dqt, T_Q, HEAD_DIM, BLOCK_M, BLOCK_D, INTERPRET
    )
    mask_base = b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    q = _load_rows(q_desc, b, h, m0, INTERPRET)
    do = _load_rows(do_desc, b, h, m0, INTERPRET)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * T_Q + offs_m, mask=offs_m < T_Q, other=float("inf"))
    dlt = tl.load(DELTA + pid_bh.to(tl.int64) * T_Q + offs_m, mask=offs_m < T_Q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_hi = (T_K // BLOCK_N) * BLOCK_N
    hi = T_K
    if CAUSAL:
        full_hi = tl.minimum(full_hi, m0)
        hi = tl.minimum(T_K, m0 + BLOCK_M)
    for n0 in tl.range(0, full_hi, BLOCK_N):
        dq = _dq_block(
            dq,
            q,
            do,
            lse,
            dlt,
            k_desc,
            v_desc,
            b,
            hk,
            n0,
            offs_m,
            arange_n,
            MASK,
            mask_base,
            stride_mq,
            stride_mk,
            T_Q,
            T_K,
            sm_scale,
            MODE,
            MASK_KIND,
            False,
            CAUSAL,
            DTYPE,
            INTERPRET,
        )
    for n0 in tl.range(full_hi, hi, BLOCK_N):
        dq = _dq_block(
            dq,
            q,
            do,
            lse,
            dlt,
            k_desc,
            v_desc,
            b,
            hk,
            n0,
            offs_m,
            arange_n,
            MASK,
            mask_base,
            stride_mq,
            stride_mk,
            T_Q,
            T_K,
            sm_scale,
            MODE,
            MASK_KIND,
            True,
            CAUSAL,
            DTYPE,
            INTERPRET,
        )
    _store_rows(dq_desc, b, h, m0, dq * sm_scale, INTERPRET)


# ----------------------------------------------------------------------------- launch configs


class TileConfig(NamedTuple):
    """Tile sizes and launch parameters of one kernel (BLOCK_M: query rows, BLOCK_N: keys)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False
    rowsum_mma: bool = False  # forward only, see _fwd_block


# Per (kernel, padded head dim, causal) configs that take precedence over the tables below: the
# tuning sweep (bench/bench_flash_attention.py --sweep) sets them, and so does a JSON file named
# by NUMWATCH_FLASH_CONFIGS, e.g. {"fwd_stab,64,false": [64, 64, 4, 3, false]}
# (TileConfig's fields in order), to use configs tuned on another GPU.
CONFIG_OVERRIDES: dict[tuple[str, int, bool], TileConfig] = {}
KERNELS = ("fwd", "fwd_stab", "dkdv", "dq")
CONFIGS_ENV = "NUMWATCH_FLASH_CONFIGS"


def configs_to_json(configs: dict[tuple[str, int, bool], TileConfig]) -> dict[str, list]:
    """CONFIG_OVERRIDES in the JSON form that NUMWATCH_FLASH_CONFIGS reads."""
    return {f"{k},{d},{str(c).lower()}": list(cfg) for (k, d, c), cfg in configs.items()}


def configs_from_json(data: dict[str, list]) -> dict[tuple[str, int, bool], TileConfig]:
    out = {}
    for key, fields in data.items():
        kernel, d, causal = key.split(",")
        if kernel not in KERNELS or not 4 <= len(fields) <= len(TileConfig._fields):
            raise ValueError(
                f"flash attention config {key!r}: {fields!r}; keys are 'kernel,head_dim,causal' "
                f"with kernel in {KERNELS}, values the fields "
                f"{TileConfig._fields} in order (the last optional)"
            )
        out[(kernel, int(d), causal == "true")] = TileConfig(*fields)
    return out


if os.environ.get(CONFIGS_ENV):
    with open(os.environ[CONFIGS_ENV]) as f:
        CONFIG_OVERRIDES.update(configs_from_json(json.load(f)))

# Interpreter: small tiles, so that the short CPU test sequences still span several blocks.
_INTERPRET_CONFIGS = {
    "fwd": TileConfig(32, 32, 4, 1),
    "fwd_stab": TileConfig(32, 32, 4, 1),
    "dkdv": TileConfig(16, 32, 4, 1),
    "dq": TileConfig(32, 16, 4, 1),
}

# Hopper (H200) defaults per (padded head dim, causal), from the sweeps in bench/results (64
# and 128 timed; 32 and 256 follow their neighbours within the shared-memory limit). BLOCK_M
# must be a multiple of BLOCK_N for fwd/dq, and BLOCK_N of BLOCK_M for dkdv. The forward takes
# the rounded row sum on the tensor cores (rowsum_mma) at D 64 and 128, where it frees the ALU
# pipe that bounds it (flash_attention_h200_sweep4.json: 10-17 % faster). The stabilized
# forward ("fwd_stab") is tuned on its own: its saturation count costs registers and issue slots
# the plain kernel does not spend (at D 64 it keeps 2 stages).
_T, _F = True, False
_FWD_TILES = {
    (32, _F): TileConfig(128, 128, 4, 3),
    (32, _T): TileConfig(128, 128, 4, 3),
    (64, _F): TileConfig(64, 64, 4, 3, rowsum_mma=True),
    (64, _T): TileConfig(64, 64, 4, 3, rowsum_mma=True),
    (128, _F): TileConfig(128, 64, 8, 3, rowsum_mma=True),
    (128, _T): TileConfig(128, 64, 8, 3, rowsum_mma=True),
    (256, _F): TileConfig(64, 64, 4, 2),
    (256, _T): TileConfig(64, 64, 4, 2),
}
_GPU_CONFIGS = {
    "fwd": _FWD_TILES,
    "fwd_stab": {
        **_FWD_TILES,
        (64, _F): TileConfig(64, 64, 4, 2, rowsum_mma=True),
        (64, _T): TileConfig(64, 64, 4, 2, rowsum_mma=True),
    },
    "dkdv": {
        (d, c): TileConfig(*cfg)
        for c in (_F, _T)
        for d, cfg in (
            (32, (32, 128, 4, 3)),
            (64, (32, 128, 4, 3)),
            (128, (64, 128, 8, 3)),
            (256, (32, 64, 8, 1)),
        )
    },
    "dq": {
        (d, c): TileConfig(*cfg)
        for c in (_F, _T)
        for d, cfg in (
            (32, (128, 64, 8, 3)),
            (64, (128, 64, 8, 3)),
            (128, (128, 64, 8, 3)),
            (256, (64, 32, 8, 1)),
        )
    },
}


def padded_head_dim(d: int) -> int:
    """Head dim rounded up to the power of two the tiles use (zero-filled past d)."""
    return max(16, next_power_of_2(d))


def tile_config(kernel: str, block_d: int, causal: bool) -> TileConfig:
    """Config for ``kernel`` in {"fwd", "fwd_stab", "dkdv", "dq"}: override, interpreter, GPU
    default ("fwd_stab", the stabilized forward, also takes a "fwd" override)."""
    key = (kernel, block_d, causal)
    if key in CONFIG_OVERRIDES:
        cfg = CONFIG_OVERRIDES[key]
    elif kernel == "fwd_stab" and ("fwd", block_d, causal) in CONFIG_OVERRIDES:
        cfg = CONFIG_OVERRIDES[("fwd", block_d, causal)]
    elif INTERPRET:
        cfg = _INTERPRET_CONFIGS[kernel]
    else:
        cfg = _GPU_CONFIGS[kernel][(max(block_d, 32), causal)]
    # The causal diagonal and the key-block loops assume nested tiles: a mismatch computes
    # wrong results (64x128 causal forward tiles did in the sweep), so it is refused here.
    small, big = (cfg.block_m, cfg.block_n) if kernel == "dkdv" else (cfg.block_n, cfg.block_m)
    if big % small:
        names = ("BLOCK_M", "BLOCK_N") if kernel == "dkdv" else ("BLOCK_N", "BLOCK_M")
        raise ValueError(
            f"flash attention tile config {key}: {tuple(cfg)} needs {names[1]} a multiple of "
            f"{names[0]}"
        )
    return cfg


# ----------------------------------------------------------------------------- host wrappers


# TensorDescriptor without its checks (launch.direct_constructor)
_make_desc = direct_constructor(
    TensorDescriptor, ("base", "shape", "strides", "block_shape", "padding")
)


def _tiles(x: Tensor, block_t: int, block_d: int) -> Tensor | TensorDescriptor:
    """A (B, H, T, D) tensor as the kernels take it (see _head_desc): a TMA descriptor of
    (1, 1, block_t, block_d) tiles on a GPU, the tensor itself in the interpreter.

    Every tensor that gets here passed descriptor_ready and has no 0 dimension, which is what
    the descriptor's constructor asserts; _make_desc skips those checks, which were two thirds
    of its cost (a call makes 4 to 15 descriptors)."""
    if INTERPRET:
        return x
    return _make_desc(
        base=x, shape=list(x.shape), strides=list(x.stride()),
        block_shape=[1, 1, block_t, block_d], padding="zero",
    )  # fmt: skip


@functools.cache
def capability_major(device: torch.device) -> int:
    """The GPU's compute capability major (9: Hopper), cached: the dispatch asks on every call."""
    return torch.cuda.get_device_capability(device)[0]


def descriptor_ready(x: Tensor) -> bool:
    """Whether ``x`` meets TMA's layout rules: unit last stride, 16-byte strides and base, and
    no broadcast (stride 0) dimension, which a tensor map cannot describe (``expand``ed K/V:
    pass the K/V heads themselves, GQA needs no copies)."""
    item = x.element_size()
    return (
        x.stride(-1) == 1
        and all(
            (s * item) % 16 == 0 and (s or n == 1)
            for s, n in zip(x.stride()[:-1], x.shape[:-1], strict=True)
        )
        and x.data_ptr() % 16 == 0
    )


def aligned_copy(x: Tensor) -> Tensor:
    """A contiguous copy in a new allocation (16-byte aligned): ``contiguous()`` returns a
    contiguous tensor whose storage offset leaves its base unaligned as it is."""
    return x.clone(memory_format=torch.contiguous_format)


def _mask_args(mask: Tensor | None, like: Tensor) -> tuple[Tensor, int, tuple[int, ...]]:
    """Mask pointer, kind and its 4 strides (0 on broadcast dims)."""
    if mask is None:
        return like, MASK_NONE, (0, 0, 0, 0)
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), MASK_BOOL, mask.stride()
    return mask, MASK_ADD, mask.stride()


def stabilization_args(dtype: torch.dtype, beta: float) -> tuple[float, float, float, float]:
    """The forward's beta_m1, dmin2, dmax2 and SAT2 (log2 units)."""
    return (
        beta - 1.0,
        SHIFT_MIN_LN * LOG2E,
        SHIFT_MAX_LN[dtype] * LOG2E,
        SATURATION_LN[dtype] * LOG2E,
    )


def _mask_key(mask_t: Tensor, mask_kind: int) -> tuple:
    """What a launch specializes on in the mask pointer: its type and 16-byte alignment."""
    return (mask_kind, mask_t.dtype, mask_t.data_ptr() % 16 == 0)


# Every launch asks for FP fusion (a * b + c as one FMA) explicitly: Triton 3.9 warns that its
# default turns it off in 3.10, which would change the kernels' rounding and speed.
# The launches skip JITFunction.run once compiled (launch.Relauncher): its argument binding and
# specialization were most of a call's host time, about 40 arguments per kernel. Each key holds
# every integer argument's exact value, the dtypes, the mask pointer's alignment and the tile
# configuration: all a launch specializes on.
_launch_fwd = Relauncher(_fwd_kernel)
_launch_delta = Relauncher(_bwd_delta_kernel)
_launch_dkdv = Relauncher(_bwd_dkdv_kernel)
_launch_dq = Relauncher(_bwd_dq_kernel)


def triton_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    causal: bool,
    sm_scale: float,
    mode: int,
    beta: float,
) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel. q (B,H,Tq,D), k/v (B,Hk,Tk,D) descriptor-ready; mask None or
    expanded to (B,H,Tq,Tk). Returns O like q and the row log2-sum-exp (B,H,Tq) fp32."""
    b, h, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    block_d = padded_head_dim(d)
    cfg = tile_config("fwd_stab" if mode in STABILIZED_MODES else "fwd", block_d, causal)
    o = torch.empty_like(q)
    lse = torch.empty((b, h, tq), device=q.device, dtype=torch.float32)
    mask_t, mask_kind, ms = _mask_args(mask, q)
    grid = (cdiv(tq, cfg.block_m), b * h)
    bm, bn = cfg.block_m, cfg.block_n
    ints = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *ms,
            h, h // hk, tq, tk, d)  # fmt: skip
    beta_m1, dmin2, dmax2, sat2 = stabilization_args(q.dtype, beta)
    _launch_fwd(
        (q.dtype, sat2, mode, causal, cfg, block_d, _mask_key(mask_t, mask_kind), ints), grid,
        _tiles(q, bm, block_d), _tiles(k, bn, block_d), _tiles(v, bn, block_d),
        _tiles(o, bm, block_d), lse, mask_t, *ints, sm_scale, beta_m1, dmin2, dmax2,
        SAT2=sat2, MODE=mode, MASK_KIND=mask_kind, CAUSAL=causal,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        WARP_SPECIALIZE=cfg.warp_specialize, ROWSUM_MMA=cfg.rowsum_mma, INTERPRET=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True,
    )  # fmt: skip
    return o, lse


def triton_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    mask: Tensor | None,
    causal: bool,
    sm_scale: float,
    mode: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch delta, dK/dV and dQ kernels; returns (dq, dk, dv) in the input dtype."""
    b, h, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    group = h // hk
    block_d = padded_head_dim(d)
    if not descriptor_ready(do):
        do = aligned_copy(do)
    delta = torch.empty_like(lse)
    ints = (*o.stride()[:3], *do.stride()[:3], h, tq, d)
    _launch_delta(
        (o.dtype, do.dtype, o.data_ptr() % 16 == 0, do.data_ptr() % 16 == 0, block_d, ints),
        (cdiv(tq, 64), b * h), o, do, delta, *ints, BLOCK_M=64, BLOCK_D=block_d,
        enable_fp_fusion=True,
    )  # fmt: skip
    mask_t, mask_kind, ms = _mask_args(mask, q)
    # The backward only needs to know whether S was rounded (paper_repro): plain and stabilized
    # share their backward kernels.
    bwd_mode = MODE_PAPER if mode in PAPER_MODES else MODE_PLAIN
    dq = torch.empty_like(q)
    if group == 1:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    else:  # one fp32 slice per query head, summed over each group below
        dk = torch.empty((b, h, tk, d), device=q.device, dtype=torch.float32)
        dv = torch.empty_like(dk)
    qkv_ints = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    sizes = (h, group, tq, tk, d)
    common = (q.dtype, dk.dtype, bwd_mode, causal, block_d, _mask_key(mask_t, mask_kind))
    cfg = tile_config("dkdv", block_d, causal)
    bm, bn = cfg.block_m, cfg.block_n
    ints = (*qkv_ints, *dk.stride()[:3], *dv.stride()[:3], *ms, *sizes)
    _launch_dkdv(
        (*common, cfg, ints), (cdiv(tk, cfg.block_n), b * h),
        _tiles(q, bm, block_d), _tiles(k, bn, block_d), _tiles(v, bn, block_d),
        _tiles(do, bm, block_d), _tiles(dk, bn, block_d), _tiles(dv, bn, block_d),
        lse, delta, mask_t, *ints, sm_scale,
        MODE=bwd_mode, MASK_KIND=mask_kind, CAUSAL=causal,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        EVEN_Q=tq % cfg.block_m == 0, INTERPRET=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True,
    )  # fmt: skip
    cfg = tile_config("dq", block_d, causal)
    bm, bn = cfg.block_m, cfg.block_n
    ints = (*qkv_ints, *dq.stride()[:3], *ms, *sizes)
    _launch_dq(
        (*common, cfg, ints), (cdiv(tq, cfg.block_m), b * h),
        _tiles(q, bm, block_d), _tiles(k, bn, block_d), _tiles(v, bn, block_d),
        _tiles(do, bm, block_d), _tiles(dq, bm, block_d), lse, delta, mask_t, *ints, sm_scale,
        MODE=bwd_mode, MASK_KIND=mask_kind, CAUSAL=causal,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, INTERPRET=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True,
    )  # fmt: skip
    if group != 1:
        dk = dk.view(b, hk, group, tk, d).sum(2).to(k.dtype)
        dv = dv.view(b, hk, group, tk, d).sum(2).to(v.dtype)
    return dq, dk, dv
