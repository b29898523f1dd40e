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

__all__ = ["ATTN_IMPLEMENTATION", "numwatch_attention_forward", "register_attention"]

ATTN_IMPLEMENTATION = "numwatch"


def numwatch_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention; the SDPA call inside is what numwatch intercepts.

    A model whose attention SDPA cannot compute is refused, never computed differently:
    learned attention sinks (``s_aux``: GPT-OSS, MiMo-V2-Flash), which the SDPA path would drop
    silently, and logit soft-capping (Gemma 2), which it refuses in its own words. transformers
    refuses ``attn_implementation="sdpa"`` for those models; it cannot know that this name runs
    the same path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for arg, what in (("s_aux", "learned attention sinks"), ("softcap", "logit soft-capping")):
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
