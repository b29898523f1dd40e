"""Helpers shared by numwatch's tests and by users who test their own integration.

The same test files run on a CPU (torch references; Triton kernels through the interpreter)
and on a GPU (compiled kernels): ``requires_gpu`` marks what only the second can do.
"""

from __future__ import annotations

import os

import pytest
import torch

__all__ = ["devices", "kernel_devices", "requires_gpu", "triton_interpreting"]

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def triton_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def devices() -> list[str]:
    """Devices the torch paths are tested on: always CPU, plus CUDA when present."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def kernel_devices() -> list[str]:
    """Devices Triton kernels can run on here: CUDA compiled, or CPU through the interpreter."""
    out = []
    if torch.cuda.is_available():
        out.append("cuda")
    if triton_interpreting():
        out.append("cpu")
    return out
