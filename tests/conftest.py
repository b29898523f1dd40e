"""Test session set-up: without a GPU, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before triton decorates any kernel, i.e. before numwatch.kernels
is imported, which is why it happens here at import time.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def make_monitor(tmp_path):
    """A Monitor factory: no console, the JSONL log in the test's own folder."""
    import numwatch

    def make(model, **overrides):
        overrides.setdefault("sinks__console__enabled", False)
        overrides.setdefault("sinks__jsonl__path", str(tmp_path / "run.jsonl"))
        return numwatch.Monitor(model, **overrides)

    return make
