"""Hugging Face transformers: an ``attn_implementation="numwatch"`` that the monitor can see.

``register_attention()`` adds an AttentionInterface entry that runs transformers' own SDPA path
(so the attention probe intercepts it and kernel hot-swap can route it) and the matching
AttentionMaskInterface entry: without that second entry transformers builds no mask for an
unknown implementation name and silently drops padding.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

import torch
from torch import nn

from numwatch.errors import NumwatchConfigError
from numwatch.hooks import UserHook, outside_graphs

__all__ = [
    "ATTN_IMPLEMENTATION",
    "check_attention_implementation",
    "numwatch_attention_forward",
    "register_attention",
]

ATTN_IMPLEMENTATION = "numwatch"

log = logging.getLogger("numwatch")

# Attention keywords that change the math but that transformers' SDPA path drops without a word
# (sinks, s_aux) or refuses in its own words (softcap).
_SDPA_CANNOT = (
    ("s_aux", "learned attention sinks"),  # GPT-OSS, MiMo-V2-Flash, DeepSeek-V4
    ("sinks", "learned attention sinks"),  # Inkling2 (per token)
    ("softcap", "logit soft-capping"),  # Gemma 2, VaultGemma, T5Gemma
)


def numwatch_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention; the SDPA call inside is what numwatch intercepts.

    A model whose attention SDPA cannot compute is refused, never computed differently (see
    ``_SDPA_CANNOT``). transformers refuses ``attn_implementation="sdpa"`` for those models; it
    cannot know that this name runs the same path. Other keywords are not refused: models and
    callers pass many that SDPA rightly ignores (``sliding_window``, ``position_ids``,
    ``cu_seq_lens_q``, ``num_items_in_batch``...); ``check_attention_implementation`` refuses, at
    attach, any model whose ``_supports_sdpa`` is false, named keyword or not."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for arg, what in _SDPA_CANNOT:
        if kwargs.get(arg) is not None:
            raise ValueError(
                f'attn_implementation="{ATTN_IMPLEMENTATION}" runs transformers\' SDPA path, '
                f"which cannot compute the {what} of {type(module).__name__} ({arg}=): use "
                'attn_implementation="eager", whose softmax input numwatch measures'
            )

    _ran(type(module))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_attention(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register ``name`` as an attention implementation (idempotent); returns the name."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:  # pragma: no cover - exercised only without transformers
        raise ImportError(
            "numwatch.integrations.transformers needs transformers >= 4.48 "
            "(pip install 'transformers>=4.48')"
        ) from exc
    AttentionInterface.register(name, numwatch_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def check_attention_implementation(model: nn.Module) -> list[Any]:
    """Refuse a Hugging Face model in ``model`` that was given numwatch's implementation but
    certainly cannot run it, and watch the first forward of one that may not; ``Monitor.attach``
    calls it and removes the returned hook handles at detach.

    transformers checks an implementation name it does not know against nothing. A model whose
    attention is its own code (Bloom, MPT, MegatronBERT: not AttentionInterface) never calls
    ``numwatch_attention_forward``, yet takes the SDPA-style mask (None or boolean) of its
    AttentionMaskInterface entry and adds it as a float mask: its causal and padding masks are
    lost. A model whose ``_supports_sdpa`` is False (learned sinks, soft-capping) is one that
    transformers refuses "sdpa" for, and this name runs the SDPA path.

    transformers' ``_can_set_attn_implementation`` is a text search of the model's file for
    ``ALL_ATTENTION_FUNCTIONS.get_interface(``: it also fails models that index
    ``ALL_ATTENTION_FUNCTIONS[...]`` (4.5x style, common in remote code) and any whose file
    cannot be read (a notebook), which do run this implementation. So a model is refused as
    "own code" only where the files of all its module classes were read and none names the
    interface; where one cannot be read, or one names it, its first forward is watched: a
    warning follows if numwatch's attention ran for none of its modules. A transformers
    without ``_can_set_attn_implementation`` (older 4.x) is not checked.
    """
    handles: list[Any] = []
    watched: set[int] = set()  # modules inside a model whose first forward is watched
    for module in model.modules():
        cls = type(module)
        follows_interface = getattr(cls, "_can_set_attn_implementation", None)  # PreTrainedModel
        if follows_interface is None:
            continue
        from transformers import AttentionInterface  # loaded: a transformers model is here

        name = module.config._attn_implementation
        if AttentionInterface().get(name) is not numwatch_attention_forward:
            continue
        routes = True if follows_interface() else _names_the_interface(module)
        why = _cannot_run(cls, routes)
        if why is None:
            if routes is None and id(module) not in watched:
                watched.update(id(m) for m in module.modules())
                handles += _watch_first_forward(module, name)
            continue
        for h in handles:
            h.remove()
        sdpa = ' or "sdpa"' if cls._supports_sdpa else ""
        raise NumwatchConfigError(
            f'attn_implementation="{name}": {cls.__name__} {why}; load it with '
            f'attn_implementation="eager"{sdpa}, whose softmax input numwatch measures'
        )
    return handles


def _names_the_interface(model: nn.Module) -> bool | None:
    """None where a file of ``model``'s module classes names AttentionInterface or cannot be
    read (it may route attention through it: only running it tells); False where all were
    read and none does."""
    readable = True
    for module_name in {type(m).__module__ for m in model.modules() if not _in_torch(type(m))}:
        try:
            source = inspect.getsource(sys.modules[module_name])
        except (KeyError, OSError, TypeError):  # a notebook, stdin, a file removed since
            readable = False
            continue
        if "ALL_ATTENTION_FUNCTIONS" in source or "AttentionInterface" in source:
            return None
    return False if readable else None


def _in_torch(cls: type) -> bool:
    """Whether ``cls`` is torch's own (``nn.Linear``): no model's attention layer."""
    return cls.__module__.split(".")[0] == "torch"


def _cannot_run(cls: type, routes: bool | None) -> str | None:
    """Why a model class given numwatch's implementation certainly cannot run it; None if it
    may (``routes``: whether its attention goes through AttentionInterface, None: unknown)."""
    if routes is False:
        return (
            "computes attention in its own code, not through AttentionInterface: it never "
            "runs this implementation and misreads the SDPA-style mask it is given (its "
            "causal and padding masks are lost)"
        )
    if not cls._supports_sdpa:
        return (
            'is refused "sdpa" by transformers (its attention is not what SDPA computes), '
            "and this implementation runs the SDPA path"
        )
    return None


def _watch_first_forward(model: nn.Module, name: str) -> list[Any]:
    """A forward hook that warns after ``model``'s first forward if numwatch's attention
    (registered as ``name``) ran for none of its modules, then removes itself; none where it
    already ran (a forward before attach, or a compiled graph traced then)."""
    classes = frozenset(type(m) for m in model.modules() if not _in_torch(type(m)))
    if _ran_for & classes:
        return []
    handle: list[Any] = []
    hook = UserHook(_after_first_forward, classes, f'attn_implementation="{name}"', handle)
    handle.append(model.register_forward_hook(hook))
    return handle


# The module classes numwatch_attention_forward ran for, eagerly or traced (a compiled graph
# runs it once, while Dynamo traces it); a watched first forward looks for its own.
_ran_for: set[type] = set()


@torch._dynamo.assume_constant_result  # compiled: called once, while traced
def _ran(cls: type) -> bool:
    _ran_for.add(cls)
    return True


_told: set[type] = set()  # the model classes warned about: once each per process


@outside_graphs
def _after_first_forward(
    classes: frozenset, implementation: str, handle: list[Any], model: nn.Module, *_: Any
) -> None:
    for h in handle:
        h.remove()
    if _ran_for & classes or type(model) in _told:
        return
    _told.add(type(model))
    log.warning(
        "numwatch: %s: %s ran a forward without calling numwatch's attention: it computes "
        "attention in its own code, not through AttentionInterface, and misreads the "
        "SDPA-style mask it is given (its causal and padding masks may be lost); load it with "
        'attn_implementation="eager" or "sdpa", whose softmax input numwatch measures',
        implementation,
        type(model).__name__,
    )
