"""Small host-built tables and vectors on their device without waiting for it."""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``: pinned and non-blocking on CUDA, so the host never
    waits for the GPU (the caching host allocator keeps the pinned block until the copy ran)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if device.type == "cpu" else t.to(device)
