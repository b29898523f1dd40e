"""Pure-torch blockwise flash attention: the CPU path and the oracle of the Triton kernels.

It runs the same algorithm as ``flash_attention_triton`` (online softmax over key blocks, P̄
rounded to the input dtype before the P̄V product, fp32 accumulators, the saturation-count
stabilization and the ``paper_repro`` emulation), vectorized over batch, heads and query rows,
with one Python iteration per key block. The constants below define the stabilization for both
paths; the reasoning behind them is in ``numwatch.kernels.flash_attention``'s docstring.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG2E = 1.4426950408889634
# Additive mask values at or below MASK_SWAMPS (Hugging Face writes finfo(dtype).min of fp32 or
# bf16) swamp any score in SDPA's fp32 sum: S + M == M, so a row masked whole that way is uniform
# there (O = mean of V), where M log2(e) would overflow to -inf here and empty the row. Such
# entries take the one logit SWAMPED_LOGIT instead, whatever the score: the row stays uniform,
# and low enough for its key to vanish beside any score in the kernel's range (|S| <= 1e4), yet
# small enough in log2 units (-2^15) for the row's LSE to keep log2(row sum) (an LSE of -1e38
# would lose it, and the backward's P with it). -inf stays -inf: a key that is really masked.
MASK_SWAMPS = -(2.0**100)
SWAMPED_LOGIT = -(2.0**15) * math.log(2.0)

# Modes as the kernels see them (a constexpr in Triton): bit 0 is the stabilizing shift, bit 1
# the paper's rounding of S, P̄V, O and the row sum to the input dtype, bit 2 the split sum
# (MODE_SPLIT, plain and stabilized only).
MODE_PLAIN = 0
MODE_STABILIZED = 1
MODE_PAPER = 2
MODE_PAPER_STABILIZED = 3  # the paper's rounding with the stabilizing shift
MODE_SPLIT = 4
PAPER_MODES = (MODE_PAPER, MODE_PAPER_STABILIZED)
STABILIZED_MODES = (MODE_STABILIZED, MODE_PAPER_STABILIZED, MODE_STABILIZED | MODE_SPLIT)

# The split sum (MODE_SPLIT): P̄V and the row sum accumulate in two parts, the entries within
# 2^-SPLIT_LOG2 of the row's raw maximum and the rest, added together once at the end. With one
# accumulator, a few dominant entries (attention sinks, ties) make every other key's P̄V term
# about an fp32 ulp of it, all alike, and round-to-nearest (or the tensor cores' truncation)
# swamps them one way: a one-signed error the stabilizing shift cannot remove.
SPLIT_LOG2 = 8.0

# exp(S - m) rounds to exactly 1.0 in the P dtype once S >= m + SATURATION_LN[dtype]:
# bf16 keeps 8 significand bits (1 - 2^-9 is the rounding midpoint below 1.0), fp16 keeps 11.
SATURATION_LN = {
    torch.bfloat16: math.log1p(-(2.0**-9)),
    torch.float16: math.log1p(-(2.0**-12)),
}
# Bounds of the extra shift (natural-log units) applied to a row with >= 2 saturated entries.
# The lower bound takes every P̄ clearly off 1.0 even when beta*m is close to m (m near 0);
# the upper bound keeps the dominant P̄ = exp(-shift) far from underflow: fp16 subnormals start
# at e^-9.7, so its cap is lower to keep the rest of the row in the normal range.
SHIFT_MIN_LN = 1.0 / 64.0
SHIFT_MAX_LN = {torch.bfloat16: 8.0, torch.float16: 2.0}

# Key-block width of the reference loop (the stabilization decision does not depend on it
# except through the conservative cross-block count, see the flash_attention docstring).
REF_BLOCK_N = 64


def _round(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Round fp32 values to ``dtype`` (round-to-nearest-even) and return them as fp32."""
    return x.to(dtype).to(torch.float32)


def _block_logits(
    qf: Tensor,
    kb: Tensor,
    mask_b: Tensor | None,
    causal_b: Tensor | None,
    sm_scale: float,
    mode: int,
    dtype: torch.dtype,
) -> Tensor:
    """Logits of one key block in log2 units, masked entries at -inf.  # (B, H, Tq, bn) fp32"""
    s = qf @ kb.transpose(-1, -2)  # (B, H, Tq, bn) fp32: exact products of bf16/fp16 inputs
    additive = mask_b is not None and mask_b.dtype != torch.bool
    if additive:
        add = mask_b.float()
        swamped = (add <= MASK_SWAMPS) & (add != float("-inf"))
    if mode in PAPER_MODES:
        # The paper's kernel holds S in the input dtype.
        s = s * sm_scale
        if additive:
            s = torch.where(swamped, SWAMPED_LOGIT, s + add)
        s2 = _round(s, dtype) * LOG2E
    else:
        s2 = s * (sm_scale * LOG2E)
        if additive:
            s2 = torch.where(swamped, SWAMPED_LOGIT * LOG2E, s2 + add * LOG2E)
    if mask_b is not None and mask_b.dtype == torch.bool:
        s2 = s2.masked_fill(~mask_b, float("-inf"))
    if causal_b is not None:
        s2 = s2.masked_fill(~causal_b, float("-inf"))
    return s2


def _expand_kv(x: Tensor, heads: int) -> Tensor:
    """Repeat K/V heads for grouped-query attention.  # (B, H, Tk, D)"""
    group = heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def stabilized_shift(
    s2: Tensor, m_raw: Tensor, m_sh: Tensor, count: Tensor, dtype: torch.dtype, beta: float
) -> tuple[Tensor, Tensor, Tensor]:
    """One key block of the stabilization rule (all in log2 units, rows on the last-but-one dim).

    s2 (..., bn): the block's logits; m_raw, m_sh, count (...): running raw max, running shift
    and saturated-entry count from the earlier blocks. Returns the updated (m_raw, m_sh, count):
    a row whose count reaches 2 gets the shift m + clamp(paper's extra shift, bounds).
    """
    m_raw_new = torch.maximum(m_raw, s2.amax(-1))
    thr = m_raw_new + SATURATION_LN[dtype] * LOG2E  # exp2(s - m) rounds to 1.0 above this
    saturated = (s2 >= thr[..., None]).sum(-1, dtype=torch.int32)
    count = torch.where(m_raw >= thr, count, 0) + saturated
    extra = torch.where(m_raw_new > 0, (beta - 1.0) * m_raw_new, -m_raw_new)
    extra = extra.clamp(SHIFT_MIN_LN * LOG2E, SHIFT_MAX_LN[dtype] * LOG2E)
    target = torch.where(count >= 2, m_raw_new + extra, m_raw_new)
    return m_raw_new, torch.maximum(m_sh, target), count


def reference_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    sm_scale: float,
    mode: int,
    beta: float,
) -> tuple[Tensor, Tensor]:
    """Blockwise forward. Returns O (q's dtype) and the log2-sum-exp per row (fp32, (B,H,Tq))."""
    dtype = q.dtype
    b, h, tq, _ = q.shape
    tk = k.shape[2]
    qf = q.float()
    kf, vf = _expand_kv(k, h).float(), _expand_kv(v, h).float()
    mask = None if attn_mask is None else attn_mask.expand(b, h, tq, tk)
    causal = None
    if is_causal:  # SDPA's is_causal: top-left aligned lower triangle
        causal = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril()

    neg_inf = torch.full((b, h, tq), float("-inf"), device=q.device)
    m_raw, m_sh = neg_inf, neg_inf  # running raw max and running shift (log2 units)
    count = torch.zeros((b, h, tq), dtype=torch.int32, device=q.device)
    l_round = torch.zeros((b, h, tq), device=q.device)  # sum of the rounded P̄: normalizes O
    l_exact = torch.zeros((b, h, tq), device=q.device)  # sum of the fp32 P̄: the paper mode's LSE
    acc = torch.zeros_like(qf)  # (B, H, Tq, D) fp32
    acc_far, l_far = torch.zeros_like(acc), torch.zeros_like(l_round)  # MODE_SPLIT's far part
    m_use = torch.zeros_like(neg_inf)
    for n0 in range(0, tk, REF_BLOCK_N):
        n1 = min(n0 + REF_BLOCK_N, tk)
        s2 = _block_logits(
            qf,
            kf[:, :, n0:n1],
            None if mask is None else mask[..., n0:n1],
            None if causal is None else causal[:, n0:n1],
            sm_scale,
            mode,
            dtype,
        )
        if mode in STABILIZED_MODES:
            m_raw, m_new, count = stabilized_shift(s2, m_raw, m_sh, count, dtype, beta)
        else:
            m_raw = torch.maximum(m_raw, s2.amax(-1))  # (B, H, Tq)
            m_new = torch.maximum(m_sh, m_raw)
        m_use = torch.where(torch.isneginf(m_new), 0.0, m_new)  # rows with nothing visible yet
        alpha = torch.exp2(m_sh - m_use)
        p = torch.exp2(s2 - m_use[..., None])  # (B, H, Tq, bn) fp32
        p_lo = _round(p, dtype)  # what the P̄V product sees
        if mode & MODE_SPLIT:
            near = s2 >= (m_raw - SPLIT_LOG2)[..., None]
            p_far = torch.where(near, 0.0, p_lo)
            acc_far = acc_far * alpha[..., None] + p_far @ vf[:, :, n0:n1]
            l_far = l_far * alpha + p_far.sum(-1)
            p_lo = p_lo - p_far
        pv = p_lo @ vf[:, :, n0:n1]
        if mode in PAPER_MODES:
            # P̄V product, O accumulation and row sum rounded to the input dtype per block.
            alpha_r = _round(alpha, dtype)
            acc = _round(_round(acc * alpha_r[..., None], dtype) + _round(pv, dtype), dtype)
            l_round = _round(_round(l_round * alpha_r, dtype) + _round(p_lo.sum(-1), dtype), dtype)
        else:
            acc = acc * alpha[..., None] + pv
            l_round = l_round * alpha + p_lo.sum(-1)
        if mode in PAPER_MODES:
            l_exact = l_exact * alpha + p.sum(-1)
        m_sh = m_new
    if mode & MODE_SPLIT:
        acc, l_round = acc + acc_far, l_round + l_far
    o = acc / torch.where(l_round > 0, l_round, 1.0)[..., None]
    # The LSE from the sum that normalizes O, so the backward's P sums to the forward's weights
    # (the paper mode's rounded sum would add its rounding to the gradient: the fp32 sum there).
    l_lse = l_exact if mode in PAPER_MODES else l_round
    lse2 = torch.where(l_lse > 0, m_use + torch.log2(l_lse.clamp_min(1e-38)), float("inf"))
    return o.to(dtype), lse2


def reference_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse2: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    sm_scale: float,
    mode: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Blockwise backward from the row LSE: the exact softmax gradient, with P and dS rounded
    to the input dtype where the kernel rounds them for its dots."""
    dtype = q.dtype
    b, h, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    qf, dof = q.float(), do.float()
    kf, vf = _expand_kv(k, h).float(), _expand_kv(v, h).float()
    mask = None if attn_mask is None else attn_mask.expand(b, h, tq, tk)
    causal = None
    if is_causal:
        causal = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril()
    delta = (dof * o.float()).sum(-1)  # (B, H, Tq) fp32
    dq = torch.zeros_like(qf)
    dk = torch.zeros((b, h, tk, d), device=q.device)
    dv = torch.zeros((b, h, tk, d), device=q.device)
    for n0 in range(0, tk, REF_BLOCK_N):
        n1 = min(n0 + REF_BLOCK_N, tk)
        kb, vb = kf[:, :, n0:n1], vf[:, :, n0:n1]
        s2 = _block_logits(
            qf,
            kb,
            None if mask is None else mask[..., n0:n1],
            None if causal is None else causal[:, n0:n1],
            sm_scale,
            mode,
            dtype,
        )
        p = torch.exp2(s2 - lse2[..., None])  # (B, H, Tq, bn) fp32, exact softmax
        dv[:, :, n0:n1] = _round(p, dtype).transpose(-1, -2) @ dof
        dp = dof @ vb.transpose(-1, -2)
        ds = _round(p * (dp - delta[..., None]), dtype)
        dq += ds @ kb
        dk[:, :, n0:n1] = ds.transpose(-1, -2) @ qf
    dq, dk = dq * sm_scale, dk * sm_scale
    if hk != h:  # grouped-query attention: sum the gradients of the heads sharing a K/V head
        dk = dk.view(b, hk, h // hk, tk, d).sum(2)
        dv = dv.view(b, hk, h // hk, tk, d).sum(2)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)
