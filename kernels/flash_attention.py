"""Stabilized flash attention: a drop-in for ``F.scaled_dot_product_attention`` (arXiv 2510.04212).

Why: when a row of attention logits has a repeated maximum (attention sinks, repeated tokens),
several P̄ = exp(S - m) are exactly 1.0, and a kernel that rounds P̄V or the O accumulation to
bf16 rounds them in one direction; the error is biased, flows into dQ through
delta = rowsum(dO * O) and can end in a loss explosion. This kernel keeps that from happening and
runs at flash-attention speed on CUDA (Triton; at head dims 128 and 64 on Hopper the forward is
mostly the warp-specialized Gluon kernel of flash_attention_gluon, same arithmetic), in the Triton
interpreter on CPU (``TRITON_INTERPRET=1``), or as the pure-torch blockwise reference on plain
CPU.

Semantics are SDPA's: (B, H, T, D) layout, ``is_causal`` is the top-left aligned lower triangle,
GQA/MQA when K/V have fewer heads (``enable_gqa=True``), ``attn_mask`` boolean (True = keep) or
additive float (float32 or q's dtype, as SDPA requires), broadcastable to (B, H, Tq, Tk) (key
padding (B,1,1,Tk), (B,1,Tq,Tk), dense per-head masks: all run in the kernel); with ``is_causal``
too, both apply (their AND, as torch's SDPA computes it on CPU). Rows whose keys are all masked give
0, like SDPA. Additive values at or below -2^100 (Hugging Face's finfo(dtype).min) swamp the score
in SDPA's fp32 sum, so a row masked whole by them averages V there: here they take one logit, -2^15
in log2 units, whatever the score, which does the same and keeps the backward exact
(``flash_attention_torch``'s MASK_SWAMPS). Rows masked whole by large finite values above that
(-1e9) have the forward right but a backward of reduced precision: their LSE, one fp32 near -1e9,
loses most of log(row sum). bf16 and fp16 inputs, fp32 accumulators, head dims multiple of 8 up to
256 (64 and 128 are the fast ones), any Tq and Tk.

Fallback: a call the kernel does not run (``dropout_p > 0``, fp32/fp64 inputs, other head dims,
V head dim != QK head dim, a mask that needs a gradient, a non-positive scale, nested tensors,
the tensors of a torch.func transform (vmap, grad), a GPU older than Hopper, ...) goes to
``F.scaled_dot_product_attention`` unchanged and increments ``flash_attention_fallbacks()[reason]``.
The decision reads arguments, shapes, dtypes and devices only, never tensor data (no host sync).
The paper_repro modes never fall back: they raise, since SDPA would not reproduce anything.

Stabilization (``mode="stabilized"``, ``stabilize=True``). Per query row and key block, with m the
running row maximum in fp32:

* Trigger: count the entries whose exp(S - m) rounds to exactly 1.0 in the P̄ dtype, i.e.
  S >= m + ln(1 - 2^-9) for bf16 and m + ln(1 - 2^-12) for fp16 (saturation, of which exact ties
  are a special case). The count carries over earlier blocks while their maximum stays within
  that window of the new one, so ties split across key blocks are caught too (this can count
  entries up to twice the window below m: it may stabilize a near-tie row, never misses one).
* Shift: where the count is >= 2, the softmax shift becomes m + delta instead of m, with the
  paper's delta = (beta - 1) * m for m > 0 and -m for m <= 0 (shift beta*m, resp. 0), clamped to
  [1/64, 8] for bf16 and [1/64, 2] for fp16 (natural-log units). The shift is carried through the
  online softmax as its running maximum, so later blocks are rescaled consistently.
* Why bounded: the paper's unbounded shift turns a healthy row into NaN once (beta - 1) * m
  passes ~88 (fp32 row sum underflows to 0; fp16 P̄ tiles vanish past ~17), and for m <= 0 a
  shift to 0 with m = -1e4 zeroes the row. With the clamp the largest P̄ is >= e^-8 (bf16) or
  e^-2 (fp16): no NaN, no all-zero row, for any beta > 1 and any finite logits; the lower bound
  takes P̄ off 1.0 where beta*m is close to m. Any shift in the window removes P̄ = 1 entries;
  a larger one buys nothing and pushes the rest of the row toward underflow.
* Why O is normalized by the rounded P̄: a bounded shift makes the dominant P̄ of every tied row
  the same value e^-delta, whose rounding error would be shared by all rows; dividing by a row
  sum of the *unrounded* P̄ turns it into a one-signed error (measured bias ratio -0.998 in
  DESIGN.md). O = sum(round(P̄) V) / sum(round(P̄)) is an exact convex combination instead. The
  row LSE for the backward uses the unrounded fp32 sum, so the backward stays the exact softmax
  gradient (P = exp(S - LSE), delta = rowsum(dO * O)); it needs no stabilization.

Measured (bench/results/flash_attention_h200.json, session 18), bias ratio mean(err)/mean|err|
of O against float64 on DESIGN.md's planted ties (B4 H8 N1024 d64 causal bf16, 2 / 4 sink keys,
gap 14, V < 0; exact result rounded to bf16: -0.001 / -0.062): paper_repro -0.984 / -0.514,
stabilized +0.049 / -0.011, plain -0.036 / -0.112, cuDNN +0.106 / +0.071, SDPA flash +0.037 /
-0.018. What strays from the rounded exact result on the H200 comes from the tensor cores, which
truncate low bits when they add small products into a large accumulator (V < 0: errors toward
zero, cuDNN's positive ratios); where fp32 adds round to nearest (the CPU interpreter),
stabilized matches the rounded exact result within 0.003 on planted_tie_attention's ties. Adding
each block's P̄V to O by separate fp32 FMAs does not help in Triton: it folds the add into the
dot's accumulator (bit-identical results on the H200).

A limit that is not the ties' (session 22, measured on the CPU paths): with 4 identical sinks and
every other logit nearly equal (``numwatch.testing.planted_sink_attention``, whose other logits
spread by ~1e-3), the exact O sits on bf16 rounding midpoints to about an fp32 ulp, and the other
keys' P̄V terms are each about one ulp of the fp32 accumulator, all alike, so round-to-nearest
swamps them one way. A few fp32 ulps of one-signed error then decide the bf16 rounding: bias
ratios of ±0.2-0.5 in *both* plain and stabilized, their sign set by where P̄·V lands in its
binade (it moves with the gap: plain -0.39 at gap 14.25, stabilized -0.31 at 14; over gaps
12-18 both average |0.2|). The shift cannot remove it (whole-octave shifts only change the
phase, and move the error to fp16); ``split_sum=True`` does: P̄V and the row sum accumulate in
two parts, the entries within 2^-8 of the row's raw maximum and the rest (flash_attention_torch's
SPLIT_LOG2), added once at the end, so the far keys' terms add up among themselves before
meeting the dominant ones. Measured on the CPU (interpreter, B1 H2 T256 D64 causal, seed 1),
bias ratio plain / stabilized: 2 sinks at gap 16 +0.83 / +0.80 with one sum, -0.06 / -0.08
split (exact result rounded: -0.07); 4 sinks at gap 15 +0.53 / +0.20, split -0.05 / -0.04; on
ties at gap 18, where one sum swamps too (+0.66 / +0.26 with 2 / 4 ties), split stays at the
exact result rounded. It costs a compare and two selects per score and a second P̄V product
(the Gluon forward does not run it): on the H200 (bench/results/flash_attention_h200_session23.json)
+65-87 % forward, +15-23 % forward + backward over the default stabilized kernel; and there
(flash_attention_bias_gap_scan_split_h200.json, the scan below) its mean |bias ratio| equals the
exact result rounded to the third digit on sinks and ties alike: 0.040 / 0.027 (2 / 4 sinks),
0.024 / 0.038 (ties). Before it, on the H200
(bench/results/flash_attention_bias_gap_scan_h200.json: B4 H8 T1024 D64 causal bf16, gaps 12-18,
2 seeds) the same happens to every kernel on planted sinks: mean |bias ratio| with 2 / 4 sinks
stabilized 0.29 / 0.17, plain 0.40 / 0.27, cuDNN 0.53 / 0.35, FA2 0.27 / 0.19 (and -0.99 for
stabilized and plain alike with 2 sinks at gap 16, where each other key adds about one ulp of
the accumulator). On planted_tie_attention's ties, whose other logits spread like N(0, 1),
stabilized is the least biased kernel measured: mean |ratio| 0.059 / 0.046 (2 / 4 ties; the
exact result rounded: 0.024 / 0.038), plain 0.22 / 0.18, cuDNN 0.27 / 0.21, FA2 0.13 / 0.10,
paper_repro 0.97 / 0.46.

``mode="plain"`` runs the same kernel without the shift (``stabilize=False`` does the same in the
default mode). ``mode="paper_repro"`` is for reproduction and tests only: it emulates the
paper's failing kernel (github ucker/why-low-precision-training-fails, attention.py): S rounded
to the input dtype, and the P̄V product, the O accumulation and the row sum rounded to the input
dtype after every key block, no stabilization (``stabilize`` is ignored). Its output carries the
biased rounding on planted ties; its backward is the exact one of this module, from an fp32 LSE.
``mode="paper_repro_stabilized"`` adds this module's stabilizing shift to that emulation (the
paper's own fix on its own kernel, with the bounded shift): it separates what the ties cost from
what BF16 accumulation costs by itself.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import Counter
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

from .flash_attention_torch import (
    MODE_PAPER,
    MODE_PAPER_STABILIZED,
    MODE_PLAIN,
    MODE_SPLIT,
    MODE_STABILIZED,
    PAPER_MODES,
    reference_backward,
    reference_forward,
)

try:
    from . import flash_attention_gluon as _glu
    from . import flash_attention_triton as _tri
except ImportError:  # platforms without triton: the torch reference runs on CPU, CUDA falls back
    _tri = _glu = None

__all__ = [
    "autocast_like_sdpa",
    "flash_attention",
    "flash_attention_fallbacks",
    "flash_attention_reference",
]

_MODES = {
    "stabilized": MODE_STABILIZED,
    "plain": MODE_PLAIN,
    "paper_repro": MODE_PAPER,
    "paper_repro_stabilized": MODE_PAPER_STABILIZED,
}
_DTYPES = (torch.bfloat16, torch.float16)

# Host-side fallback counter, keyed by reason (see flash_attention_fallbacks).
_FALLBACKS: Counter[str] = Counter()
# The counter of the caller running calls now (count_fallbacks), counted in as well.
_CALLER_FALLBACKS: ContextVar[Counter[str] | None] = ContextVar("fallbacks", default=None)
# Those of the calls Dynamo traces, innermost last (it cannot trace a ContextVar). A counter
# there is one the traced code made, read while tracing: counts kept in an existing object
# would be replayed on every run of the graph, each a new guard, and recompile it every call.
_TRACED_CALLERS: list[Counter[str]] = []


@torch._dynamo.assume_constant_result  # Dynamo calls it while tracing, not when the graph runs
def _count_traced_fallback(reason: str) -> bool:
    """Count a fallback in a graph Dynamo traces, once, when traced (see _TRACED_CALLERS)."""
    _FALLBACKS[reason] += 1
    return True


def flash_attention_fallbacks() -> dict[str, int]:
    """Calls handed to ``F.scaled_dot_product_attention`` since import, by reason."""
    return dict(_FALLBACKS)


@contextlib.contextmanager
def count_fallbacks(counter: Counter[str]) -> Iterator[None]:
    """Count the fallbacks of the calls made inside in ``counter`` too: the process-wide count
    mixes every caller's (a monitor would report those of an earlier run)."""
    if torch.compiler.is_compiling():
        _TRACED_CALLERS.append(counter)
        try:
            yield
        finally:
            _TRACED_CALLERS.pop()
        return
    token = _CALLER_FALLBACKS.set(counter)
    try:
        yield
    finally:
        _CALLER_FALLBACKS.reset(token)


def _kernel_mode(mode: str, stabilize: bool, beta: float, split_sum: bool = False) -> int:
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
    if not (math.isfinite(beta) and beta > 1.0):
        raise ValueError(f"beta must be a finite number > 1, got {beta!r}; the paper uses 2 to 8")
    kernel_mode = MODE_PLAIN if mode == "stabilized" and not stabilize else _MODES[mode]
    if split_sum:
        if kernel_mode in PAPER_MODES:
            raise ValueError(
                "split_sum=True is for mode='stabilized' (or plain); the paper_repro modes "
                "emulate the paper's kernel, whose sum is not split"
            )
        kernel_mode |= MODE_SPLIT
    return kernel_mode


def _foldable(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> bool:
    """An unbatched (H, T, D) call, or one with extra leading batch dims (B, ..., H, T, D; e.g.
    windowed attention), which the 4-D kernel serves once they fold into one batch dim."""
    tensors = all(isinstance(t, Tensor) and t.layout == torch.strided for t in (q, k, v))
    return (
        tensors
        and q.dim() == k.dim() == v.dim() != 4
        and q.dim() >= 3
        and (attn_mask is None or attn_mask.dim() <= q.dim())
    )


def fold_batch_dims(t: Tensor, lead: tuple[int, ...]) -> Tensor:
    """t's leading dims broadcast to ``lead``, as SDPA broadcasts them, then folded into one:
    (*lead, H, T, D) as (prod(lead), H, T, D)."""
    t = t.reshape((1,) * (len(lead) + 3 - t.dim()) + tuple(t.shape))
    return t.expand(*lead, *t.shape[-3:]).reshape(math.prod(lead), *t.shape[-3:])


def _fallback_reason(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    scale: float | None,
    enable_gqa: bool,
    traced: bool,
) -> str | None:
    """Why this call cannot run in our kernel (None if it can). Arguments and metadata only.
    ``traced``: Dynamo traces the call (torch.compiler.is_compiling())."""
    if any(isinstance(t, Tensor) and t.is_nested for t in (q, k, v)):  # strided ones too
        return "nested"
    if not all(isinstance(t, Tensor) and t.layout == torch.strided for t in (q, k, v)):
        return "layout"
    if not traced and any(_is_functorch(t) for t in (q, k, v, attn_mask) if t is not None):
        # (Dynamo cannot call the check, and traces a transform's function on plain tensors)
        return "functorch"  # vmap / grad: the transform's own tensors
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "ndim"
    if not (q.device == k.device == v.device) or q.device.type not in ("cuda", "cpu"):
        return "device"
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return "dtype"
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if dropout_p > 0.0:
        return "dropout"
    b, h, tq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[1:3] != v.shape[1:3]:
        return "shape"
    if k.shape[3] != d or v.shape[3] != d:
        return "head_dim_v"
    if d % 8 != 0 or d > 256:
        return "head_dim"
    hk, tk = k.shape[1], k.shape[2]
    if 0 in (b, h, hk, tq, tk):  # nothing to compute (and no TMA descriptor has a 0 dim)
        return "empty"
    if hk != h and hk != 1 and (not enable_gqa or h % hk != 0):  # SDPA broadcasts hk == 1
        return "heads"
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        return "scale"
    if attn_mask is not None:
        if attn_mask.device != q.device or attn_mask.layout != torch.strided:
            return "mask_device"
        if attn_mask.dtype not in (torch.bool, torch.float32, q.dtype):  # SDPA's rule
            return "mask_dtype"
        if attn_mask.requires_grad:
            return "mask_grad"
        if attn_mask.dim() < 2:  # SDPA indexes the mask's last two dims (and raises)
            return "mask_shape"
        try:
            if torch.broadcast_shapes(attn_mask.shape, (b, h, tq, tk)) != (b, h, tq, tk):
                return "mask_shape"
        except RuntimeError:
            return "mask_shape"
    if q.device.type == "cuda":
        if _tri is None:
            return "no_triton"
        if _capability_major(q.device) < 9:
            return "gpu_arch"  # tensor descriptors (TMA) are only tested on Hopper
    return None


_is_functorch = torch._C._functorch.is_functorch_wrapped_tensor


@torch._dynamo.assume_constant_result  # a property of the GPU: Dynamo calls it while tracing
def _capability_major(device: torch.device) -> int:
    return _tri.capability_major(device)


def autocast_like_sdpa(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The operands SDPA computes with under autocast: every fp32, fp16 or bf16 input, a float
    mask included, in the autocast dtype (fp64 and bool stay)."""
    device_type = q.device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if dtype in _DTYPES:

            def cast(t: Tensor | None) -> Tensor | None:
                return t.to(dtype) if t is not None and t.dtype in _AUTOCAST_CASTS else t

            return cast(q), cast(k), cast(v), cast(attn_mask)  # type: ignore[return-value]
    return q, k, v, attn_mask


_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)


def _use_triton(q: Tensor) -> bool:
    """CUDA -> compiled Triton; CPU -> interpreter if TRITON_INTERPRET=1 was set at import."""
    if _tri is None:
        return False
    return q.is_cuda or _tri.INTERPRET


def _forward(q, k, v, mask, causal, sm_scale, mode, beta, use_triton) -> tuple[Tensor, Tensor]:
    """O and the row LSE: the Gluon forward where it serves the call, else the Triton one (or
    the torch reference off the GPU without the interpreter)."""
    if use_triton and _glu.supports(q, k, v, mask, mode, causal):
        try:
            return _glu.gluon_forward(q, k, v, causal, sm_scale, mode, beta)
        except Exception as e:  # never break training over the experimental fast path
            _glu.disable(e)
    if use_triton:
        return _tri.triton_forward(q, k, v, mask, causal, sm_scale, mode, beta)
    return reference_forward(q, k, v, mask, causal, sm_scale, mode, beta)


def _backward(
    do, q, k, v, o, lse, mask, causal, sm_scale, mode, use_triton
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one call from what its forward saved: the kernels' or the reference's."""
    args = (do, q, k, v, o, lse, mask, causal, sm_scale, mode)
    with _no_autocast(q.device.type), torch.no_grad():
        return (_tri.triton_backward if use_triton else reference_backward)(*args)


class _FlashFn(torch.autograd.Function):
    """Forward/backward of one eager call; ``use_triton`` picks the kernels or the torch
    reference. A call Dynamo traces runs the same code through the custom ops below."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, sm_scale, mode, beta, use_triton):  # type: ignore[override]
        o, lse = _forward(q, k, v, mask, causal, sm_scale, mode, beta, use_triton)
        ctx.save_for_backward(q, k, v, o, lse, mask)
        ctx.causal, ctx.sm_scale, ctx.mode, ctx.use_triton = causal, sm_scale, mode, use_triton
        return o

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        q, k, v, o, lse, mask = ctx.saved_tensors
        create_graph = torch.is_grad_enabled()
        grads = _backward(
            do, q, k, v, o, lse, mask, ctx.causal, ctx.sm_scale, ctx.mode, ctx.use_triton
        )
        if create_graph:  # the kernels' backward is not differentiable: say so, never be wrong
            grads = _no_second_derivative(*grads)
        return *grads, None, None, None, None, None, None


# ----------------------------------------------------------------------------- torch.compile
# Dynamo cannot trace the launches (they read tensor addresses, and the Triton interpreter runs
# Python on real tensors), and inductor would drop the paper_repro modes' roundings were it to
# trace the reference: a traced call runs the same forward and backward as an eager one as two
# custom ops, opaque to the compiler, whose fake implementations give only the outputs' shapes,
# dtypes and strides. Eager calls keep _FlashFn: a custom op's dispatch costs host time per
# call that the launches were trimmed of (kernels/launch.py).


def _kernel_layouts(ts: tuple[Tensor, ...], use_triton: bool) -> tuple[Tensor, ...]:
    """The tensors as the Triton kernels take them: TMA needs 16-byte strides and base, and the
    rare layouts that lack them are copied."""
    if not use_triton:
        return ts
    return tuple(t if _tri.descriptor_ready(t) else _tri.aligned_copy(t) for t in ts)


def _strided_like(out: Tensor, like: Tensor) -> Tensor:
    """``out`` with the strides of ``torch.empty_like(like)``, which the fake implementations
    promise (inductor asserts them): a copy only where they differ, i.e. where the reference
    computed ``out`` in another layout or ``like`` was copied to be descriptor-ready."""
    if out.stride() == like.stride():
        return out
    want = torch.empty_like(like)
    return out if want.stride() == out.stride() else want.copy_(out)


@torch.library.custom_op("numwatch::flash_attention_forward", mutates_args=())
def _forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    causal: bool,
    sm_scale: float,
    mode: int,
    beta: float,
    use_triton: bool,
) -> tuple[Tensor, Tensor]:
    """O (strided like q) and the row LSE (B, H, Tq) fp32 of a traced call."""
    qa, ka, va = _kernel_layouts((q, k, v), use_triton)
    with _no_autocast(q.device.type):  # a compiled graph runs the op inside the user's autocast
        o, lse = _forward(qa, ka, va, mask, causal, sm_scale, mode, beta, use_triton)
    if qa is not q or not use_triton:
        o, lse = _strided_like(o, q), lse.contiguous()
    return o, lse


@_forward_op.register_fake
def _(q, k, v, mask, causal, sm_scale, mode, beta, use_triton):  # type: ignore[no-untyped-def]
    b, h, tq, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, tq), dtype=torch.float32)


@torch.library.custom_op("numwatch::flash_attention_backward", mutates_args=())
def _backward_op(
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
    use_triton: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (strided like q, k, v) of a traced call."""
    qa, ka, va = _kernel_layouts((q, k, v), use_triton)
    dq, dk, dv = _backward(do, qa, ka, va, o, lse, mask, causal, sm_scale, mode, use_triton)
    return _strided_like(dq, q), _strided_like(dk, k), _strided_like(dv, v)


@_backward_op.register_fake
def _(do, q, k, v, o, lse, mask, causal, sm_scale, mode, use_triton):  # type: ignore[no-untyped-def]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, mask, causal, sm_scale, mode, _beta, use_triton = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], mask)
    ctx.causal, ctx.sm_scale, ctx.mode, ctx.use_triton = causal, sm_scale, mode, use_triton


def _backward_of_op(ctx, do, _dlse):  # type: ignore[no-untyped-def]
    q, k, v, o, lse, mask = ctx.saved_tensors
    args = (ctx.causal, ctx.sm_scale, ctx.mode, ctx.use_triton)
    return *_backward_op(do, q, k, v, o, lse, mask, *args), None, None, None, None, None, None


_forward_op.register_autograd(_backward_of_op, setup_context=_setup_context)


def _private_mask(mask: Tensor) -> Tensor:
    """A copy of a bool mask, for the call and its backward. SDPA converts a bool mask before it
    computes and keeps none of the caller's tensor, so a mask buffer refilled in place for the
    next layer (causal, then a sliding window) trains under it; the caller's tensor saved here (or
    its expanded view, which shares its version counter) made that backward raise. Float masks
    are saved as they are: SDPA saves those too, and raises alike. Broadcast dims (stride 0) are
    copied once: a (B, 1, 1, Tk) key-padding mask costs B * Tk bytes whatever H and Tq."""
    one = tuple(slice(0, 1) if stride == 0 else slice(None) for stride in mask.stride())
    return mask[one].clone().expand(mask.shape)


def _records_graph(*tensors: Tensor) -> bool:
    """Whether autograd saves this call's tensors for a backward."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _no_second_derivative(*grads: Tensor) -> tuple[Tensor, ...]:
    """The gradients, as outputs of a node that raises when differentiated. ``once_differentiable``
    adds that node only when the incoming gradient requires grad: a gradient penalty's
    ``grad(out.sum(), x, create_graph=True)`` has a constant one, and got dq, dk and dv as
    constants, so its second derivative through them was silently left out."""
    err = torch._C._functions.DelayedError(
        "numwatch's flash_attention has no second derivative (its backward is not "
        "differentiable): a gradient penalty or double backward through it needs native SDPA",
        len(grads),
    )
    return err(*(g.detach().requires_grad_() for g in grads))


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast switched off where it is on (entering the context costs host time per call)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _sdpa_fallback(
    reason: str,
    mode: int,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    """A call the kernel does not run, handed to SDPA unchanged and counted by ``reason``."""
    if mode in PAPER_MODES:
        raise ValueError(
            f"the paper_repro modes cannot run this call ({reason}); they have no SDPA fallback"
        )
    if torch.compiler.is_compiling():
        _count_traced_fallback(reason)
        caller = _TRACED_CALLERS[-1] if _TRACED_CALLERS else None
    else:
        _FALLBACKS[reason] += 1
        caller = _CALLER_FALLBACKS.get()
    if caller is not None:
        caller[reason] += 1
    extra = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        **extra,
    )  # fmt: skip


def _run(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    mode: int,
    beta: float,
    use_triton: bool,
) -> Tensor:
    q, k, v, attn_mask = autocast_like_sdpa(q, k, v, attn_mask)
    if _foldable(q, k, v, attn_mask):
        lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        fold = functools.partial(fold_batch_dims, lead=lead)
        mask = attn_mask if attn_mask is None or attn_mask.dim() < 4 else fold(attn_mask)
        out = _run(
            fold(q), fold(k), fold(v), mask, dropout_p, is_causal, scale, enable_gqa, mode, beta,
            use_triton,
        )  # fmt: skip
        return out.reshape(*lead, *out.shape[-3:])
    traced = torch.compiler.is_compiling()
    reason = _fallback_reason(q, k, v, attn_mask, dropout_p, scale, enable_gqa, traced)
    if reason == "empty" and 0 in q.shape[:2]:
        # No output element; SDPA's CUDA path returns None for an empty batch (torch 2.11). The
        # output joins q, k and v's graph (sums of no element: exactly 0), as SDPA's does.
        out = q.new_zeros(*q.shape[:3], v.shape[-1])
        if torch.is_grad_enabled():
            out = out + sum(t.flatten()[:0].sum() for t in (q, k, v))
        return out
    if reason is not None:
        return _sdpa_fallback(
            reason, mode, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa
        )
    b, h, tq, d = q.shape
    sm_scale = scale if scale is not None else 1.0 / math.sqrt(d)
    mask = None if attn_mask is None else attn_mask.expand(b, h, tq, k.shape[2])
    if mask is not None and mask.dtype == torch.bool and _records_graph(q, k, v):
        mask = _private_mask(mask)
    if traced:
        return _forward_op(q, k, v, mask, is_causal, sm_scale, mode, beta, use_triton)[0]
    q, k, v = _kernel_layouts((q, k, v), use_triton)
    with _no_autocast(q.device.type):
        return _FlashFn.apply(q, k, v, mask, is_causal, sm_scale, mode, beta, use_triton)


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    stabilize: bool = True,
    beta: float = 2.0,
    mode: str = "stabilized",
    split_sum: bool = False,
) -> Tensor:
    """Attention like ``F.scaled_dot_product_attention``, stabilized against biased rounding.

    q (B, H, Tq, D), k/v (B, Hk, Tk, D) -> (B, H, Tq, D) in q's dtype. ``stabilize``, ``beta``,
    ``mode`` and ``split_sum`` are described in the module docstring; the rest are SDPA's
    arguments. Runs the Triton kernel on CUDA and on CPU under ``TRITON_INTERPRET=1``, the torch
    reference on plain CPU. It dispatches like a torch function, so TorchFunctionModes
    (numwatch's attention probe) see it. Under ``torch.compile`` (``fullgraph=True`` too) the
    call joins the graph as two custom ops, ``numwatch::flash_attention_forward`` and
    ``_backward``, which run the same code as an eager call and which the compiler does not see
    into (inductor would drop the paper_repro modes' roundings, and the kernels read tensor
    addresses); a compiled graph's fallbacks are counted once, when it is traced.
    """
    # Nested tensors go to SDPA as they came, before any torch-function dispatch: the nested
    # tensor's own dispatch would hand them back with subclass dispatch off, where SDPA refuses
    # them ('must be contiguous').
    nested = any(isinstance(t, Tensor) and t.is_nested for t in (q, k, v))
    if not nested and has_torch_function((q, k, v)):
        return handle_torch_function(
            flash_attention, (q, k, v), q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, stabilize=stabilize,
            beta=beta, mode=mode, split_sum=split_sum,
        )  # fmt: skip
    kernel_mode = _kernel_mode(mode, stabilize, beta, split_sum)
    if nested:
        return _sdpa_fallback(
            "nested", kernel_mode, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa
        )
    use_triton = _use_triton(q)
    return _run(
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, kernel_mode, beta, use_triton
    )


def flash_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    stabilize: bool = True,
    beta: float = 2.0,
    mode: str = "stabilized",
    split_sum: bool = False,
) -> Tensor:
    """The same attention through the pure-torch blockwise emulation (any device, autograd).

    Same arguments, result and fallbacks as ``flash_attention``; it is the CPU path and the
    oracle the Triton kernels are tested against.
    """
    kernel_mode = _kernel_mode(mode, stabilize, beta, split_sum)
    return _run(
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, kernel_mode, beta, False
    )
