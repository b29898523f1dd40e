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
    """A Monitor factory: no console, the JSONL log in the test's own folder (run.jsonl; run-2,
    run-3... for monitors made while an earlier one still writes there: one writer per log)."""
    import numwatch
    from numwatch.sinks.jsonl import writing

    def make(model, **overrides):
        overrides.setdefault("sinks__console__enabled", False)
        path, n = tmp_path / "run.jsonl", 1
        while writing(path):
            n += 1
            path = tmp_path / f"run-{n}.jsonl"
        overrides.setdefault("sinks__jsonl__path", str(path))
        return numwatch.Monitor(model, **overrides)

    return make
