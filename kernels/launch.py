"""Relaunch an already compiled Triton kernel with less host work than ``kernel[grid](...)``.

The monitor launches a few small kernels every training step, and an eager training loop is
often bound by the host, so the host microseconds of a launch show up in the step time.
``JITFunction.run`` binds and specializes every argument and looks up its cache on each call
(the power iteration's three launches per step took 98 us of host time through it on the H200's
host, 77 us relaunched). A ``Relauncher`` does that once per caller-given key (the
caller keys on everything that selects a compilation: constexprs and the arguments triton
specializes) and then calls the compiled kernel's launcher directly, the way triton's own
``CompiledKernel.__getitem__`` does.

It uses triton's runtime objects (``CompiledKernel.run``, ``function``, ``packed_metadata``):
when they are missing (the interpreter, another triton version), every call takes the normal
path, so results never depend on it.

``capture`` goes one step further for a launch sequence that repeats every step over the same
buffers (a power-iteration step): it records it once as a CUDA graph, and a replay costs one
call instead of one launch per kernel. (The gradient statistics tried it too: it saved host
time per call but measured slower end to end, see tensor_stats.)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

try:
    from triton import knobs
    from triton.runtime.driver import driver
except ImportError:  # triton missing or older than 3.4 (no knobs): the normal path only
    knobs = driver = None

__all__ = [
    "CUDA_GRAPHS",
    "GRAPH_AFTER",
    "Relauncher",
    "capture",
    "capture_when_due",
    "cdiv",
    "direct_constructor",
    "graphs_allowed",
    "next_power_of_2",
    "replay",
]

T = TypeVar("T")
log = logging.getLogger("numwatch")
_capture_failed = False  # warned once per process
CUDA_GRAPHS = True  # tests switch it off to compare replays with plain launches
_CUDA_BUILT = torch.backends.cuda.is_built()
GRAPH_AFTER = 2  # plain runs of a launch sequence before it is captured (compiled by then)


def graphs_allowed() -> bool:
    """A graph may be captured or replayed now: not while the caller's stream is itself being
    captured (a user's CUDA graph of the whole step then records the plain launches), and never
    with a torch built without CUDA (whose capture query raises)."""
    return CUDA_GRAPHS and _CUDA_BUILT and not torch.cuda.is_current_stream_capturing()


def capture(
    device: torch.device, launches: Callable[[], T]
) -> tuple[torch.cuda.CUDAGraph, T] | None:
    """``launches()`` recorded as a CUDA graph, with what it returned: tensors it allocated
    come from the graph's own memory pool and are rewritten by every replay (callers hand out
    copies). None where capture fails (for whatever reason: a warning is logged once per
    process); the caller keeps launching.

    Captured on a side stream in thread-local mode (other threads' CUDA calls, such as a data
    loader's, cannot invalidate it) and without a sync. The kernels must be compiled already:
    capture records launches, it runs nothing.
    """
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                result = launches()
            finally:
                graph.capture_end()
    except Exception as err:  # an optimization only: whatever fails, the launches still work
        global _capture_failed
        if not _capture_failed:
            _capture_failed = True
            log.warning(
                "numwatch: CUDA graph capture failed (%s: %s); the kernels launch one by one",
                type(err).__name__,
                err,
            )
        return None
    finally:
        torch.cuda.current_stream(device).wait_stream(side)
    return graph, result


def replay(graphs: dict[Hashable, Any], key: Hashable) -> torch.Tensor | None:
    """A copy of the output of ``graphs[key]`` (a ``capture`` result) after replaying it on its
    device; None where there is none to replay now (not captured yet, capture failed, or graphs
    not allowed)."""
    captured = graphs.get(key)
    if captured is None or not graphs_allowed():
        return None
    graph, out = captured
    with torch.cuda.device(out.device):  # a replay runs on the current device's stream
        graph.replay()
    return out.clone()


def capture_when_due(
    graphs: dict[Hashable, Any],
    key: Hashable,
    runs: int,
    device: torch.device,
    launches: Callable[[], torch.Tensor],
) -> None:
    """After the ``runs``-th plain run of ``launches``: record it into ``graphs[key]`` once
    ``GRAPH_AFTER`` runs have compiled its kernels, a single time (a failed capture stays None)."""
    due = runs >= GRAPH_AFTER and key not in graphs and device.type == "cuda"
    if due and graphs_allowed():
        graphs[key] = capture(device, launches)


def _direct_launch_supported(compiled: Any) -> bool:
    return knobs is not None and all(
        hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata")
    )


MAX_KEYS = 1024  # a Relauncher's remembered keys


def direct_constructor(cls: type[T], fields: tuple[str, ...]) -> Callable[..., T]:
    """``cls(**values)`` for keyword values of ``fields``, without the checks of its constructor
    (a host TMA descriptor's: most of its cost, and a call makes up to 15) where ``cls`` is a
    dataclass whose fields start with ``fields`` and whose other fields have defaults (later
    Tritons add some: they get those). Otherwise ``cls`` itself, checked. The callers' inputs
    have passed what the checks assert."""
    all_fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    rest = all_fields[len(fields) :]
    if (
        tuple(f.name for f in all_fields[: len(fields)]) != fields
        or any(f.default is dataclasses.MISSING for f in rest)
        or "__slots__" in vars(cls)
    ):
        return cls
    defaults = {f.name: f.default for f in rest}

    def make(**values: Any) -> T:
        obj = object.__new__(cls)
        obj.__dict__.update(defaults)
        obj.__dict__.update(values)
        return obj

    return make


def cdiv(a: int, b: int) -> int:
    """Ceiling division for grids. Triton's own (``triton.cdiv``) is a constexpr_function since
    Triton 3.5, whose call from Python unwraps its arguments: host time on every launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), for tile sizes: not ``triton.next_power_of_2``,
    a constexpr_function like ``triton.cdiv``."""
    return 1 << (n - 1).bit_length()


class Relauncher:
    """``launch(key, grid, *args, **constexprs)``: ``fn[grid](*args, **constexprs)``, compiling
    on the first call of each ``key``, later calls straight into the compiled launcher.

    ``args`` are the kernel's parameters in order up to its first constexpr; ``constexprs``
    holds the rest by name (and launch options such as ``num_warps``). ``key`` must change
    whenever a constexpr, a launch option or a specialization-relevant property of an argument
    (an integer that may equal 1 or be a multiple of 16, a pointer's 16-byte alignment) does.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._names = fn.arg_names
        self._compiled: dict[Hashable, tuple[Any, tuple]] = {}
        self.direct_launches = 0  # for tests: how many calls skipped JITFunction.run

    def __call__(self, key: Hashable, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
        if self._compiled:  # empty in the interpreter, which returns no compiled kernel
            device = driver.active.get_current_device()
            hit = self._compiled.get((device, key))  # a compiled kernel is loaded on one device
        else:
            hit = None
        if hit is None:
            compiled = self.fn[grid](*args, **constexprs)
            rest = self._names[len(args) :]
            if _direct_launch_supported(compiled) and all(n in constexprs for n in rest):
                tail = tuple(constexprs[n] for n in rest)
                if len(self._compiled) >= MAX_KEYS:  # keys of ever new shapes: start over
                    self._compiled.clear()
                self._compiled[(driver.active.get_current_device(), key)] = (compiled, tail)
            return
        compiled, tail = hit
        full = (*args, *tail)
        stream = driver.active.get_current_stream(device)
        grid3 = (*grid, 1, 1)[:3]
        compiled.run(
            grid3[0], grid3[1], grid3[2], stream, compiled.function, compiled.packed_metadata,
            compiled.launch_metadata(grid3, stream, *full),
            knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *full,
        )  # fmt: skip
        self.direct_launches += 1
