"""Route attention layers to numwatch's flash-attention kernel (the stabilized one by default).

The attention probe's interceptor calls an ``AttentionKernel`` instead of
``F.scaled_dot_product_attention`` for the layers it is routed to; the kernel keeps SDPA's
semantics (and falls back to SDPA, counted, for calls it does not support).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from numwatch.kernels.flash_attention import flash_attention
from numwatch.probes.attention import SdpaCall

__all__ = ["AttentionKernel", "AttentionMode"]

AttentionMode = Literal["stabilized", "plain", "paper_repro", "paper_repro_stabilized"]


@dataclass(frozen=True)
class AttentionKernel:
    """numwatch's flash attention with fixed options, called in place of SDPA."""

    stabilize: bool = True
    beta: float = 2.0
    mode: AttentionMode = "stabilized"
    split_sum: bool = False

    def __post_init__(self) -> None:
        if self.mode not in get_args(AttentionMode):
            raise ValueError(f"mode must be one of {get_args(AttentionMode)}, got {self.mode!r}")
        if self.split_sum and self.mode.startswith("paper_repro"):
            raise ValueError("split_sum=True is for the stabilized and plain modes")
        if not 1.0 < self.beta <= 64.0:
            raise ValueError(f"beta must be in (1, 64], got {self.beta}")

    @property
    def stabilized(self) -> bool:
        return self.mode == "stabilized" and self.stabilize

    @property
    def mode_label(self) -> str:
        """The ``mode`` label of metric attn_kernel_mode: what the kernel computes."""
        name = "plain" if self.mode == "stabilized" and not self.stabilize else self.mode
        return name + "_split" if self.split_sum else name

    def __call__(self, call: SdpaCall) -> torch.Tensor:
        return flash_attention(
            call.q,
            call.k,
            call.v,
            attn_mask=call.attn_mask,
            dropout_p=call.dropout_p,
            is_causal=call.is_causal,
            scale=call.scale,
            enable_gqa=call.enable_gqa,
            stabilize=self.stabilize,
            beta=self.beta,
            mode=self.mode,
            split_sum=self.split_sum,
        )
