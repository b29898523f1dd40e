"""Hugging Face transformers: an ``attn_implementation="numwatch"`` that the monitor can see.

``register_attention()`` adds an AttentionInterface entry that runs transformers' own SDPA path
(so the attention probe intercepts it and kernel hot-swap can route it) and the matching
AttentionMaskInterface entry: without that second entry transformers builds no mask for an
unknown implementation name and silently drops padding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from numwatch.errors import NumwatchConfigError

__all__ = [
    "ATTN_IMPLEMENTATION",
    "numwatch_attention_forward",
    "refuse_unsupported_models",
    "register_attention",
]

ATTN_IMPLEMENTATION = "numwatch"

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
    ``cu_seq_lens_q``, ``num_items_in_batch``...); ``refuse_unsupported_models`` refuses, at
    attach, any model whose ``_supports_sdpa`` is false, named keyword or not."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for arg, what in _SDPA_CANNOT:
        if kwargs.get(arg) is not None:
            raise ValueError(
                f'attn_implementation="{ATTN_IMPLEMENTATION}" runs transformers\' SDPA path, '
                f"which cannot compute the {what} of {type(module).__name__} ({arg}=): use "
                'attn_implementation="eager", whose softmax input numwatch measures'
            )

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


def refuse_unsupported_models(model: nn.Module) -> None:
    """Raise if a Hugging Face model in ``model`` was given numwatch's implementation but
    cannot run it; ``Monitor.attach`` calls it.

    transformers checks an implementation name it does not know against nothing. A model whose
    attention is its own code (Bloom, MPT, MegatronBERT: not AttentionInterface) never calls
    ``numwatch_attention_forward``, yet takes the SDPA-style mask (None or boolean) of its
    AttentionMaskInterface entry and adds it as a float mask: its causal and padding masks are
    lost. A model whose ``_supports_sdpa`` is False (learned sinks, soft-capping) is one that
    transformers refuses "sdpa" for, and this name runs the SDPA path. Checked with
    transformers' own ``_can_set_attn_implementation`` (its test of AttentionInterface use);
    a transformers without it (older 4.x) is not checked.
    """
    for module in model.modules():
        cls = type(module)
        follows_interface = getattr(cls, "_can_set_attn_implementation", None)  # PreTrainedModel
        if follows_interface is None:
            continue
        from transformers import AttentionInterface  # loaded: a transformers model is here

        name = module.config._attn_implementation
        if AttentionInterface().get(name) is not numwatch_attention_forward:
            continue
        if not follows_interface():
            why = (
                "computes attention in its own code, not through AttentionInterface: it never "
                "runs this implementation and misreads the SDPA-style mask it is given (its "
                "causal and padding masks are lost)"
            )
        elif not cls._supports_sdpa:
            why = (
                'is refused "sdpa" by transformers (its attention is not what SDPA computes), '
                "and this implementation runs the SDPA path"
            )
        else:
            continue
        sdpa = ' or "sdpa"' if cls._supports_sdpa else ""
        raise NumwatchConfigError(
            f'attn_implementation="{name}": {cls.__name__} {why}; load it with '
            f'attn_implementation="eager"{sdpa}, whose softmax input numwatch measures'
        )
