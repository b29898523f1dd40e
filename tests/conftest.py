"""Test session set-up: without a GPU, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before triton decorates any kernel, i.e. before numwatch.kernels
is imported, which is why it happens here at import time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
