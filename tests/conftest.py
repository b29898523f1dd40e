"""Test session set-up: without a GPU, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before triton decorates any kernel, i.e. before numwatch.kernels
is imported, which is why it happens here at import time.
"""

import contextlib
import os
import signal
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Graphs a test compiled are dropped after it: left on the forward of classes later tests
    share (nn.Linear), they made those tests' attach() warn that the model was compiled."""
    yield
    torch._dynamo.reset()


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


LONG_LOG_FLUSHES, LONG_LOG_PARAMS = 200, 250


@pytest.fixture
def long_log(tmp_path):
    """A log of many points (flushes x parameters of grad_absmax, value flush + parameter
    index), for the readers' memory: a week-long run's log does not fit in memory as records."""
    import json

    path = tmp_path / "long.jsonl"
    with path.open("w") as f:
        for i in range(LONG_LOG_FLUSHES):
            metrics = [
                {"name": "grad_absmax", "labels": {"param": f"layers.{p}.weight"}, "value": i + p}
                for p in range(LONG_LOG_PARAMS)
            ]
            record = {"run": "long", "step": 10 * i, "time": float(i), "rank": 0}
            f.write(json.dumps(record | {"metrics": metrics, "events": []}) + "\n")
    return path


def peak_memory(fn):
    """fn's result and the peak of Python memory it allocated (tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


class OwnStepSize(torch.optim.Optimizer):
    """p -= size * grad, the size its own in a group whose lr is None (as in Adafactor(lr=None,
    relative_step=True)), the group's lr otherwise."""

    def __init__(self, params, size):
        super().__init__(params, {"lr": None, "size": size})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_((group["size"] if group["lr"] is None else group["lr"]) * p.grad)


@contextlib.contextmanager
def forked_child():
    """A forked child (as a DataLoader worker is: its fork handlers have run) that lives until
    the block ends, then is killed."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    ready, told = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(told, b"1")
        time.sleep(30)
        os._exit(0)
    os.read(ready, 1)
    try:
        yield
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


class Fixed(torch.nn.Module):
    """Calls attention on fixed planted Q/K/V (the model input is ignored)."""

    def __init__(self, q, k, v, fn):
        super().__init__()
        self.q, self.k, self.v, self.fn = q, k, v, fn

    def forward(self, _x=None):
        return self.fn(self.q, self.k, self.v)


class Net(torch.nn.Module):
    """``inner`` as the module ``block.attn``: the layer label attention calls get."""

    def __init__(self, inner):
        super().__init__()
        self.block = torch.nn.Module()
        self.block.attn = inner

    def forward(self, x=None):
        return self.block.attn(x)
