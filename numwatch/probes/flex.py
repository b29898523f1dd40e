"""``torch.nn.attention.flex_attention`` as the attention probe sees it.

flex_attention is a Python function, not a torch function: a ``TorchFunctionMode`` sees only
its higher-order operator, and only inside the ``torch.compile`` that flex_attention always
runs it in (in eager mode a ``fullgraph=True`` compile of its own), where no eager code may run.
So an eager call is found at its entry instead: its first ``Tensor.dim()`` call (the 4-D check)
comes from flex_attention's own frame, whose arguments the probe reads, and whose output it
reads once the call has returned. Its scores are then recomputed as torch's eager flex_attention
computes them (``_math_attention_inner``): the fp32 scores, ``score_mod`` and ``mask_mod``
evaluated under ``vmap`` on index tensors, -inf where ``mask_mod`` is False.

Inside a compiled graph (the user's ``torch.compile``, or ``torch.compile(flex_attention)``) the
call cannot be reached without splitting that graph around the fused kernel: it is left
unmeasured, said once when Dynamo traces it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch

from numwatch.kernels.attention_stats import ScoreModify

__all__ = ["FLEX_HOP", "ModFailed", "entry_code", "score_modify", "tell_compiled"]

log = logging.getLogger("numwatch")

try:  # the operator flex_attention calls (torch >= 2.5)
    from torch._higher_order_ops.flex_attention import flex_attention as FLEX_HOP
except ImportError:
    FLEX_HOP = None

_MODULE = "torch.nn.attention.flex_attention"


def entry_code() -> CodeType | None:
    """Code of ``flex_attention`` where the user imported it (None: not imported, so no model
    calls it): a frame running it is an eager flex_attention call."""
    module = sys.modules.get(_MODULE)
    fn = getattr(module, "flex_attention", None)
    return getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None


class ModFailed(Exception):
    """A ``score_mod`` or ``mask_mod`` that could not be evaluated on index tensors."""

    def __init__(self, which: str, cause: BaseException) -> None:
        super().__init__(f"{which}: {type(cause).__name__}: {cause}")
        self.which = which


def _getitem_as_index() -> contextlib.AbstractContextManager[Any]:
    """torch's own mode that lets a mod index a captured tensor with a vmapped index
    (``bias[q_idx]``), as eager flex_attention evaluates them; a no-op where it is missing."""
    try:
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    except ImportError:
        return contextlib.nullcontext()
    return TransformGetItemToIndex()


def _over_hqk(fn: Callable[..., torch.Tensor], score: bool) -> Callable[..., torch.Tensor]:
    """``fn`` mapped over (head, query, key) index vectors, the batch index fixed, as flex
    evaluates it (one scalar per call, so ``bias[h, q_idx]`` means what it says)."""
    lead = (0,) if score else ()
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None)):
        fn = torch.vmap(fn, in_dims=lead + dims)
    return fn


def score_modify(
    score_mod: Callable[..., torch.Tensor] | None,
    mask_mod: Callable[..., torch.Tensor] | None,
    heads: int,
    keys: int,
    device: torch.device,
) -> ScoreModify | None:
    """The ``modify`` of ``attention_head_stats`` for a flex_attention call, None when it has
    neither mod (identity and no mask: plain attention). Raises ``ModFailed`` from a mod."""
    module = sys.modules.get(_MODULE)
    if score_mod is getattr(module, "_identity", None):  # what flex puts in for None
        score_mod = None
    if mask_mod is getattr(module, "noop_mask", None):  # a BlockMask's without a mask_mod
        mask_mod = None
    if score_mod is None and mask_mod is None:
        return None
    h = torch.arange(heads, device=device)
    kv = torch.arange(keys, device=device)
    score_fn = None if score_mod is None else _over_hqk(score_mod, score=True)
    mask_fn = None if mask_mod is None else _over_hqk(mask_mod, score=False)

    def modify(s: torch.Tensor, b1: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        b = b1[0]  # () int64: the batch element
        with _getitem_as_index():
            if score_fn is not None:
                try:
                    s = score_fn(s, b, h, rows, kv).to(s.dtype)  # (Hq, r, Tk)
                except Exception as exc:
                    raise ModFailed("score_mod", exc) from exc
            if mask_fn is not None:
                try:
                    keep = mask_fn(b, h, rows, kv)  # (Hq, r, Tk) bool
                except Exception as exc:
                    raise ModFailed("mask_mod", exc) from exc
                s = s.masked_fill(~keep.to(torch.bool), float("-inf"))
        return s

    return modify


_told_compiled = False  # the warning below: once per process


@torch._dynamo.assume_constant_result  # run while Dynamo traces, never in the graph
def tell_compiled() -> bool:
    """Say once that flex_attention traced into a compiled graph is not measured. Not for the
    compile flex_attention runs an eager call in (its nested wrapper at the root of the trace):
    those calls are measured at their entry."""
    global _told_compiled
    if _told_compiled:
        return False
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        root = InstructionTranslator.current_tx().f_code
    except Exception:  # another torch's internals: say it (a false alarm beats silence)
        root = None
    code = entry_code()
    if code is not None and root in code.co_consts:
        return False
    _told_compiled = True
    log.warning(
        "numwatch: flex_attention runs inside torch.compile here, where the attention probe "
        "cannot see it without splitting the compiled graph around its fused kernel: its "
        "calls are not measured (no attn_* series for those layers). Eager flex_attention "
        "calls are measured, and so are F.scaled_dot_product_attention calls under compile"
    )
    return True
