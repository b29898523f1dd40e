"""Per-head attention statistics: repeated row maxima, softmax saturation, logits, entropy, and
the signed error of an attention output.

Why these numbers: a softmax row whose maximum is attained more than once (or whose top entries
all round to P̄ = exp(S - rowmax) = 1.0 in the kernel's P dtype) is where the one-signed rounding
error of low-precision flash attention starts (arXiv 2510.04212, DESIGN.md §1);
``attention_output_error`` then measures whether the user's own kernel makes that error.

Definitions shared by both implementations (the Triton kernel and the chunked torch reference):

- ``S = scale * (Q K^T)``: the product is accumulated in fp32 from the actual input values
  (bf16/fp16 products are exact in fp32; fp32 inputs use exact fp32 products, never TF32), then
  multiplied by ``scale`` in fp32; an additive ``attn_mask`` is added in fp32 after that.
- An entry is masked when the boolean mask is False, the causal (top-left aligned, ``j <= i``)
  mask removes it, or the additive mask holds ``-inf`` or ``finfo(mask.dtype).min`` (the value
  Hugging Face eager attention uses for "masked"). Masked entries are excluded from everything;
  rows with no unmasked entry are excluded from everything, ``ROWS`` included.
- A row's maximum is *repeated* when ``S == rowmax`` holds for two or more entries (exact fp32
  equality). An entry is *saturated* when ``fp32(S - rowmax) >= threshold``, with the threshold
  an fp32 constant: ``log1p(-2^-9)`` for bf16 (every P̄ >= 1 - 2^-9 rounds to 1.0 in bf16),
  ``log1p(-2^-12)`` for fp16, and 0 for fp32 (exact ties). A row is saturated when it has two or
  more saturated entries; ``SATURATED_ENTRIES`` sums the saturated entries of saturated rows only.
- Entropy is the natural-log entropy of the softmax row, computed as ``log(l) - u / l`` with
  ``l = sum exp(S - m)`` and ``u = sum exp(S - m) (S - m)``, so masked entries never make NaN.
- The statistics assume finite scores; non-finite inputs are the tensor probe's business.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from .launch import cdiv, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only platforms without triton use the torch path
    triton = None
    tl = None

__all__ = [
    "ENTROPY_MIN",
    "ENTROPY_SUM",
    "ERR_ABS_SUM",
    "ERR_COUNT",
    "ERR_EXCESS_COHERENT_SUM",
    "ERR_SQ_SUM",
    "ERR_STAT_NAMES",
    "ERR_SUM",
    "HEAD_MAX_COLUMNS",
    "HEAD_MIN_COLUMNS",
    "HEAD_STAT_NAMES",
    "MAX_LOGIT",
    "MIN_LOGIT",
    "N_ERR_STATS",
    "N_HEAD_STATS",
    "REPEATED_MAX_ROWS",
    "ROWS",
    "SATURATED_ENTRIES",
    "SATURATED_ROWS",
    "TIE_ENTRIES",
    "ScoreModify",
    "attention_head_stats",
    "attention_output_error",
    "merge_head_rows",
    "output_error_in_one_launch",
    "saturation_threshold",
    "score_head_stats",
]

# Columns of attention_head_stats / score_head_stats: (Hq, N_HEAD_STATS) float64.
ROWS = 0  # rows counted: sampled and not fully masked
REPEATED_MAX_ROWS = 1  # rows whose maximum is attained at least twice (exact fp32 equality)
TIE_ENTRIES = 2  # sum over rows of count(S == rowmax)
SATURATED_ROWS = 3  # rows with >= 2 entries whose exp(S - rowmax) rounds to 1 in the P dtype
SATURATED_ENTRIES = 4  # those entries, summed over saturated rows only
MAX_LOGIT = 5  # max unmasked S (-inf when no rows)
MIN_LOGIT = 6  # min unmasked S (+inf when no rows)
ENTROPY_SUM = 7  # sum over rows of the softmax row's entropy (0 when entropy=False)
ENTROPY_MIN = 8  # min over rows of that entropy (+inf when no rows or entropy=False)
N_HEAD_STATS = 9
HEAD_STAT_NAMES = (
    "rows",
    "repeated_max_rows",
    "tie_entries",
    "saturated_rows",
    "saturated_entries",
    "max_logit",
    "min_logit",
    "entropy_sum",
    "entropy_min",
)
# How rows of several calls, row blocks, steps or ranks merge: these by max, these by min, the
# rest add.
HEAD_MAX_COLUMNS = (MAX_LOGIT,)
HEAD_MIN_COLUMNS = (MIN_LOGIT, ENTROPY_MIN)

# Columns of attention_output_error: (Hq, N_ERR_STATS) float64, err = out - O_ref.
ERR_SUM = 0
ERR_ABS_SUM = 1
ERR_SQ_SUM = 2
ERR_COUNT = 3
# sum over output dims of |sum over rows of excess|, excess = out - O_ref rounded to out's dtype:
# the error beyond correct rounding that keeps one sign per dim across rows. Correct rounding
# alone leaves none (rows that share one output value share its rounding error, in every
# kernel), and a systematic error whose sign differs between dims (V of mixed signs) cancels in
# ERR_SUM but not here.
ERR_EXCESS_COHERENT_SUM = 4
N_ERR_STATS = 5
ERR_STAT_NAMES = (
    "err_sum", "err_abs_sum", "err_sq_sum", "err_count", "err_excess_coherent_sum"
)  # fmt: skip

# Bytes of temporaries per score entry in the chunked torch paths (S, exp, products, masks).
_TORCH_BYTES_PER_ENTRY = 32
_DEFAULT_MEMORY_BUDGET = 256 * 2**20
# Peak bytes per fp32 score entry of the one-piece output error (S and its softmax, with room
# for one more temporary): a GPT-2 layer's sampled call (12 x 1024 x 1024) fits the budget.
_WHOLE_BYTES_PER_ENTRY = 16


def _fp32(x: float) -> float:
    """x rounded to the nearest fp32 value (the thresholds are fp32 constants in both paths)."""
    return float(torch.tensor(x, dtype=torch.float32))


_SATURATION_THRESHOLDS = {
    torch.bfloat16: _fp32(math.log1p(-(2.0**-9))),
    torch.float16: _fp32(math.log1p(-(2.0**-12))),
    torch.float32: 0.0,
}


def saturation_threshold(dtype: torch.dtype) -> float:
    """fp32 threshold t such that exp(S - rowmax) rounds to 1.0 in ``dtype`` iff S - rowmax >= t."""
    if dtype not in _SATURATION_THRESHOLDS:
        raise ValueError(
            f"saturation_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}"
        )
    return _SATURATION_THRESHOLDS[dtype]


# --------------------------------------------------------------------------------------------
# Argument checks and normalisation (shape-level only: nothing here reads tensor data)
# --------------------------------------------------------------------------------------------


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"q and k must be 4-D (B, H, T, D) like SDPA's, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    B, Hq, Tq, D = q.shape
    Bk, Hkv, Tk, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim")
    if D == 0:  # no score is defined: the default scale 1/sqrt(D) is not, and SDPA's would be NaN
        raise ValueError(f"the head dim of q and k must be >= 1, got {tuple(q.shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q's {Hq} heads are not a multiple of k's {Hkv} heads (GQA/MQA)")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k.dtype != q.dtype:
        raise ValueError(f"q and k must share a dtype in bf16/fp16/fp32, got {q.dtype}, {k.dtype}")
    return B, Hq, Tq, D, Hkv, Tk


def _check_mask(attn_mask: torch.Tensor | None, shape: tuple[int, int, int, int]) -> None:
    """``shape`` is (B, Hq, Tq, Tk): the torch path indexes the un-broadcast mask chunk by chunk,
    where a mask that does not broadcast would fail late and obscurely (or not at all)."""
    if attn_mask is None:
        return
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ValueError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    try:
        fits = torch.broadcast_shapes(attn_mask.shape, shape) == shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"attn_mask {tuple(attn_mask.shape)} does not broadcast to (B, Hq, Tq, Tk) = {shape}"
        )


def _fold_causal(
    attn_mask: torch.Tensor | None, is_causal: bool, Tq: int, Tk: int
) -> tuple[torch.Tensor | None, bool]:
    """A mask together with ``is_causal`` (SDPA's CPU path takes both: they apply together) as
    one mask with the causal entries masked. It holds (Tq, Tk) entries per broadcast index of
    the mask: a rare call's memory, where the kernels keep one mask path."""
    if attn_mask is None or not is_causal:
        return attn_mask, is_causal
    keep = torch.ones(Tq, Tk, dtype=torch.bool, device=attn_mask.device).tril()
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep, False
    return attn_mask.masked_fill(~keep, float("-inf")), False


def _check_index(name: str, idx: torch.Tensor | None, n: int) -> None:
    """Sampled indices must lie in [0, n). On the host that is checked here, for a clear error;
    on a device it would cost a host sync, so the implementations skip the indices out of range
    instead (their rows count as not sampled)."""
    if idx is None:
        return
    if idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{name} must be a 1-D int64 or int32 tensor, got {idx.dtype} {tuple(idx.shape)}"
        )
    if idx.device.type == "cpu":
        bad = idx[(idx < 0) | (idx >= n)]
        if bad.numel():
            raise ValueError(f"{name} indices must lie in [0, {n}), got {bad[:8].tolist()}")


ADDITIVE_MASKED = -5000.0  # additive-mask values at or below this mask their entry


def _mask_floor(mask: torch.Tensor) -> float:
    """Additive-mask values at or below this are 'masked': -inf, finfo.min and the finite
    fills in use (-1e9, -10000, bf16's -9984) alike, as their softmax weight is 0 in every
    dtype. Only finfo.min was: padding rows filled with -1e9 counted as rows of tied maxima
    (and swapped kernels). A bias above it (ALiBi's, T5's) is part of the logit."""
    return ADDITIVE_MASKED


def _resolve_scale(scale: float | None, D: int) -> float:
    return 1.0 / math.sqrt(D) if scale is None else float(scale)


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "torch":
        return "torch"
    usable = triton is not None and (device.type == "cuda" or _interpreting())
    if backend == "triton" and not usable:
        raise ValueError(
            f"backend='triton' needs triton and a CUDA tensor (or TRITON_INTERPRET=1), "
            f"got a {device.type} tensor; use backend='torch'"
        )
    return "triton" if usable else "torch"


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@contextlib.contextmanager
def _exact_fp32_matmul(device: torch.device) -> Iterator[None]:
    """fp32 matmuls as written: no TF32 (a user's allow_tf32 would put 1e-3 errors into the
    oracle) and no autocast (the probe runs inside the user's bf16 autocast forward, which
    would otherwise run these "fp32" products in bf16)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


# --------------------------------------------------------------------------------------------
# Chunked torch implementation: CPU path and test oracle of the kernel
# --------------------------------------------------------------------------------------------


def _row_chunks(n_rows: int, entries_per_row: int, budget: int) -> Iterator[slice]:
    """Slices of at most budget / (bytes per row) rows."""
    per_row = max(1, entries_per_row * _TORCH_BYTES_PER_ENTRY)
    step = max(1, min(n_rows, budget // per_row))
    for r0 in range(0, n_rows, step):
        yield slice(r0, r0 + step)


def _scores_rows_stats(
    s: torch.Tensor, valid: torch.Tensor, thr: float, entropy: bool
) -> tuple[torch.Tensor, ...]:
    """Per-row stats of an fp32 score block s (..., r, Tk) with its unmasked entries `valid`."""
    s = s.masked_fill(~valid, float("-inf"))
    mx = s.amax(-1)  # (..., r)
    row_ok = mx != float("-inf")
    m_safe = torch.where(row_ok, mx, torch.zeros_like(mx))
    d = s - m_safe.unsqueeze(-1)  # fp32, -inf where masked
    ties = (s == mx.unsqueeze(-1)).sum(-1)
    sat = (d >= thr).sum(-1)
    mn = s.masked_fill(~valid, float("inf")).amin(-1)
    if entropy:
        e = torch.exp(d)  # 0 where masked
        lsum = e.sum(-1)
        usum = (e * d.clamp_min(-1e30)).sum(-1)  # clamp: 0 * -inf would be NaN
        ent = (torch.log(lsum) - usum / lsum).clamp_min(0.0)
    else:
        ent = None
    return row_ok, ties, sat, mx, mn, ent


def _reduce_head_rows(
    row_ok: torch.Tensor,
    ties: torch.Tensor,
    sat: torch.Tensor,
    mx: torch.Tensor,
    mn: torch.Tensor,
    ent: torch.Tensor | None,
) -> torch.Tensor:
    """(Hq, r) per-row stats -> (Hq, N_HEAD_STATS) float64 partial."""
    f64 = torch.float64
    sat_rows = row_ok & (sat >= 2)
    inf = float("inf")  # a Python scalar: a device tensor built from it would cost a copy
    cols = [
        row_ok.sum(-1, dtype=f64),
        (row_ok & (ties >= 2)).sum(-1, dtype=f64),
        torch.where(row_ok, ties, 0).sum(-1, dtype=f64),
        sat_rows.sum(-1, dtype=f64),
        torch.where(sat_rows, sat, 0).sum(-1, dtype=f64),
        torch.where(row_ok, mx.to(f64), -inf).amax(-1),
        torch.where(row_ok, mn.to(f64), inf).amin(-1),
    ]
    if ent is None:
        cols += [torch.zeros_like(cols[0]), torch.full_like(cols[0], float("inf"))]
    else:
        e64 = ent.to(f64)
        cols += [torch.where(row_ok, e64, 0.0).sum(-1), torch.where(row_ok, e64, inf).amin(-1)]
    return torch.stack(cols, -1)


def merge_head_rows(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """Merge head-statistic rows (last dim N_HEAD_STATS) along ``dim``: HEAD_MAX_COLUMNS by
    max, HEAD_MIN_COLUMNS by min, the rest by sum. Column by column: a list index would be a
    CPU index tensor, copied to the device at each use."""
    out = rows.sum(dim)
    for c in HEAD_MAX_COLUMNS:
        out[..., c] = rows[..., c].amax(dim)
    for c in HEAD_MIN_COLUMNS:
        out[..., c] = rows[..., c].amin(dim)
    return out


def _merge_head_partials(acc: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    return part if acc is None else merge_head_rows(torch.stack([acc, part]), 0)


def _empty_head_stats(Hq: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(Hq, N_HEAD_STATS, dtype=torch.float64, device=device)
    for c in HEAD_MAX_COLUMNS:
        out[:, c] = float("-inf")
    for c in HEAD_MIN_COLUMNS:
        out[:, c] = float("inf")
    return out


def _clamped(
    idx: torch.Tensor | None, n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled indices (all of range(n) for None) clamped into [0, n), n >= 1, and which were
    in range: out-of-range device indices gather index 0 and count as not sampled, like the
    kernel's, since checking them would cost a host sync."""
    if idx is None:
        return torch.arange(n, device=device), torch.ones(n, dtype=torch.bool, device=device)
    idx = idx.to(device=device, dtype=torch.int64)
    return idx.clamp(0, n - 1), (idx >= 0) & (idx < n)


def _sampled(
    batch: torch.Tensor | None, rows: torch.Tensor | None, B: int, Tq: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clamped batch and row indices, and which (batch, row) pairs are sampled: (nb, nr)."""
    (b_idx, b_ok), (r_idx, r_ok) = _clamped(batch, B, device), _clamped(rows, Tq, device)
    return b_idx, r_idx, b_ok[:, None] & r_ok[None, :]


def _as_4d(attn_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The user's mask with leading size-1 dims: chunks index it before broadcasting."""
    if attn_mask is None:
        return None
    return attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))


def _chunk_validity(
    mask4: torch.Tensor | None,
    is_causal: bool,
    b1: torch.Tensor,
    r: torch.Tensor,
    sampled: torch.Tensor,
    Hq: int,
    Tk: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Hq, rc, Tk) unmasked entries and the additive mask values (or None) of one chunk;
    rows not ``sampled`` (out-of-range indices) are fully masked.

    Only the chunk is materialized: indexing happens on the un-broadcast mask.
    """
    rc = r.numel()
    valid = sampled.view(1, rc, 1)
    add = None
    if is_causal:
        cols = torch.arange(Tk, device=r.device)
        valid = valid & (cols[None, :] <= r[:, None]).unsqueeze(0)  # (1, rc, Tk)
    if mask4 is not None:
        mb = mask4 if mask4.shape[0] == 1 else mask4.index_select(0, b1)
        mb = mb if mb.shape[2] == 1 else mb.index_select(2, r)
        mb = mb.broadcast_to(1, Hq, rc, Tk)[0]
        if mb.dtype == torch.bool:
            valid = valid & mb
        else:
            valid = valid & (mb > _mask_floor(mb))
            add = mb.to(torch.float32)
    return valid.expand(Hq, rc, Tk), add


# What the softmax takes in place of a chunk's scores: ``attention_head_stats``'s ``modify``.
ScoreModify = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _head_stats_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    mask4: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    rows: torch.Tensor | None,
    batch: torch.Tensor | None,
    thr: float,
    entropy: bool,
    memory_budget: int,
    modify: ScoreModify | None = None,
) -> torch.Tensor:
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if 0 in (B, Tq, Tk):  # no row has an unmasked entry
        return _empty_head_stats(Hq, q.device)
    g = Hq // Hkv
    b_idx, r_idx, sampled = _sampled(batch, rows, B, Tq, q.device)
    acc = None
    with _exact_fp32_matmul(q.device):
        for bi in range(b_idx.numel()):
            b1 = b_idx[bi : bi + 1]
            qb = q.index_select(0, b1)[0]  # (Hq, Tq, D)
            kb = k.index_select(0, b1)[0].to(torch.float32)  # (Hkv, Tk, D)
            for sl in _row_chunks(r_idx.numel(), Hq * Tk, memory_budget):
                r = r_idx[sl]
                rc = r.numel()
                qc = qb.index_select(1, r).to(torch.float32).view(Hkv, g * rc, D)
                s = (qc @ kb.transpose(1, 2)).view(Hq, rc, Tk) * scale  # fp32
                valid, add = _chunk_validity(mask4, is_causal, b1, r, sampled[bi, sl], Hq, Tk)
                if add is not None:
                    s = s + add
                if modify is not None:
                    s = modify(s, b1, r)
                    valid = valid & (s != float("-inf"))
                part = _reduce_head_rows(*_scores_rows_stats(s, valid, thr, entropy))
                acc = _merge_head_partials(acc, part)
    return _empty_head_stats(Hq, q.device) if acc is None else acc


EAGER_MASKED = -65000.0  # softmax inputs at or below this are masked (score_head_stats)
EAGER_MASKED_FP16 = -32768.0  # the same for fp16 inputs: finfo(fp16).min + logits <= 32736


def score_head_stats(
    scores: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    batch: torch.Tensor | None = None,
    saturation_dtype: torch.dtype = torch.bfloat16,
    entropy: bool = True,
    memory_budget: int = _DEFAULT_MEMORY_BUDGET,
) -> torch.Tensor:
    """Per-head stats of materialized softmax inputs (eager attention), same columns as
    ``attention_head_stats``, whose rules for ``rows`` and ``batch`` apply.

    ``scores`` is the (B, H, Tq, Tk) tensor handed to softmax, mask already added: entries at
    or below a floor count as masked, ``-inf`` and every dtype's finfo.min included. The mask
    value no longer reads as finfo.min once a score was added to it (Hugging Face eager adds
    finfo(fp16).min = -65504 to fp16 scores: a logit s leaves -65504 + s), or once bf16/fp16
    scores masked with their own minimum are upcast for an fp32 softmax (MPT, XLM).
    - fp16 inputs: ``EAGER_MASKED_FP16`` (-32768). Masked entries stay masked for logits up to
      32736 (-65504 + 32736 = -32768), beyond the logits the rules watch; a real fp16 logit at
      or below -32768 counts as masked.
    - Other dtypes: ``EAGER_MASKED`` (-65000), under fp16's minimum upcast and far above the
      bf16/fp32 mask (-3.4e38 + s stays there), so real logits down to -65000 count. An fp16
      mask added to fp32 scores reads as masked for logits up to 504 only.
    Old-style -10000 masks are not recognized: with a score added they overlap real logits.
    Chunked over rows.
    """
    if scores.dim() != 4 or not scores.is_floating_point():
        raise ValueError(
            f"scores must be 4-D (B, H, Tq, Tk) floating point, got {scores.dtype} "
            f"{tuple(scores.shape)}"
        )
    B, H, Tq, Tk = scores.shape
    _check_index("batch", batch, B)
    _check_index("rows", rows, Tq)
    thr = saturation_threshold(saturation_dtype)
    if 0 in (B, Tq, Tk):  # no row has an unmasked entry
        return _empty_head_stats(H, scores.device)
    floor = EAGER_MASKED_FP16 if scores.dtype == torch.float16 else EAGER_MASKED
    b_idx, r_idx, sampled = _sampled(batch, rows, B, Tq, scores.device)
    acc = None
    for bi in range(b_idx.numel()):
        sb = scores.index_select(0, b_idx[bi : bi + 1])[0]  # (H, Tq, Tk)
        for sl in _row_chunks(r_idx.numel(), H * Tk, memory_budget):
            s = sb.index_select(1, r_idx[sl]).to(torch.float32)  # (H, rc, Tk)
            valid = (s > floor) & sampled[bi, sl, None]
            part = _reduce_head_rows(*_scores_rows_stats(s, valid, thr, entropy))
            acc = _merge_head_partials(acc, part)
    return _empty_head_stats(H, scores.device) if acc is None else acc


# --------------------------------------------------------------------------------------------
# Triton kernel: QK^T tile by tile, online per-row merge, per-row-block partials
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _mul_rn(a, b, ASM: tl.constexpr):
        """a * b rounded once: never contracted into an FMA with what follows (S is fp32)."""
        if ASM:
            return tl.inline_asm_elementwise(
                "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
            )
        return a * b

    @triton.jit
    def _scores_tile(
        q, k_ptrs, mask_ptrs, cols, qrow, d_ok, Tk, scale, inv_unit, mask_floor,
        MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, EDGE: tl.constexpr,
        EVEN_D: tl.constexpr, MUL_SCALE: tl.constexpr, UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One (BLOCK_M, BLOCK_N) tile of S in loop units: (-inf, +inf) where masked.

        Loop units: S itself, or S / scale when scale is a power of two (then QK^T needs no
        multiply: scaling by 2^k commutes with fp32 rounding). EDGE: bounds and causal checks.
        """
        if EDGE:
            col_ok = cols < Tk
            if EVEN_D:
                k = tl.load(k_ptrs, mask=col_ok[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 tl.dot is wrong (DESIGN.md §3)
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MUL_SCALE:
            s = _mul_rn(s, scale, not UPCAST)
        if MASK_KIND == 1:
            mv = tl.load(mask_ptrs, mask=col_ok[None, :], other=0) if EDGE else tl.load(mask_ptrs)
            keep = mv != 0
        elif MASK_KIND == 2:
            if EDGE:
                mv = tl.load(mask_ptrs, mask=col_ok[None, :], other=float("-inf"))
            else:
                mv = tl.load(mask_ptrs)
            mv = mv.to(tl.float32)
            keep = mv > mask_floor
            s = s + mv * inv_unit  # exact product: inv_unit is 1 or a power of two
        if EDGE and MASK_KIND == 0:  # masks load "masked" past Tk and never come with causal
            keep = col_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= qrow[:, None])
        if EDGE or MASK_KIND != 0:
            # -inf for the max and counts, +inf for the min
            return tl.where(keep, s, float("-inf")), tl.where(keep, s, float("inf"))
        return s, s

    @triton.jit
    def _count_ge(s, bound, ASM: tl.constexpr):
        """Per-row count of s >= bound[:, None], in fp32 (exact below 2^24).

        On GPUs one `set.ge.f32` per entry (a 1.0/0.0 result) plus an FADD, where a
        compare-and-select would take two ALU-pipe instructions.
        """
        b = tl.broadcast_to(bound[:, None], s.shape)
        if ASM:
            hit = tl.inline_asm_elementwise(
                "set.ge.f32.f32 $0, $1, $2;", "=r,r,r", [s, b], dtype=tl.float32, is_pure=True,
                pack=1,
            )  # fmt: skip
        else:
            hit = tl.where(s >= b, 1.0, 0.0)
        return tl.sum(hit, 1)

    @triton.jit
    def _saturation_bound(m, thr):
        """Per row, the smallest fp32 x with fp32(x - m) >= thr, and where that is not certain.

        For |m| >= 2|thr| (or m == 0) the subtraction x - m is exact near the boundary
        (Sterbenz), so the boundary is ceil_fp32(m + thr): c = fp32(m + thr) or the next float.
        Rows with 0 < |m| < 2|thr| are flagged: their count is redone entry by entry.
        """
        c = m + thr
        c_up = (c.to(tl.int32, bitcast=True) + tl.where(c >= 0.0, 1, -1)).to(
            tl.float32, bitcast=True
        )
        bound = tl.where(c - m >= thr, c, c_up)
        unsure = (tl.abs(m) < -2.0 * thr) & (m != 0.0)
        return bound, unsure

    @triton.jit
    def _merge_tile(
        s, s_min, m, t, c, dirty, mn, lsum, usum, thr, ent_coef,
        MASKED: tl.constexpr, ENTROPY: tl.constexpr, ASM: tl.constexpr,
    ):  # fmt: skip
        """Online per-row merge of one score tile into the running row state.

        t counts entries equal to the running max m; c counts entries with fp32(S - m) >= thr.
        When m grows, old saturated entries that were all ties at the old max are kept iff
        fp32(m_old - m_new) >= thr (exactly their own predicate); if the old window also held
        entries below the old max, which of them survive is unknowable here, so the row is
        marked dirty and recounted after the sweep. Otherwise they are all dropped (exact, as
        fp32 subtraction is monotone). Entropy: l = sum 2^arg, u = sum 2^arg arg with
        arg = (S - m) log2(e) (u in bits; the caller converts), both rescaled when m grows.
        """
        m_new = tl.maximum(m, tl.max(s, 1))
        valid = m_new > float("-inf")  # rows with something unmasked so far
        m_safe = tl.where(valid, m_new, 0.0)  # (their t and c restart when the max appears)
        bound, unsure = _saturation_bound(m_safe, thr)
        n_tie = _count_ge(s, m_safe, ASM)
        n_sat = _count_ge(s, bound, ASM)
        gap = m - m_safe  # 0 if the max did not grow, -inf before the first unmasked entry
        grew = m_new > m
        keep = gap >= thr
        dirty = dirty | (grew & keep & (c != t)) | (valid & unsure)
        c = tl.where(grew, tl.where(keep & (c == t), c, 0.0), c) + n_sat
        t = tl.where(grew, 0.0, t) + n_tie
        mn = tl.minimum(mn, tl.min(s_min, 1))
        if ENTROPY:
            arg = tl.fma(s, ent_coef, (-ent_coef * m_safe)[:, None])  # one FMA, no S - m
            e = tl.exp2(arg)
            if MASKED:
                arg = tl.maximum(arg, -1e30)  # masked: e * arg = 0 * -1e30, not 0 * -inf
            gap2 = tl.where(m == float("-inf"), 0.0, gap * ent_coef)
            alpha = tl.exp2(gap2)
            usum = alpha * (usum + gap2 * lsum) + tl.sum(e * arg, 1)
            lsum = alpha * lsum + tl.sum(e, 1)
        return m_new, t, c, dirty, mn, lsum, usum

    @triton.jit
    def _head_stats_kernel(
        Q, K, MASK, ROWS_IDX, BATCH_IDX, PART,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_mb, stride_mh, stride_mm, stride_mn,
        R, Tq, B, Tk, D, GROUP, PART_BLOCKS, scale, unit, thr, mask_floor,
        HAS_ROWS: tl.constexpr, HAS_BATCH: tl.constexpr, MASK_KIND: tl.constexpr,
        IS_CAUSAL: tl.constexpr, ENTROPY: tl.constexpr, MUL_SCALE: tl.constexpr,
        UPCAST: tl.constexpr, PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One program: BLOCK_M sampled query rows of one (batch, head); writes 9 partials.

        ``unit`` converts loop units to S (scale when MUL_SCALE is off, else 1); ``thr`` is in
        loop units. PART is (Bs, Hq, PART_BLOCKS, 9) whatever BLOCK_M the autotuner tries.
        Rows past R and sampled indices outside [0, Tq) or [0, B) are not counted; the loop's
        loads of K and the mask read batch element 0 and query row 0 for them, never past k or
        the mask.
        """
        pid_m = tl.program_id(0)
        n_blocks = tl.num_programs(0)
        if IS_CAUSAL:  # the longest rows first, for a balanced tail
            pid_m = n_blocks - 1 - pid_m
        h = tl.program_id(1).to(tl.int64)
        bi = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if HAS_BATCH:
            b = tl.load(BATCH_IDX + bi).to(tl.int64)
            b_ok = (b >= 0) & (b < B)
            row_ok = offs_m < tl.where(b_ok, R, 0)
            b = tl.where(b_ok, b, 0)
        else:
            b = bi.to(tl.int64)
            row_ok = offs_m < R
        if HAS_ROWS:
            qrow = tl.load(ROWS_IDX + offs_m, mask=offs_m < R, other=0).to(tl.int64)
            row_ok = row_ok & (qrow >= 0) & (qrow < Tq)
        else:
            qrow = offs_m.to(tl.int64)
        if MASK_KIND != 0:  # the mask is read at every row's qrow, counted or not
            qrow = tl.where(row_ok, qrow, 0)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        ent_coef = unit * 1.4426950408889634
        inv_unit = 1.0 / unit

        q_ptrs = Q + b * stride_qb + h * stride_qh
        q_ptrs += qrow[:, None] * stride_qm + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        k_ptrs = K + b * stride_kb + (h // GROUP) * stride_kh
        k_ptrs += offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        mask_ptrs = MASK + b * stride_mb + h * stride_mh
        mask_ptrs += qrow[:, None] * stride_mm + offs_n[None, :] * stride_mn

        # keys [0, full_end) are unmasked for every row of the block; [full_end, hi) need checks
        # (a causal block with no row counted sweeps no key: hi = 0)
        if IS_CAUSAL:
            hi = tl.minimum(tl.max(tl.where(row_ok, qrow + 1, 0)), Tk)
            full_end = tl.minimum(tl.min(tl.where(row_ok, qrow, Tk)) + 1, hi)
            full_end = (full_end // BLOCK_N) * BLOCK_N
        else:  # not for blocks without a counted row (rare): a reduction here costs 1-10 %
            hi = Tk
            full_end = (Tk // BLOCK_N) * BLOCK_N

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        # rows not counted start at mn = -inf: no predicate held across the loops (registers)
        mn = tl.where(row_ok, float("inf"), float("-inf"))
        t = tl.zeros([BLOCK_M], tl.float32)  # counts in fp32: exact up to 2^24 keys
        c = tl.zeros([BLOCK_M], tl.float32)
        dirty = tl.zeros([BLOCK_M], tl.int1)
        lsum = tl.zeros([BLOCK_M], tl.float32)
        usum = tl.zeros([BLOCK_M], tl.float32)
        for n0 in range(0, full_end, BLOCK_N):
            s, s_min = _scores_tile(
                q, k_ptrs + n0 * stride_kn, mask_ptrs + n0 * stride_mn, n0 + offs_n, qrow, d_ok,
                Tk, scale, inv_unit, mask_floor, MASK_KIND, IS_CAUSAL, False, EVEN_D, MUL_SCALE,
                UPCAST, PRECISION,
            )  # fmt: skip
            m, t, c, dirty, mn, lsum, usum = _merge_tile(
                s, s_min, m, t, c, dirty, mn, lsum, usum, thr, ent_coef, MASK_KIND != 0,
                ENTROPY, not UPCAST,
            )  # fmt: skip
        for n0 in range(full_end, hi, BLOCK_N):
            s, s_min = _scores_tile(
                q, k_ptrs + n0 * stride_kn, mask_ptrs + n0 * stride_mn, n0 + offs_n, qrow, d_ok,
                Tk, scale, inv_unit, mask_floor, MASK_KIND, IS_CAUSAL, True, EVEN_D, MUL_SCALE,
                UPCAST, PRECISION,
            )  # fmt: skip
            m, t, c, dirty, mn, lsum, usum = _merge_tile(
                s, s_min, m, t, c, dirty, mn, lsum, usum, thr, ent_coef, True, ENTROPY,
                not UPCAST,
            )  # fmt: skip

        # Rare: a row's max grew by less than |thr| over a window that held non-tied entries,
        # or its max is within 2|thr| of 0. Recount this block's saturated entries entry by
        # entry: one sweep for the max (recomputed, so the count is self-consistent), one to
        # count fp32(S - max) >= thr.
        if tl.max(dirty.to(tl.int32)) > 0:
            m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
            for n0 in range(0, hi, BLOCK_N):
                s, _ = _scores_tile(
                    q, k_ptrs + n0 * stride_kn, mask_ptrs + n0 * stride_mn, n0 + offs_n, qrow,
                    d_ok, Tk, scale, inv_unit, mask_floor, MASK_KIND, IS_CAUSAL, True, EVEN_D,
                    MUL_SCALE, UPCAST, PRECISION,
                )  # fmt: skip
                m2 = tl.maximum(m2, tl.max(s, 1))
            m2 = tl.where(m2 == float("-inf"), 0.0, m2)
            c2 = tl.zeros([BLOCK_M], tl.float32)
            for n0 in range(0, hi, BLOCK_N):
                s, _ = _scores_tile(
                    q, k_ptrs + n0 * stride_kn, mask_ptrs + n0 * stride_mn, n0 + offs_n, qrow,
                    d_ok, Tk, scale, inv_unit, mask_floor, MASK_KIND, IS_CAUSAL, True, EVEN_D,
                    MUL_SCALE, UPCAST, PRECISION,
                )  # fmt: skip
                c2 += tl.sum(tl.where(s - m2[:, None] >= thr, 1.0, 0.0), 1)
            c = tl.where(dirty, c2, c)

        ok = (m > float("-inf")) & (mn > float("-inf"))
        sat_row = ok & (c >= 2.0)
        p = PART + ((bi * tl.num_programs(1) + h) * PART_BLOCKS + pid_m) * 9
        tl.store(p + 0, tl.sum(ok.to(tl.float64)))
        tl.store(p + 1, tl.sum((ok & (t >= 2.0)).to(tl.float64)))
        tl.store(p + 2, tl.sum(tl.where(ok, t, 0.0).to(tl.float64)))
        tl.store(p + 3, tl.sum(sat_row.to(tl.float64)))
        tl.store(p + 4, tl.sum(tl.where(sat_row, c, 0.0).to(tl.float64)))
        # power-of-two unit: exact conversion back to S
        tl.store(p + 5, tl.max(tl.where(ok, m, float("-inf"))).to(tl.float64) * unit)
        tl.store(p + 6, tl.min(tl.where(ok, mn, float("inf"))).to(tl.float64) * unit)
        if ENTROPY:
            lsafe = tl.where(ok, lsum, 1.0)
            ent = tl.maximum(tl.log(lsafe) - 0.6931471805599453 * usum / lsafe, 0.0)
            tl.store(p + 7, tl.sum(tl.where(ok, ent, 0.0).to(tl.float64)))
            tl.store(p + 8, tl.min(tl.where(ok, ent, float("inf"))).to(tl.float64))
        else:
            tl.store(p + 7, tl.zeros([], tl.float64))
            tl.store(p + 8, tl.full([], float("inf"), tl.float64))

    @triton.jit
    def _round_nearest(x, dtype: tl.constexpr):
        """fp32 x rounded to ``dtype`` to nearest even, back in fp32. bf16 by bit arithmetic:
        the interpreter's bf16 conversion truncates, whatever rounding mode it is given."""
        if dtype == tl.float32:
            return x
        elif dtype == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            return b.to(tl.float32, bitcast=True)
        else:
            return x.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)

    @triton.jit
    def _output_error_kernel(
        Q, K, V, OUT, PART, PART_DIM,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        Tq, Tk, D, Dv, GROUP, scale,
        IS_CAUSAL: tl.constexpr, QK_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):  # fmt: skip
        """One program: O_ref of BLOCK_M query rows of one (batch, head) by an fp32 online
        softmax, compared with the kernel's output there; writes the rows' sums of err, |err|
        and err^2 (float64) to PART[b, h, block] and the per-dim sums of the excess over correct
        rounding (out - O_ref rounded to out's dtype) to PART_DIM[b, h, block].

        The products run on tensor cores at fp32 accuracy: QK^T in one TF32 pass when Q and K
        come from bf16/fp16 (their values are exact in TF32: exact products, fp32 sums), else
        in three (tf32x3, ~fp32); P V always in three, P being fp32."""
        pid_m = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        row_ok = offs_m < Tq
        q_ptrs = Q + b * stride_qb + h * stride_qh
        q_ptrs += offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d < D)[None, :], other=0.0)
        q = q.to(tl.float32)
        k_base = K + b * stride_kb + (h // GROUP) * stride_kh + offs_d[None, :] * stride_kd
        v_base = V + b * stride_vb + (h // GROUP) * stride_vh + offs_dv[None, :] * stride_vd
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        lsum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        hi = tl.minimum(Tk, (pid_m + 1) * BLOCK_M) if IS_CAUSAL else Tk
        for n0 in range(0, hi, BLOCK_N):
            cols = n0 + offs_n
            col_ok = cols < Tk
            k = tl.load(
                k_base + cols[:, None] * stride_kn,
                mask=col_ok[:, None] & (offs_d < D)[None, :],
                other=0.0,
            ).to(tl.float32)
            v = tl.load(
                v_base + cols[:, None] * stride_vn,
                mask=col_ok[:, None] & (offs_dv < Dv)[None, :],
                other=0.0,
            ).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=QK_PRECISION) * scale
            keep = col_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # finite: every row sees key 0
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            lsum = lsum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="tf32x3")
            m = m_new
        ref = acc / lsum[:, None]
        o_ptrs = OUT + b * stride_ob + h * stride_oh
        o_ptrs += offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
        ok = row_ok[:, None] & (offs_dv < Dv)[None, :]
        out = tl.load(o_ptrs, mask=ok, other=0.0).to(tl.float32)
        err = tl.where(ok, out - ref, 0.0).to(tl.float64)
        ref_rounded = _round_nearest(ref, OUT.dtype.element_ty)
        excess = tl.where(ok, out - ref_rounded, 0.0).to(tl.float64)
        block = (b * tl.num_programs(1) + h) * tl.num_programs(0) + pid_m
        part = PART + block * 3
        tl.store(part + 0, tl.sum(tl.sum(err, 1), 0))
        tl.store(part + 1, tl.sum(tl.sum(tl.abs(err), 1), 0))
        tl.store(part + 2, tl.sum(tl.sum(err * err, 1), 0))
        tl.store(PART_DIM + block * BLOCK_DV + offs_dv, tl.sum(excess, 0))

    def _gpu_configs() -> list[triton.Config]:
        return [triton.Config(**_launch_config(cf)) for cf in _TUNED_CONFIGS]

    def _prune(configs: list, named_args: dict, **kwargs) -> list:
        """Big head dims need narrower key tiles to stay in registers."""
        d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D", 128))
        keep = [cf for cf in configs if cf.kwargs["BLOCK_N"] * d <= 128 * 128]
        return keep or [min(configs, key=lambda cf: cf.kwargs["BLOCK_N"])]


# (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg]) tried by the autotuner on GPUs: the
# winners of bench/bench_attention_stats.py --sweep on the H200
# (bench/results/attention_stats.json).
_TUNED_CONFIGS = [
    (64, 128, 4, 2, 128),
    (64, 128, 4, 2),
    (64, 128, 4, 3),
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (128, 128, 8, 2, 128),
]
# Interpreter (CPU) tiles: small, so that tests cross several tiles per row.
_INTERPRET_CONFIG = (32, 32, 4, 1)
# Problems with fewer score entries than this skip autotuning (one compile, no tuning runs).
_AUTOTUNE_MIN_ENTRIES = 1 << 26
_SMALL_CONFIG = (64, 64, 4, 2)
# Exact fp32 products run on FMA units, not tensor cores: small tiles keep them in registers.
_FP32_CONFIG = (32, 32, 4, 2)


def _launch_config(cf: tuple) -> dict:
    """A config tuple as the kernel's constexprs (kwargs) plus launch options.

    An optional fifth field caps the registers per thread (``maxnreg``): fewer registers, more
    resident blocks per SM to overlap one block's QK^T with another's row statistics.
    """
    bm, bn, warps, stages, *cap = cf
    launch = {"kwargs": {"BLOCK_M": bm, "BLOCK_N": bn}, "num_warps": warps, "num_stages": stages}
    if cap and cap[0]:
        launch["maxnreg"] = cap[0]
    return launch


_tuned_kernel = None


def _autotuned():
    global _tuned_kernel
    if _tuned_kernel is None:
        _tuned_kernel = triton.autotune(
            configs=_gpu_configs(),
            key=["BLOCK_D", "MASK_KIND", "IS_CAUSAL", "ENTROPY", "HAS_ROWS", "MUL_SCALE"],
            prune_configs_by={"early_config_prune": _prune},
        )(_head_stats_kernel)
    return _tuned_kernel


def _is_power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


def _head_stats_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    rows: torch.Tensor | None,
    batch: torch.Tensor | None,
    thr: float,
    entropy: bool,
    config: dict | None = None,
) -> torch.Tensor:
    """Launch the kernel, then reduce its per-row-block partials per head in torch.

    ``mask`` is already broadcast to (B, Hq, Tq, Tk). ``config`` (a _TUNED_CONFIGS-style tuple)
    bypasses the autotuner (tuning sweeps).
    """
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    R = Tq if rows is None else rows.numel()
    Bs = B if batch is None else batch.numel()
    if 0 in (R, Bs, B, Tq, Tk):  # no row has an unmasked entry (and q has no row 0 to read)
        return _empty_head_stats(Hq, q.device)
    if scale < 0:  # S = |scale| * ((-Q) K^T) exactly: negation is exact in every dtype
        q, scale = -q, -scale
    interp = _interpreting()
    # power-of-two scale: the loop works on QK^T itself, converted exactly at the end
    unit = scale if _is_power_of_two(scale) else 1.0
    if mask is None:
        mask_arg, mask_kind, ms, floor = q, 0, (0, 0, 0, 0), 0.0
    elif mask.dtype == torch.bool:
        mask_arg, mask_kind, ms, floor = mask.view(torch.uint8), 1, mask.stride(), 0.0
    else:
        mask_arg, mask_kind, ms, floor = mask, 2, mask.stride(), _mask_floor(mask)
    block_d = max(16, next_power_of_2(D))
    args = dict(
        HAS_ROWS=rows is not None,
        HAS_BATCH=batch is not None,
        MASK_KIND=mask_kind,
        IS_CAUSAL=bool(is_causal),
        ENTROPY=bool(entropy),
        MUL_SCALE=unit == 1.0 and scale != 1.0,
        UPCAST=interp,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        EVEN_D=block_d == D,
        BLOCK_D=block_d,
    )
    if config is None:
        if interp:
            config = _INTERPRET_CONFIG
        elif q.dtype == torch.float32:
            config = _FP32_CONFIG
        elif Bs * Hq * R * Tk < _AUTOTUNE_MIN_ENTRIES:
            config = _SMALL_CONFIG
    kernel = _head_stats_kernel if config is not None else _autotuned()
    if config is not None:
        launch = _launch_config(config)
        args.update(launch.pop("kwargs"), **launch)

    def grid(meta: dict) -> tuple[int, int, int]:
        return (cdiv(R, meta["BLOCK_M"]), Hq, Bs)

    # every launched block writes its partials; room for the smallest BLOCK_M the tuner may pick
    min_bm = config[0] if config is not None else min(cf[0] for cf in _TUNED_CONFIGS)
    part = torch.empty((Bs, Hq, cdiv(R, min_bm), 9), dtype=torch.float64, device=q.device)
    rows_arg = q if rows is None else rows.to(device=q.device, dtype=torch.int64)
    batch_arg = q if batch is None else batch.to(device=q.device, dtype=torch.int64)
    kernel[grid](
        q, k, mask_arg, rows_arg, batch_arg, part,
        *q.stride(), *k.stride(), *ms,
        R, Tq, B, Tk, D, Hq // Hkv, part.shape[2], scale, unit, thr / unit, floor,
        enable_fp_fusion=True,  # S itself is multiplied with mul.rn: never contracted
        **args,
    )  # fmt: skip
    bm = config[0] if config is not None else kernel.best_config.kwargs["BLOCK_M"]
    return _reduce_partials(part, cdiv(R, bm))


def _reduce_partials(part: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """(Bs, Hq, nblk, 9) per-row-block partials -> (Hq, 9): a deterministic torch reduction."""
    Hq = part.shape[1]
    return merge_head_rows(part[:, :, :n_blocks].transpose(0, 1).reshape(Hq, -1, N_HEAD_STATS), 1)


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def attention_head_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    rows: torch.Tensor | None = None,
    batch: torch.Tensor | None = None,
    saturation_dtype: torch.dtype = torch.bfloat16,
    entropy: bool = True,
    backend: str = "auto",
    memory_budget: int = _DEFAULT_MEMORY_BUDGET,
    modify: ScoreModify | None = None,
) -> torch.Tensor:
    """Per-head softmax-input statistics of an SDPA call, as a (Hq, N_HEAD_STATS) float64
    device tensor (columns ROWS ... ENTROPY_MIN; definitions in the module docstring).

    Inputs use SDPA's layout and conventions: q (B, Hq, Tq, D), k (B, Hkv, Tk, D) with
    Hq % Hkv == 0 and D >= 1, ``attn_mask`` bool (True = keep) or additive, broadcastable to
    (B, Hq, Tq, Tk), ``is_causal`` top-left aligned (with a mask: both apply), ``scale``
    default 1/sqrt(D). ``rows`` and
    ``batch`` are optional 1-D LongTensors of query rows and batch elements to sample (best on
    q's device). Indices outside [0, Tq) or [0, B) raise ValueError when the index tensor is on
    the CPU; on a GPU, checking would cost a host sync, so they are skipped instead: not read,
    not counted. With no keys (Tk = 0), like with no rows, every row is fully masked: the
    result is the empty statistics (ROWS 0, MAX_LOGIT -inf, MIN_LOGIT +inf).
    ``saturation_dtype`` is the dtype the attention kernel rounds P̄ to.
    ``memory_budget`` bounds the torch path's temporaries (bytes). No host sync, except the
    Triton autotuner's timing runs at the first call of each shape class (once per process).
    ``modify(s, b, rows)``, for attention that is not SDPA's (flex_attention's ``score_mod`` and
    ``mask_mod``), maps the fp32 scores ``s`` (Hq, r, Tk) of batch element ``b`` (a (1,) index
    tensor) and query rows ``rows`` (r,), masks applied, to what the softmax takes: entries it
    makes -inf are masked. It runs in the torch path, chunk by chunk.
    """
    B, Hq, Tq, D, _, Tk = _check_qk(q, k)
    _check_mask(attn_mask, (B, Hq, Tq, Tk))
    attn_mask, is_causal = _fold_causal(attn_mask, is_causal, Tq, Tk)
    _check_index("batch", batch, B)
    _check_index("rows", rows, Tq)
    thr = saturation_threshold(saturation_dtype)
    scale = _resolve_scale(scale, D)
    if _resolve_backend(backend, q.device) == "torch" or scale == 0.0 or modify is not None:
        return _head_stats_torch(
            q, k, _as_4d(attn_mask), is_causal, scale, rows, batch, thr, entropy, memory_budget,
            modify,
        )  # fmt: skip
    mask = None if attn_mask is None else attn_mask.broadcast_to((B, Hq, Tq, Tk))
    return _head_stats_triton(q, k, mask, is_causal, scale, rows, batch, thr, entropy)


def _output_error_whole(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    is_causal: bool,
    scale: float,
    cdt: torch.dtype,
    b_ok: torch.Tensor | None = None,
) -> torch.Tensor:
    """``attention_output_error`` of calls without a mask or row sampling whose scores fit the
    memory budget, in one piece: the sampled step of a monitored model makes one such call per
    layer, and the chunked path's ~60 small ops per call cost ~2.5 ms of host time each (H200
    host, GPT-2); this takes about 15. No row is fully masked here (causal is top-left aligned).
    ``b_ok`` is False for batch elements gathered for out-of-range indices: they count nothing.
    """
    with _exact_fp32_matmul(q.device):
        ref, _ = torch.ops.aten._scaled_dot_product_attention_math(
            q.to(cdt),
            k.to(cdt),
            v.to(cdt),
            is_causal=is_causal,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    out_c = out.to(cdt)
    err = (out_c - ref).to(torch.float64)
    excess = (out_c - ref.to(out.dtype).to(cdt)).to(torch.float64)
    n_b = out.shape[0]
    if b_ok is not None:
        keep = b_ok.view(-1, 1, 1, 1)
        err, excess = torch.where(keep, err, 0.0), torch.where(keep, excess, 0.0)
        n_b = b_ok.sum(dtype=torch.float64)
    dims = (0, 2, 3)
    sums = [err.sum(dims), err.abs().sum(dims), err.square().sum(dims)]
    count = torch.zeros_like(sums[0]) + n_b * float(out.shape[2] * out.shape[3])
    coherent = excess.sum((0, 2)).abs().sum(-1)
    return torch.stack([*sums, count, coherent], -1)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the output-error kernel by padded head dim
# (sm_90 SASS without spills: ~150 registers at D 64, ~230 at D 128, ~205 at D 256); the
# interpreter's tiles are small enough to cross several tiles per row.
_ERROR_CONFIGS = {128: (64, 32, 8, 2), 256: (32, 32, 8, 2)}
_ERROR_INTERPRET_CONFIG = (16, 16, 4, 1)


def _output_error_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, is_causal: bool,
    scale: float, b_ok: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``attention_output_error`` of a call without mask or row sampling in one launch: no
    scores in memory, so many layers stacked as heads cost one call (the torch path's
    recomputation materializes them and must go layer by layer). ``b_ok`` as in
    ``_output_error_whole``."""
    B, Hq, Tq, D = q.shape
    Tk, Dv = k.shape[2], v.shape[3]
    exact_tf32 = all(x.dtype in (torch.bfloat16, torch.float16) for x in (q, k))
    block_d, block_dv = (max(16, next_power_of_2(d)) for d in (D, Dv))
    config = _ERROR_CONFIGS[128 if max(block_d, block_dv) <= 128 else 256]
    bm, bn, warps, stages = _ERROR_INTERPRET_CONFIG if _interpreting() else config
    n_blocks = cdiv(Tq, bm)
    part = torch.empty((B, Hq, n_blocks, 3), dtype=torch.float64, device=q.device)
    part_dim = torch.empty((B, Hq, n_blocks, block_dv), dtype=torch.float64, device=q.device)
    _output_error_kernel[(n_blocks, Hq, B)](
        q, k, v, out, part, part_dim,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        Tq, Tk, D, Dv, Hq // k.shape[1], scale,
        IS_CAUSAL=bool(is_causal), QK_PRECISION="tf32" if exact_tf32 else "tf32x3",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, BLOCK_DV=block_dv,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    n_b = B
    if b_ok is not None:
        keep = b_ok.view(-1, 1, 1, 1)
        part, part_dim = torch.where(keep, part, 0.0), torch.where(keep, part_dim, 0.0)
        n_b = b_ok.sum(dtype=torch.float64)
    sums = part.sum((0, 2))
    count = torch.zeros_like(sums[:, :1]) + n_b * float(Tq * Dv)
    coherent = part_dim.sum((0, 2)).abs().sum(1, keepdim=True)  # padded dims hold zeros
    return torch.cat([sums, count, coherent], 1)


def output_error_in_one_launch(
    device: torch.device, attn_mask: torch.Tensor | None, rows: torch.Tensor | None,
    backend: str = "auto",
) -> bool:  # fmt: skip
    """Whether ``attention_output_error`` takes the one-launch kernel for such a call (a caller
    may then stack many layers' calls as heads)."""
    if attn_mask is not None or rows is not None or backend == "torch" or triton is None:
        return False
    return device.type == "cuda" or (backend == "triton" and _interpreting())


def attention_output_error(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    rows: torch.Tensor | None = None,
    batch: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    memory_budget: int = _DEFAULT_MEMORY_BUDGET,
    backend: str = "auto",
    modify: ScoreModify | None = None,
) -> torch.Tensor:
    """Signed error of an attention output against a recomputation: (Hq, N_ERR_STATS) float64
    with ERR_SUM, ERR_ABS_SUM, ERR_SQ_SUM, ERR_COUNT of err = out - O_ref and
    ERR_EXCESS_COHERENT_SUM (see its definition) per head.

    Calls without ``attn_mask`` and ``rows`` run as one Triton launch on CUDA ("auto") and in
    the interpreter with ``backend="triton"`` (an fp32 online softmax at fp32 accuracy,
    ``compute_dtype`` fp32); everything else, and ``backend="torch"``, runs in torch.

    ``out`` (B, Hq, Tq, Dv) is what the user's kernel returned for these inputs; O_ref is
    recomputed in ``compute_dtype`` (default fp32 on GPU, float64 on CPU), chunked over rows so
    memory stays under ``memory_budget`` bytes. Fully masked rows are excluded, and so are
    ``rows`` and ``batch`` indices out of range (see ``attention_head_stats``). The probe derives
    bias = ERR_SUM / ERR_ABS_SUM (a one-signed error gives ±1), systematic error =
    ERR_EXCESS_COHERENT_SUM / ERR_ABS_SUM (about 1 when the kernel errs beyond correct rounding
    with one sign per output dim across rows, whatever the sign; 0 for correct rounding) and
    rms = sqrt(ERR_SQ_SUM / ERR_COUNT). ``modify`` as in ``attention_head_stats``, applied to
    the recomputation's scores in ``compute_dtype`` (torch path). No host sync.
    """
    B, Hq, Tq, D, Hkv, Tk = _check_qk(q, k)
    if v.dim() != 4 or v.shape[:3] != (B, Hkv, Tk):
        raise ValueError(f"v must be (B, Hkv, Tk, Dv) = ({B}, {Hkv}, {Tk}, Dv), got {v.shape}")
    Dv = v.shape[-1]
    if out.shape != (B, Hq, Tq, Dv):
        raise ValueError(f"out must be (B, Hq, Tq, Dv) = {(B, Hq, Tq, Dv)}, got {out.shape}")
    _check_mask(attn_mask, (B, Hq, Tq, Tk))
    attn_mask, is_causal = _fold_causal(attn_mask, is_causal, Tq, Tk)
    _check_index("batch", batch, B)
    _check_index("rows", rows, Tq)
    mask4 = _as_4d(attn_mask)
    scale = _resolve_scale(scale, D)
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if 0 in (B, Tq, Tk):  # no row, or every row fully masked: nothing to measure
        return torch.zeros(Hq, N_ERR_STATS, dtype=torch.float64, device=q.device)
    cdt = compute_dtype or (torch.float64 if q.device.type == "cpu" else torch.float32)
    one_launch = (
        compute_dtype in (None, torch.float32)  # the kernel computes in fp32, on any device
        and max(D, Dv) <= 256  # larger head dims would spill registers
        and modify is None
        and output_error_in_one_launch(q.device, attn_mask, rows, backend)
    )
    n_b = B if batch is None else batch.numel()
    whole_bytes = n_b * Hq * Tq * Tk * _WHOLE_BYTES_PER_ENTRY * (torch.finfo(cdt).bits // 32)
    whole = attn_mask is None and rows is None and modify is None and whole_bytes <= memory_budget
    if one_launch or whole:  # the sampled batch elements, then every row in one piece
        b_ok = None
        if batch is not None:
            b_idx, b_ok = _clamped(batch, B, q.device)
            q, k, v, out = (x.index_select(0, b_idx) for x in (q, k, v, out))
        if one_launch:
            return _output_error_triton(q, k, v, out, is_causal, scale, b_ok)
        return _output_error_whole(q, k, v, out, is_causal, scale, cdt, b_ok)
    g = Hq // Hkv
    b_idx, r_idx, sampled = _sampled(batch, rows, B, Tq, q.device)
    acc = torch.zeros(Hq, N_ERR_STATS, dtype=torch.float64, device=q.device)
    dim_sums = torch.zeros(Hq, v.shape[-1], dtype=torch.float64, device=q.device)
    # temporaries are counted in fp32 entries: scale the budget by the compute dtype's width
    budget = memory_budget * 4 // (torch.finfo(cdt).bits // 8)
    with _exact_fp32_matmul(q.device):
        for bi in range(b_idx.numel()):
            b1 = b_idx[bi : bi + 1]
            qb, ob = q.index_select(0, b1)[0], out.index_select(0, b1)[0]
            kb = k.index_select(0, b1)[0].to(cdt)  # (Hkv, Tk, D)
            vb = v.index_select(0, b1)[0].to(cdt)  # (Hkv, Tk, Dv)
            for sl in _row_chunks(r_idx.numel(), Hq * Tk, budget):
                r = r_idx[sl]
                rc = r.numel()
                qc = qb.index_select(1, r).to(cdt).view(Hkv, g * rc, D)
                s = (qc @ kb.transpose(1, 2)).view(Hq, rc, Tk) * scale
                valid, add = _chunk_validity(mask4, is_causal, b1, r, sampled[bi, sl], Hq, Tk)
                if add is not None:
                    s = s + add.to(cdt)
                if modify is not None:
                    s = modify(s, b1, r)
                    valid = valid & (s != float("-inf"))
                s = s.masked_fill(~valid, float("-inf"))
                row_ok = valid.any(-1)  # (Hq, rc)
                p = torch.softmax(s, -1).nan_to_num_(0.0)  # fully masked rows: NaN -> 0
                o = (p.view(Hkv, g * rc, Tk) @ vb).view(Hq, rc, Dv)
                ob_r = ob.index_select(1, r)
                ob_c = ob_r.to(cdt)
                err = torch.where(row_ok.unsqueeze(-1), ob_c - o, 0.0).to(torch.float64)
                excess = ob_c - o.to(ob_r.dtype).to(cdt)
                excess = torch.where(row_ok.unsqueeze(-1), excess, 0.0).to(torch.float64)
                acc[:, ERR_SUM] += err.sum((1, 2))
                acc[:, ERR_ABS_SUM] += err.abs().sum((1, 2))
                acc[:, ERR_SQ_SUM] += err.square().sum((1, 2))
                acc[:, ERR_COUNT] += row_ok.sum(-1, dtype=torch.float64) * Dv
                dim_sums += excess.sum(1)
    acc[:, ERR_EXCESS_COHERENT_SUM] = dim_sums.abs().sum(-1)
    return acc
