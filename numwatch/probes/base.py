"""State that every probe shares with the monitor during a window."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from numwatch.buffers import NonfiniteTracker
from numwatch.guard import Guard

__all__ = ["ProbeContext", "gathering_device"]


def gathering_device(devices: Iterable[torch.device]) -> torch.device:
    """Where per-device results of a model split over devices are gathered: an accelerator
    where there is one, since a non-blocking copy from it into CPU memory could still be
    running when the CPU reads the gathered result. ``devices`` in order of first appearance."""
    devices = list(devices)
    return next((d for d in devices if d.type != "cpu"), devices[0])


@dataclass
class ProbeContext:
    guard: Guard
    tracker: NonfiniteTracker
    backend: str  # kernel backend: 'auto' | 'torch' | 'triton'
    underflow_dtype: torch.dtype | None
    step: int = 0  # the step in progress (0-based)
    activity: bool = False  # a hook fired since the last closed step
    # The model's running forward is no training forward: the model is in eval mode, or the
    # call runs under no_grad / inference_mode (validation left in train mode). Set at the
    # model's entry, or by Monitor.begin_forward() (a reentrant checkpoint's no_grad segment, or
    # a submodule kept in eval mode such as a frozen BatchNorm, is part of a training forward);
    # None outside both, where each module's own mode and the grad mode decide.
    eval_forward: bool | None = None
    # Routed attention calls that numwatch's kernel handed to SDPA, by reason, since the
    # monitor was made (the kernel's own count is the process's, every monitor's)
    kernel_fallbacks: Counter[str] = field(default_factory=Counter)
    # Sampled attention calls the attention probe could not measure, by reason, since the
    # monitor was made (a flex_attention score_mod it cannot evaluate)
    attn_unmeasured: Counter[str] = field(default_factory=Counter)
    # The loss scale the closing step's gradients still carry (a GradScaler's, before
    # unscale_), which the gradient statistics divide out; None: they are the true gradients.
    grad_scale: torch.Tensor | None = None
    # eval_forward of the forward begin_forward() opened (None: none open): what applies again
    # when a model forward run inside it returns
    opened_eval_forward: bool | None = None

    def backend_for(self, device: torch.device) -> str:
        """The kernel backend a computation on ``device`` uses: 'auto' = Triton on CUDA only."""
        if self.backend == "auto":
            return "triton" if device.type == "cuda" else "torch"
        return self.backend
