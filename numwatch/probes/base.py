"""State that every probe shares with the monitor during a window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from numwatch.buffers import NonfiniteTracker
from numwatch.guard import Guard

__all__ = ["ProbeContext"]


@dataclass
class ProbeContext:
    guard: Guard
    tracker: NonfiniteTracker
    backend: str  # kernel backend: 'auto' | 'torch' | 'triton'
    underflow_dtype: torch.dtype | None
    step: int = 0  # the step in progress (0-based)
    activity: bool = False  # a hook fired since the last closed step

    def backend_for(self, device: torch.device) -> str:
        """The kernel backend a computation on ``device`` uses: 'auto' = Triton on CUDA only."""
        if self.backend == "auto":
            return "triton" if device.type == "cuda" else "torch"
        return self.backend
