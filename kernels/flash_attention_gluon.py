"""Hopper forward of numwatch's flash attention in Gluon, warp-specialized like FlashAttention 3.

Why a second forward: Triton's ``tl.dot`` waits for each wgmma where it is issued, so the
Triton forward (flash_attention_triton) runs a key block's softmax and its two matrix products
one after the other, and its warpgroups run in step: the tensor cores idle while the ALU works.
Gluon exposes what Triton hides: asynchronous wgmma with explicit waits, mbarriers and warp
specialization. Here a program works on row blocks of 128 query rows, in two consumer
warpgroups of 64 rows and one producer warpgroup that streams Q, K and V through TMA into a
ring of ``NUM_STAGES`` slots. The consumers take turns to issue their wgmma (FA3's ping-pong,
on the ``turns`` mbarriers), so one's softmax runs while the tensor cores work for the other;
within a consumer, block j's softmax also overlaps the P̄V product of block j-1, and the row
sum of the rounded P̄ runs on the tensor cores against a ones tile, as in the Triton forward's
ROWSUM_MMA.

Programs are persistent up to 4096 keys: one per SM (a program's shared memory leaves room for
no second), each looping over work units, so that the next row block's Q and first K/V blocks
load while this one ends, where a program per row block starts with an empty ring. A causal
unit is two row blocks of one head, the n-1-i-th and the i-th, so that units hold equal work.
Q sits in registers (loaded once per row block), which frees the Q buffer for the next row
block at once and leaves ptxas the uniform registers the K, V and ones descriptors need. On the
H200 (bench/results/flash_attention_gluon_qreg_explore_h200.json, one process) persistent
programs are up to 10 % faster than one program per row block at T 1k-4k, but 1-3 % slower at
16k, where one program per row block is kept (``GluonConfig.persistent_max_t_k``). Against the
previous kernel (Q in shared memory, persistent in the plain mode only;
flash_attention_gluon_qreg_h200.json): stabilized +1 to +9 % at T 1k-4k, equal at 16k; plain
-2 to +4 %; outputs and LSEs bitwise equal.

It computes what the Triton forward computes in the plain and stabilized modes: same logits,
the same stabilizing count and bounded shift, O normalized by the sum of the rounded P̄, the
same LSE (bitwise equal outputs where both use the same key-block size; measured on the H200).
It serves the calls it is fastest for (bench/results/flash_attention_h200.json): head dim 128,
and head dim 64 in the plain mode and in the stabilized one from 8192 keys on; bf16/fp16, no
``attn_mask`` (causal or not, any lengths, GQA), on Hopper. Every other call runs
the Triton kernel; flash_attention.py chooses. Gluon has no interpreter: the kernel is tested
on the GPU (tests/kernels/test_flash_attention_gluon.py, against the Triton forward and a
float64 reference); on CPU the tests compile it to sm_90 code.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .flash_attention_torch import LOG2E, MODE_PLAIN, MODE_STABILIZED
from .flash_attention_triton import capability_major, stabilization_args
from .launch import Relauncher, cdiv, direct_constructor

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # A CTA-wide (or, inside a warp-specialized partition, a partition-wide) barrier: triton
    # 3.6 calls it thread_barrier, later versions barrier.
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # TMA copies: async_copy_* in triton 3.6, async_load/async_store in later versions (3.9).
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    AVAILABLE = True
except (ImportError, AttributeError):  # a Triton without (this) Gluon Hopper API: the Triton
    AVAILABLE = False  # forward serves every call


class GluonConfig(NamedTuple):
    """Launch parameters: keys per block, ring slots, registers per consumer/producer thread,
    and up to how many keys programs are persistent (one per SM, each looping over work units;
    causal units pair a long row block with a short one); longer calls, and every call when 0,
    run one program per row block."""

    block_n: int
    num_stages: int
    consumer_regs: int = 240
    producer_regs: int = 24
    persistent_max_t_k: int = 4096
    stabilized_min_t_k: int = 0  # shorter stabilized calls run the Triton forward


# Per head dim, on the H200. D 128: 128-key blocks in 2 slots beat 64-key blocks in 2 or 3 slots
# by 10-13 % (bench/results/flash_attention_gluon_h200.json, the sweep at T 4096).
# D 64: until session 18 this kernel lost to the Triton forward there
# (flash_attention_gluon_d64_rejected_h200.json). With Q in registers and packed P̄ it is 4-8 %
# faster in the plain mode (5 of 6 shapes, even at T 1k causal) and, stabilized, 3-7 % faster at
# T 16k, even at T 4k and 11 % slower at T 1k causal
# (flash_attention_gluon_d64_qreg_explore_h200.json): the stabilized mode takes it from 8192
# keys on. 3 ring slots fit at D 64 and measured -1 to +2 % against 2.
DEFAULT_CONFIGS = {128: GluonConfig(128, 2), 64: GluonConfig(128, 3, stabilized_min_t_k=8192)}
CONFIG_OVERRIDES: dict[tuple[int, bool], GluonConfig] = {}  # per (head dim, causal)
# NUMWATCH_FLASH_GLUON=0 sends every call to the Triton forward (A/B runs, or a Triton whose
# Gluon misbehaves); the benchmark flips ENABLED to time both in one process.
ENABLED = os.environ.get("NUMWATCH_FLASH_GLUON", "1") != "0"
# Why the kernel was switched off at run time (see disable), or None.
DISABLED_BY: str | None = None


def disable(error: BaseException) -> None:
    """Switch the kernel off for this process after it failed (Gluon is experimental: another
    Triton may not compile it). The Triton forward serves every call from then on; the
    failure is warned about once and kept in DISABLED_BY."""
    global ENABLED, DISABLED_BY
    ENABLED = False
    DISABLED_BY = f"{type(error).__name__}: {str(error)[:500]}"
    warnings.warn(
        f"numwatch: the Gluon flash-attention forward failed ({DISABLED_BY}); the Triton "
        "forward serves every call from now on",
        RuntimeWarning,
        stacklevel=3,
    )


def config(d: int, causal: bool) -> GluonConfig:
    """The launch parameters for head dim d (one of DEFAULT_CONFIGS') and causality."""
    return CONFIG_OVERRIDES.get((d, causal)) or DEFAULT_CONFIGS[d]


def supports(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, mode: int, causal: bool) -> bool:
    """Whether this kernel serves a call the Triton forward would run (plain or stabilized
    mode; the inputs are descriptor-ready). Reads shapes, dtypes and devices only."""
    return (
        AVAILABLE
        and ENABLED
        and mask is None
        and mode in (MODE_PLAIN, MODE_STABILIZED)
        and q.shape[-1] in DEFAULT_CONFIGS
        and (mode == MODE_PLAIN or k.shape[2] >= config(q.shape[-1], causal).stabilized_min_t_k)
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.is_cuda
        and capability_major(q.device) == 9
    )


if AVAILABLE:
    # Columns of the ones tile that takes the row sum of P̄ (8, wgmma's least N, gave wrong sums
    # with 128-key blocks on triton 3.6; 16 are right).
    ROWSUM_N = gl.constexpr(16)
    # Register layout of that row sum (a warpgroup's 64 rows by ROWSUM_N columns)
    ROWSUM_LAYOUT = gl.constexpr(
        gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWSUM_N.value, 16]
        )
    )

    # Reductions through gl.reduce with our own combine functions: gl.max/gl.sum are triton.jit
    # helpers, which the CPU tests' TRITON_INTERPRET=1 turns into interpreter functions that a
    # compiled Gluon kernel cannot call (the reductions are the same).

    @gluon.jit
    def _max_op(a, b):
        return gl.maximum(a, b)

    @gluon.jit
    def _add_op(a, b):
        return a + b

    @gluon.jit
    def _to_lo(p, dtype: gl.constexpr):
        """P̄ rounded to dtype, one cvt per pair of values (round to nearest even, as
        ``p.to(dtype)``). From scalar cvts ptxas packed the pairs in the opposite order in the
        worker partition and swapped every register's halves back: 32 PRMT per key block in
        the second consumer's loop, 3-5 % of the stabilized forward
        (bench/results/flash_attention_gluon_packed_cvt_h200.json)."""
        if dtype == gl.bfloat16:
            out = gl.inline_asm_elementwise(
                "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16,
                is_pure=True, pack=2,
            )  # fmt: skip
        else:
            out = gl.inline_asm_elementwise(
                "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.float16,
                is_pure=True, pack=2,
            )  # fmt: skip
        return out

    @gluon.jit
    def _softmax_block(
        s, n0, m0, m_raw, m_sh, cnt, T_K, qk_scale, beta_m1, dmin2, dmax2,
        SAT2: gl.constexpr, STABILIZE: gl.constexpr, CAUSAL: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
        full_hi,
    ):  # fmt: skip
        """One key block's online-softmax step on raw products s (BLOCK_M, BLOCK_N) fp32, as
        flash_attention_triton._fwd_block: returns P̄ (fp32), alpha, and the new row state."""
        if n0 >= full_hi:  # the causal diagonal or the tail past T_K
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            valid = gl.expand_dims(cols < T_K, 0)
            if CAUSAL:
                rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                valid = valid & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
            s = gl.where(valid, s, float("-inf"))
        m_raw_new = gl.maximum(m_raw, gl.reduce(s, 1, _max_op) * qk_scale)  # log2 units
        if STABILIZE:
            thr = m_raw_new + SAT2
            hit = gl.where(s >= gl.expand_dims(thr / qk_scale, 1), 1.0, 0.0)
            cnt = gl.where(m_raw >= thr, cnt, 0.0) + gl.reduce(hit, 1, _add_op)
            extra = gl.where(m_raw_new > 0, beta_m1 * m_raw_new, -m_raw_new)
            extra = gl.minimum(gl.maximum(extra, dmin2), dmax2)
            m_new = gl.maximum(m_sh, gl.where(cnt >= 2, m_raw_new + extra, m_raw_new))
        else:
            m_new = gl.maximum(m_sh, m_raw_new)
        alpha = gl.exp2(m_sh - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        return p, alpha, m_raw_new, m_new, cnt

    @gluon.jit
    def _unit_rows(u, units_per_head, n_row_blocks, PAIRED: gl.constexpr):
        """Work unit u: its (batch x head) index, its first row block and how many it holds.

        Row blocks go longest first. PAIRED (causal): a unit is row block n-1-i, then row block
        i, so that every unit of a head holds about the same number of key blocks."""
        i = u % units_per_head
        first = n_row_blocks - 1 - i
        count = 1
        if PAIRED:
            count = gl.minimum(first - i + 1, 2)
        return u // units_per_head, first, count, i

    @gluon.jit
    def _unit_part_start(first, i, part, BLOCK_M: gl.constexpr):
        """First query row of part ``part`` of a unit: its first row block, then row block i."""
        return (first - part * (first - i)) * BLOCK_M

    @gluon.jit
    def _row_block_span(m0, T_K, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr):  # fmt: skip
        """Key blocks of the row block at m0, and where the causal diagonal or tail starts."""
        hi = T_K
        full_hi = (T_K // BLOCK_N) * BLOCK_N
        if CAUSAL:
            hi = gl.minimum(T_K, m0 + BLOCK_M)
            full_hi = gl.minimum(full_hi, m0)
        return (hi + BLOCK_N - 1) // BLOCK_N, full_hi

    @gluon.jit
    def _produce_row_block(
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full,
        k_empty, v_empty, bh, H, GROUP, m0, T_K, kv, r,
        CAUSAL: gl.constexpr, BLOCK_WG: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr,
    ):  # fmt: skip
        """Q's two 64-row halves (each once its consumer is done with the last row block's),
        then K and V block by block into the ring: a slot is refilled once both consumers have
        arrived on its ``*_empty`` barrier (count 2), and each load completes its ``*_full``
        barrier (TMA transaction bytes). kv key blocks and r row blocks came before this one
        in the program: the ring's slots and phases carry on from them."""
        b = bh // H
        h = bh % H
        hk = h // GROUP
        n_blocks, _ = _row_block_span(m0, T_K, CAUSAL, 2 * BLOCK_WG, BLOCK_N)
        for w in gl.static_range(2):
            mbarrier.wait(q_empty.index(w), (r + 1) & 1, pred=r > 0)
            mbarrier.expect(q_full.index(w), q_desc.block_type.nbytes)
            _tma_load(q_desc, [b, h, m0 + w * BLOCK_WG, 0], q_full.index(w), q_smem.index(w))
        for j in range(n_blocks):
            g = kv + j
            slot = g % NUM_STAGES
            use = g // NUM_STAGES
            mbarrier.wait(k_empty.index(slot), (use + 1) & 1, pred=g >= NUM_STAGES)
            mbarrier.expect(k_full.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [b, hk, j * BLOCK_N, 0], k_full.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), (use + 1) & 1, pred=g >= NUM_STAGES)
            mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [b, hk, j * BLOCK_N, 0], v_full.index(slot), v_smem.index(slot))
        return n_blocks

    @gluon.jit
    def _ws_producer(
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full,
        k_empty, v_empty, H, GROUP, T_K, n_units, units_per_head, n_row_blocks,
        CAUSAL: gl.constexpr, PAIRED: gl.constexpr, PERSISTENT: gl.constexpr,
        BLOCK_WG: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):  # fmt: skip
        """The loads of the program's row blocks, in the consumers' order."""
        if PERSISTENT:
            kv = 0  # key blocks loaded by this program
            r = 0  # row blocks started by this program
            for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
                bh, first, count, i = _unit_rows(u, units_per_head, n_row_blocks, PAIRED)
                for part in range(count):
                    m0 = _unit_part_start(first, i, part, 2 * BLOCK_WG)
                    kv += _produce_row_block(
                        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty,
                        k_full, v_full, k_empty, v_empty, bh, H, GROUP, m0, T_K, kv, r,
                        CAUSAL, BLOCK_WG, BLOCK_N, NUM_STAGES,
                    )  # fmt: skip
                    r += 1
        else:
            bh, first, _, _ = _unit_rows(gl.program_id(0), units_per_head, n_row_blocks, False)
            _produce_row_block(
                q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full,
                v_full, k_empty, v_empty, bh, H, GROUP, first * (2 * BLOCK_WG), T_K, 0, 0,
                CAUSAL, BLOCK_WG, BLOCK_N, NUM_STAGES,
            )  # fmt: skip

    @gluon.jit
    def _consume_row_block(
        WG: gl.constexpr, o_desc, LSE, q_smem, o_smem, k_smem, v_smem, ones_smem, q_full,
        q_empty, k_full, v_full, k_empty, v_empty, turns, bh, H, m0, T_Q, T_K, kv, r,
        qk_scale, beta_m1, dmin2, dmax2,
        SAT2: gl.constexpr, STABILIZE: gl.constexpr, CAUSAL: gl.constexpr,
        PERSISTENT: gl.constexpr, BLOCK_WG: gl.constexpr, BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):  # fmt: skip
        """64 query rows (warpgroup WG of 2) of the row block at m0: the online softmax over
        all key blocks, O and the LSE. The two warpgroups take turns to issue their wgmma
        (``turns``), so one's softmax runs while the tensor cores work for the other (FA3's
        ping-pong). kv key blocks and r row blocks (kv + r turns) came before this one."""
        dtype: gl.constexpr = o_desc.dtype
        RN: gl.constexpr = ROWSUM_N
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        l_layout: gl.constexpr = ROWSUM_LAYOUT
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        pl_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        row_l: gl.constexpr = gl.SliceLayout(1, l_layout)
        ones = ones_smem.index(WG)
        q2 = q_smem.index(WG).reshape([BLOCK_WG, HEAD_DIM])
        o4 = o_smem.index(WG)
        n_blocks, full_hi = _row_block_span(m0, T_K, CAUSAL, 2 * BLOCK_WG, BLOCK_N)
        r0 = m0 + WG * BLOCK_WG

        m_raw = gl.full([BLOCK_WG], float("-inf"), gl.float32, layout=row_s)
        m_sh = gl.full([BLOCK_WG], float("-inf"), gl.float32, layout=row_s)
        cnt = gl.full([BLOCK_WG], 0.0, gl.float32, layout=row_s)
        acc = gl.full([BLOCK_WG, HEAD_DIM], 0.0, gl.float32, layout=o_layout)
        l_acc = gl.full([BLOCK_WG, RN], 0.0, gl.float32, layout=l_layout)
        s_zero = gl.full([BLOCK_WG, BLOCK_N], 0.0, gl.float32, layout=s_layout)
        mbarrier.wait(q_full.index(WG), r & 1)
        # Q from registers: the QK^T wgmma then needs no shared-memory descriptors for it, which
        # leaves ptxas enough uniform registers for the K, V and ones descriptors (with Q in
        # shared memory it shuttled them through regular registers: 14 R2UR per key block).
        q_op = q2.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        if PERSISTENT:  # Q is in registers: the next row block's Q may load
            mbarrier.arrive(q_empty.index(WG))

        # Key block 0
        slot = kv % NUM_STAGES
        mbarrier.wait(k_full.index(slot), (kv // NUM_STAGES) & 1)
        k_t = k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
        mbarrier.wait(turns.index(WG), (kv + r) & 1)
        s = warpgroup_mma(q_op, k_t, s_zero, use_acc=False, is_async=True)
        mbarrier.arrive(turns.index(1 - WG))
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(slot))
        p, alpha, m_raw, m_sh, cnt = _softmax_block(
            s, 0, r0, m_raw, m_sh, cnt, T_K, qk_scale, beta_m1, dmin2, dmax2,
            SAT2, STABILIZE, CAUSAL, BLOCK_WG, BLOCK_N, s_layout, full_hi,
        )  # fmt: skip
        p_lo = _to_lo(p, dtype)

        for j in range(1, n_blocks):
            g = kv + j
            slot = g % NUM_STAGES
            prev = (g - 1) % NUM_STAGES
            mbarrier.wait(k_full.index(slot), (g // NUM_STAGES) & 1)
            mbarrier.wait(v_full.index(prev), ((g - 1) // NUM_STAGES) & 1)
            k_t = k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
            v_t = v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM])
            p_op = gl.convert_layout(p_lo, p_layout)
            p_l = gl.convert_layout(p_lo, pl_layout)
            mbarrier.wait(turns.index(WG), (g + r) & 1)
            s = warpgroup_mma(q_op, k_t, s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_t, acc, is_async=True)
            l_acc = warpgroup_mma(p_l, ones, l_acc, is_async=True)
            mbarrier.arrive(turns.index(1 - WG))
            s = warpgroup_mma_wait(2, deps=(s,))
            mbarrier.arrive(k_empty.index(slot))
            p, alpha, m_raw, m_sh, cnt = _softmax_block(
                s, j * BLOCK_N, r0, m_raw, m_sh, cnt, T_K, qk_scale, beta_m1, dmin2, dmax2,
                SAT2, STABILIZE, CAUSAL, BLOCK_WG, BLOCK_N, s_layout, full_hi,
            )  # fmt: skip
            acc, l_acc, p_op, p_l = warpgroup_mma_wait(0, deps=(acc, l_acc, p_op, p_l))
            mbarrier.arrive(v_empty.index(prev))
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            l_acc = l_acc * gl.expand_dims(gl.convert_layout(alpha, row_l), 1)
            p_lo = _to_lo(p, dtype)

        g = kv + n_blocks - 1
        last = g % NUM_STAGES
        mbarrier.wait(v_full.index(last), (g // NUM_STAGES) & 1)
        v_t = v_smem.index(last).reshape([BLOCK_N, HEAD_DIM])
        mbarrier.wait(turns.index(WG), (g + 1 + r) & 1)
        acc = warpgroup_mma(gl.convert_layout(p_lo, p_layout), v_t, acc, is_async=True)
        l_acc = warpgroup_mma(gl.convert_layout(p_lo, pl_layout), ones, l_acc, is_async=True)
        mbarrier.arrive(turns.index(1 - WG))
        acc, l_acc = warpgroup_mma_wait(0, deps=(acc, l_acc))
        mbarrier.arrive(v_empty.index(last))

        l_r = gl.convert_layout(gl.reduce(l_acc, 1, _max_op), row_l)
        inv = gl.div_rn(gl.full([BLOCK_WG], 1.0, gl.float32, layout=row_l), l_r)
        o = acc * gl.expand_dims(gl.convert_layout(inv, row_o), 1)
        if PERSISTENT:
            tma.store_wait(0)  # the previous row block's O has left o4
        o4.reshape([BLOCK_WG, HEAD_DIM]).store(o.to(dtype))
        fence_async_shared()
        _barrier()
        _tma_store(o_desc, [bh // H, bh % H, r0, 0], o4)
        lse = gl.convert_layout(m_sh, row_l) + gl.log2(l_r)
        offs = r0 + gl.arange(0, BLOCK_WG, layout=row_l)
        gl.store(LSE + bh.to(gl.int64) * T_Q + offs, lse, mask=offs < T_Q)
        return n_blocks

    @gluon.jit
    def _ws_consumer(
        WG: gl.constexpr, o_desc, LSE, q_smem, o_smem, k_smem, v_smem, ones_smem, q_full,
        q_empty, k_full, v_full, k_empty, v_empty, turns, H, T_Q, T_K, n_units,
        units_per_head, n_row_blocks, qk_scale, beta_m1, dmin2, dmax2,
        SAT2: gl.constexpr, STABILIZE: gl.constexpr, CAUSAL: gl.constexpr,
        PAIRED: gl.constexpr, PERSISTENT: gl.constexpr, BLOCK_WG: gl.constexpr,
        BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):  # fmt: skip
        """Warpgroup WG's 64 rows of each of the program's row blocks."""
        ones_smem.index(WG).store(gl.full([BLOCK_N, ROWSUM_N], 1.0, o_desc.dtype, ROWSUM_LAYOUT))
        fence_async_shared()
        _barrier()
        if PERSISTENT:
            kv = 0  # key blocks consumed by this program
            r = 0  # row blocks done
            for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
                bh, first, count, i = _unit_rows(u, units_per_head, n_row_blocks, PAIRED)
                for part in range(count):
                    m0 = _unit_part_start(first, i, part, 2 * BLOCK_WG)
                    kv += _consume_row_block(
                        WG, o_desc, LSE, q_smem, o_smem, k_smem, v_smem, ones_smem, q_full,
                        q_empty, k_full, v_full, k_empty, v_empty, turns, bh, H, m0, T_Q, T_K,
                        kv, r, qk_scale, beta_m1, dmin2, dmax2, SAT2, STABILIZE, CAUSAL,
                        PERSISTENT, BLOCK_WG, BLOCK_N, HEAD_DIM, NUM_STAGES,
                    )  # fmt: skip
                    r += 1
        else:
            bh, first, _, _ = _unit_rows(gl.program_id(0), units_per_head, n_row_blocks, False)
            _consume_row_block(
                WG, o_desc, LSE, q_smem, o_smem, k_smem, v_smem, ones_smem, q_full, q_empty,
                k_full, v_full, k_empty, v_empty, turns, bh, H, first * (2 * BLOCK_WG), T_Q,
                T_K, 0, 0, qk_scale, beta_m1, dmin2, dmax2, SAT2, STABILIZE, CAUSAL,
                PERSISTENT, BLOCK_WG, BLOCK_N, HEAD_DIM, NUM_STAGES,
            )  # fmt: skip
        tma.store_wait(0)

    @gluon.jit(do_not_specialize=["H", "GROUP", "T_Q", "T_K", "n_units", "units_per_head"])
    def _fwd_ws_kernel(
        q_desc, k_desc, v_desc, o_desc, LSE,
        H, GROUP, T_Q, T_K, n_units, units_per_head, qk_scale, beta_m1, dmin2, dmax2,
        SAT2: gl.constexpr, STABILIZE: gl.constexpr, CAUSAL: gl.constexpr,
        PAIRED: gl.constexpr, PERSISTENT: gl.constexpr, BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
    ):  # fmt: skip
        """Work units of 128 query rows (two when PAIRED), one per program or, PERSISTENT, a
        grid of programs that loops over them: two consumer warpgroups of 64 rows (the default
        partition and a worker) and a producer warpgroup that streams Q, K and V by TMA."""
        dtype: gl.constexpr = q_desc.dtype
        BLOCK_WG: gl.constexpr = 64
        n_row_blocks = (T_Q + 2 * BLOCK_WG - 1) // (2 * BLOCK_WG)

        q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_WG, HEAD_DIM], q_desc.layout)
        if PERSISTENT:  # O staged apart from Q, so that the next Q loads during this block's end
            o_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_WG, HEAD_DIM], o_desc.layout)
        else:
            o_smem = q_smem
        k_smem = gl.allocate_shared_memory(
            dtype, [NUM_STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout
        )
        v_smem = gl.allocate_shared_memory(
            dtype, [NUM_STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout
        )
        ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROWSUM_N], dtype)
        ones_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROWSUM_N], ones_layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        q_full = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        k_full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        v_full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        for i in gl.static_range(2):
            mbarrier.init(q_full.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)
            mbarrier.init(turns.index(i), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        mbarrier.arrive(turns.index(0))  # warpgroup 0 issues first
        fence_async_shared()

        gl.warp_specialize(
            [
                (_ws_consumer, (0, o_desc, LSE, q_smem, o_smem, k_smem, v_smem, ones_smem,
                 q_full, q_empty, k_full, v_full, k_empty, v_empty, turns, H, T_Q, T_K,
                 n_units, units_per_head, n_row_blocks, qk_scale, beta_m1, dmin2, dmax2, SAT2,
                 STABILIZE, CAUSAL, PAIRED, PERSISTENT, BLOCK_WG, BLOCK_N, HEAD_DIM,
                 NUM_STAGES)),
                (_ws_consumer, (1, o_desc, LSE, q_smem, o_smem, k_smem, v_smem, ones_smem,
                 q_full, q_empty, k_full, v_full, k_empty, v_empty, turns, H, T_Q, T_K,
                 n_units, units_per_head, n_row_blocks, qk_scale, beta_m1, dmin2, dmax2, SAT2,
                 STABILIZE, CAUSAL, PAIRED, PERSISTENT, BLOCK_WG, BLOCK_N, HEAD_DIM,
                 NUM_STAGES)),
                (
                    _ws_producer,
                    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full,
                     v_full, k_empty, v_empty, H, GROUP, T_K, n_units, units_per_head,
                     n_row_blocks, CAUSAL, PAIRED, PERSISTENT, BLOCK_WG, BLOCK_N, NUM_STAGES),
                ),
            ],
            [4, 4],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16} if AVAILABLE else {}


@functools.cache
def _smem_layout(block_t: int, d: int, dtype: torch.dtype) -> Any:
    return gl.NVMMASharedLayout.get_default_for([1, 1, block_t, d], _GL_DTYPES[dtype])


# TensorDescriptor without its checks (launch.direct_constructor), as flash_attention_triton's
_make_desc = (
    direct_constructor(
        TensorDescriptor, ("base", "shape", "strides", "block_shape", "layout", "padding")
    )
    if AVAILABLE
    else None
)


def _desc(x: Tensor, block_t: int) -> TensorDescriptor:
    """A (1, 1, block_t, D)-tile TMA descriptor of x (its inputs passed descriptor_ready: see
    ``supports``)."""
    d = x.shape[-1]
    return _make_desc(
        base=x, shape=list(x.shape), strides=list(x.stride()), block_shape=[1, 1, block_t, d],
        layout=_smem_layout(block_t, d, x.dtype), padding="zero",
    )  # fmt: skip


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# Calls after a key's first skip JITFunction.run (launch.Relauncher), like the Triton forward's.
_launch = Relauncher(_fwd_ws_kernel) if AVAILABLE else None


def gluon_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    sm_scale: float,
    mode: int,
    beta: float,
) -> tuple[Tensor, Tensor]:
    """triton_forward's call without a mask (``supports`` says which calls): O like q and the
    row log2-sum-exp (B, H, Tq) fp32."""
    b, h, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    cfg = config(d, causal)
    o = torch.empty_like(q)
    lse = torch.empty((b, h, tq), device=q.device, dtype=torch.float32)
    beta_m1, dmin2, dmax2, sat2 = stabilization_args(q.dtype, beta)
    persistent = tk <= cfg.persistent_max_t_k
    row_blocks = cdiv(tq, 128)
    paired = causal and persistent
    units_per_head = cdiv(row_blocks, 2) if paired else row_blocks
    n_units = b * h * units_per_head
    # persistent: one program per SM (a program's shared memory and registers fit no second)
    grid = (min(n_units, _sm_count(q.device)) if persistent else n_units,)
    # The key holds all a launch specializes on (dtypes, constexprs, the descriptors' blocks),
    # and every shape and stride besides, as the Triton forward's does (o = empty_like(q): its
    # strides follow q's).
    key = (q.dtype, sat2, mode, causal, cfg, q.shape, q.stride(), k.shape, k.stride(),
           v.stride())  # fmt: skip
    _launch(
        key, grid, _desc(q, 64), _desc(k, cfg.block_n), _desc(v, cfg.block_n), _desc(o, 64),
        lse, h, h // hk, tq, tk, n_units, units_per_head, sm_scale * LOG2E, beta_m1, dmin2,
        dmax2, SAT2=sat2, STABILIZE=mode == MODE_STABILIZED, CAUSAL=causal, PAIRED=paired,
        PERSISTENT=persistent, BLOCK_N=cfg.block_n, HEAD_DIM=d, NUM_STAGES=cfg.num_stages,
        CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs, num_warps=4,
        enable_fp_fusion=True,
    )  # fmt: skip
    return o, lse
