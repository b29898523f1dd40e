"""Relauncher: the direct relaunch of compiled kernels gives what the normal launch gives."""

from __future__ import annotations

import pytest
import torch

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
def test_relaunched_power_iteration_matches_the_first_launch() -> None:
    """Two steps with relaunches against two steps that each go through JITFunction.run."""
    torch.manual_seed(0)
    mats = [torch.randn(64, 48, device="cuda"), torch.randn(3, 16, 32, device="cuda").bfloat16()]
    launchers = (pi._launch_pass1, pi._launch_vnorm, pi._launch_pass2, pi._launch_normalize)
    a, b = pi.PowerIteration(iters=3), pi.PowerIteration(iters=3)
    a.step(mats)
    before = pi._launch_pass1.direct_launches
    relaunched = a.step(mats)
    assert pi._launch_pass1.direct_launches > before
    for _ in range(2):
        for launcher in launchers:
            launcher._compiled.clear()
        fresh = b.step(mats)
    assert torch.equal(relaunched, fresh)
    assert torch.equal(a._u, b._u)
