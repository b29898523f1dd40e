"""Relauncher: the direct relaunch of compiled kernels gives what the normal launch gives."""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict

import pytest
import torch

from numwatch.kernels import launch
from numwatch.kernels import power_iteration as pi
from numwatch.kernels import tensor_stats as ts
from numwatch.testing import kernel_devices, requires_gpu

pytestmark = pytest.mark.skipif(not kernel_devices(), reason="no device can run Triton kernels")


def _tensors(device: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=g) for n in (3000, 5, 70000)]
    xs[2][9] = float("nan")
    xs.append(torch.randn(100, generator=g).to(torch.bfloat16))
    return [x.to(device) for x in xs]


def test_graphs_are_allowed_only_where_cuda_can_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """No error on a torch built without CUDA; off with the switch."""
    assert launch.graphs_allowed() == (torch.backends.cuda.is_built() and torch.cuda.is_available())
    monkeypatch.setattr(launch, "CUDA_GRAPHS", False)
    assert not launch.graphs_allowed()


def test_interpreter_takes_the_normal_path() -> None:
    """The interpreter returns no compiled kernel: nothing is cached, every call is correct."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter path; the GPU path is tested below")
    before = ts._launch_partials.direct_launches
    for seed in (0, 1):
        xs = _tensors("cpu", seed)
        got = ts.tensor_stats(xs, backend="triton")
        assert torch.equal(got[:, ts.NAN], ts.tensor_stats_reference(xs)[:, ts.NAN])
    assert ts._launch_partials.direct_launches == before
    assert not ts._launch_partials._compiled


@requires_gpu
def test_relaunched_tensor_stats_are_bitwise_the_first_launch() -> None:
    """Same tensors, new values and addresses: the relaunch reads the new table and writes what
    a fresh JIT launch writes, bit for bit."""
    xs = _tensors("cuda", 0)
    ts.tensor_stats(xs)  # compiles (and caches) whatever this list needs
    before = ts._launch_partials.direct_launches
    ys = _tensors("cuda", 1)  # same layout: the cached plan, new addresses
    got = ts.tensor_stats(ys)
    assert ts._launch_partials.direct_launches > before
    ts._launch_partials._compiled.clear()
    ts._launch_finalize._compiled.clear()
    fresh = ts.tensor_stats(ys)  # JITFunction.run again
    assert torch.equal(got.isnan(), fresh.isnan())
    assert torch.equal(got.nan_to_num(), fresh.nan_to_num())
    ref = ts.tensor_stats_reference(ys)
    assert torch.equal(got[:, ts.NAN], ref[:, ts.NAN])
    assert torch.equal(got[:, ts.ZERO], ref[:, ts.ZERO])


@requires_gpu
def test_a_failed_capture_returns_none_and_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(launch, "_capture_failed", False)

    def failing() -> None:
        raise ValueError("planted")

    with caplog.at_level("WARNING", logger="numwatch"):
        assert launch.capture(torch.device("cuda"), failing) is None
        assert launch.capture(torch.device("cuda"), failing) is None
    assert sum("capture failed" in r.getMessage() for r in caplog.records) == 1
    assert torch.ones(3, device="cuda").sum().item() == 3.0  # the stream still runs work


@requires_gpu
def test_a_users_graph_capture_records_plain_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Called while the caller's stream is being captured (a CUDA graph of a whole training
    step), tensor_stats records its launches into that graph, which then measures the values
    its tensors hold at each replay."""
    monkeypatch.setattr(ts, "_PLAN_CACHE", OrderedDict())
    xs = _tensors("cuda", 0)
    ts.tensor_stats(xs)  # the plan and its table exist before the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    users = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(users, stream=side):
        out = ts.tensor_stats(xs)
    torch.cuda.current_stream().wait_stream(side)
    for scale in (2.0, -3.0):
        for x in xs:
            x.mul_(scale)
        users.replay()
        ref = ts.tensor_stats_reference(xs)
        assert torch.equal(out[:, ts.MAX], ref[:, ts.MAX])
        assert torch.equal(out[:, ts.NAN], ref[:, ts.NAN])


@requires_gpu
def test_relaunched_power_iteration_matches_the_first_launch() -> None:
    """Two steps with relaunches against two steps that each go through JITFunction.run."""
    torch.manual_seed(0)
    mats = [torch.randn(64, 48, device="cuda"), torch.randn(3, 16, 32, device="cuda").bfloat16()]
    launchers = (pi._launch_fused,)
    a, b = pi.PowerIteration(iters=3), pi.PowerIteration(iters=3)
    a.step(mats)
    before = pi._launch_fused.direct_launches
    relaunched = a.step(mats)
    assert pi._launch_fused.direct_launches > before
    for _ in range(2):
        for launcher in launchers:
            launcher._compiled.clear()
        fresh = b.step(mats)
    assert torch.equal(relaunched, fresh)
    assert torch.equal(a._vec.v, b._vec.v) and torch.equal(a._vec.c, b._vec.c)


@requires_gpu
def test_power_iteration_graph_replays_match_plain_launches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps replayed as CUDA graphs (from the third of a kind on) give the estimates and
    vectors of plain launches bit for bit, while the weights change in place between steps;
    a replay launches nothing one by one."""
    torch.manual_seed(0)
    mats = [torch.randn(64, 48, device="cuda"), torch.randn(3, 16, 32, device="cuda").bfloat16()]
    twins = [m.clone() for m in mats]
    graphed, plain = pi.PowerIteration(iters=2), pi.PowerIteration(iters=2)
    calls = []
    counted = functools.partial(lambda f, *a, **k: calls.append(1) or f(*a, **k), pi._launch_fused)
    monkeypatch.setattr(pi, "_launch_fused", counted)  # every iteration launches it
    for step in range(8):
        for m, t in zip(mats, twins, strict=True):
            m.mul_(1.01)
            t.mul_(1.01)
        n_calls = len(calls)
        got = graphed.step(mats)
        replayed = len(calls) == n_calls
        assert replayed == (step >= 3)  # the warm-up (WARMUP_ITERS), then two plain runs
        monkeypatch.setattr(launch, "CUDA_GRAPHS", False)
        want = plain.step(twins)
        monkeypatch.setattr(launch, "CUDA_GRAPHS", True)
        assert torch.equal(got, want)
        assert torch.equal(graphed._vec.v, plain._vec.v)


def test_cdiv_rounds_up() -> None:
    from numwatch.kernels.launch import cdiv

    assert [cdiv(n, 64) for n in (0, 1, 63, 64, 65, 128, 129)] == [0, 1, 1, 1, 2, 2, 3]


def test_direct_constructor_skips_checks_only_for_known_fields() -> None:
    """Known leading fields (later ones defaulted): an object without __post_init__'s checks;
    other field lists: the class itself, checks and all."""

    @dataclasses.dataclass
    class Checked:
        a: int
        b: list
        extra: str = "default"

        def __post_init__(self) -> None:
            raise AssertionError("checked")

    make = launch.direct_constructor(Checked, ("a", "b"))
    obj = make(a=1, b=[2])
    assert isinstance(obj, Checked) and (obj.a, obj.b, obj.extra) == (1, [2], "default")
    assert launch.direct_constructor(Checked, ("b", "a")) is Checked
    assert launch.direct_constructor(Checked, ("a", "b", "extra", "more")) is Checked

    @dataclasses.dataclass
    class Required:
        a: int
        later: int

    assert launch.direct_constructor(Required, ("a",)) is Required
