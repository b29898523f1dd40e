"""Fused tensor statistics against planted answers and the float64 reference.

On a CPU the Triton kernel runs in the interpreter (conftest sets TRITON_INTERPRET=1); on a GPU
the same tests run the compiled kernel. Counts, numel and extremes must match exactly; sums
within the fp32-accumulation bound below.
"""

from __future__ import annotations

import math

import pytest
import torch

from numwatch.kernels import tensor_stats as ts
from numwatch.kernels.tensor_stats import (
    ABSMAX,
    MAX,
    MIN,
    N_STATS,
    NAN,
    NEGINF,
    NUMEL,
    POSINF,
    SUBNORMAL,
    SUM,
    SUMSQ,
    UNDERFLOW,
    ZERO,
    tensor_stats,
    tensor_stats_reference,
)
from numwatch.testing import kernel_devices, requires_gpu

FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d]
KERNEL_DTYPES = [torch.float32, torch.bfloat16, torch.float16, *FP8]
EXACT = [NUMEL, ABSMAX, MIN, MAX, NAN, POSINF, NEGINF, ZERO, SUBNORMAL, UNDERFLOW]

# Within a program each lane adds one value per tile in fp32 (here <= 32 tiles) and a tree of
# 1024 lanes combines them: |error| <= (32 + 10 + 2) * 2**-24 * sum|x| = 2.6e-6 * sum|x|; programs
# are combined in float64. SUMSQ (all terms >= 0) has the same relative bound.
SUM_RTOL = 3e-6

pytestmark = pytest.mark.skipif(not kernel_devices(), reason="no device can run Triton kernels")


def _device() -> str:
    return kernel_devices()[0]


def _subnormal(dtype: torch.dtype) -> float:
    """A value that is subnormal in ``dtype`` (and exactly representable there)."""
    return torch.finfo(dtype).tiny / 4


def _planted(dtype: torch.dtype, n: int, seed: int) -> tuple[torch.Tensor, dict[int, int]]:
    """``n`` values of ``dtype`` with known special-value counts, specials in the first third.

    Returns the tensor and the expected counts per column for ``underflow_dtype=torch.float16``.
    """
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(n, generator=g) + 0.5) * torch.where(torch.rand(n, generator=g) < 0.5, -1, 1)
    pos = torch.randperm(n // 3, generator=g)
    has_inf = dtype not in (getattr(torch, "float8_e4m3fn", None),)
    plan = {"nan": 5, "posinf": 3 if has_inf else 0, "neginf": 2 if has_inf else 0}
    plan.update({"pzero": 4, "nzero": 3, "sub": 6})
    # normal in fp32/bf16, below fp16's smallest normal (2**-14): counted as underflow only
    below_fp16 = 1e-6 if dtype in (torch.float32, torch.bfloat16) else 0.0
    plan["below_fp16"] = 7 if below_fp16 else 0
    values = {
        "nan": float("nan"),
        "posinf": float("inf"),
        "neginf": float("-inf"),
        "pzero": 0.0,
        "nzero": -0.0,
        "sub": -_subnormal(dtype),
        "below_fp16": below_fp16,
    }
    k = 0
    for name, count in plan.items():
        x[pos[k : k + count]] = values[name]
        k += count
    x = x.to(dtype)
    sub_below_fp16 = _subnormal(dtype) < torch.finfo(torch.float16).tiny
    counts = {
        NUMEL: n,
        NAN: plan["nan"],
        POSINF: plan["posinf"],
        NEGINF: plan["neginf"],
        ZERO: plan["pzero"] + plan["nzero"],
        SUBNORMAL: plan["sub"],
        UNDERFLOW: plan["below_fp16"] + (plan["sub"] if sub_below_fp16 else 0),
    }
    return x, counts


def _oracle_moments(x: torch.Tensor) -> dict[int, float]:
    """Extremes and moments of the finite values, in float64."""
    v = x.double().reshape(-1)
    v = v[torch.isfinite(v)]
    return {
        ABSMAX: v.abs().max().item(),
        MIN: v.min().item(),
        MAX: v.max().item(),
        SUM: v.sum().item(),
        SUMSQ: v.square().sum().item(),
        -1: v.abs().sum().item(),  # scale of the sum tolerance
    }


def _assert_rows_match(got: torch.Tensor, want: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Exact columns bitwise; SUM within SUM_RTOL * sum|x|, SUMSQ within SUM_RTOL relative."""
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape == (len(tensors), N_STATS)
    assert torch.equal(got[:, EXACT], want[:, EXACT])
    for i, t in enumerate(tensors):
        v = t.detach().double().reshape(-1).cpu()
        scale = v[torch.isfinite(v)].abs().sum().item()
        assert abs(got[i, SUM] - want[i, SUM]) <= SUM_RTOL * scale + 1e-300, i
        assert abs(got[i, SUMSQ] - want[i, SUMSQ]) <= SUM_RTOL * want[i, SUMSQ] + 1e-300, i


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_planted_counts_and_moments(dtype: torch.dtype) -> None:
    # programs of 32768 values: the first holds every special value, the second none (fast
    # pass over its full tiles) and ends with a partial tile
    x, counts = _planted(dtype, 3 * 16384 + 1000, seed=1)
    x = x.to(_device())
    row = tensor_stats([x], underflow_dtype=torch.float16, backend="triton")[0].cpu()
    for col, want in counts.items():
        assert row[col].item() == want, ts.STAT_NAMES[col]
    oracle = _oracle_moments(x.cpu())
    for col in (ABSMAX, MIN, MAX):
        assert row[col].item() == oracle[col], ts.STAT_NAMES[col]
    assert abs(row[SUM].item() - oracle[SUM]) <= SUM_RTOL * oracle[-1]
    assert abs(row[SUMSQ].item() - oracle[SUMSQ]) <= SUM_RTOL * oracle[SUMSQ]
    # without underflow_dtype the threshold is the tensor's own: UNDERFLOW == SUBNORMAL
    own = tensor_stats([x], backend="triton")[0].cpu()
    assert own[UNDERFLOW].item() == own[SUBNORMAL].item() == counts[SUBNORMAL]
    # an underflow dtype with a lower threshold than anything in fp32: nothing underflows
    assert tensor_stats([x], torch.float64, backend="triton")[0, UNDERFLOW].item() == 0


def test_planted_counts_reference_agrees() -> None:
    """The oracle itself gives the planted answer (both paths are checked against the plan)."""
    for dtype in KERNEL_DTYPES:
        x, counts = _planted(dtype, 5000, seed=2)
        row = tensor_stats_reference([x], underflow_dtype=torch.float16)[0]
        for col, want in counts.items():
            assert row[col].item() == want, (dtype, ts.STAT_NAMES[col])


def test_many_odd_sizes_mixed_dtypes_one_call() -> None:
    g = torch.Generator().manual_seed(3)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, *FP8]
    sizes = [0, 1, 3, 17, 255, 1000, 1025, 4097, 16385, 20000, (7, 13), (3, 5, 11), (0, 4)]
    tensors = []
    for i, size in enumerate(sizes * 2):
        shape = size if isinstance(size, tuple) else (size,)
        x = torch.randn(shape, generator=g) * 10 ** float(i % 5 - 2)
        flat = x.view(-1)
        if flat.numel() > 10 and i % 3 == 0:  # some tensors carry specials, others do not
            flat[1], flat[5], flat[-1] = float("nan"), float("-inf"), 0.0
        tensors.append(x.to(dtypes[i % len(dtypes)]).to(_device()))
    got = tensor_stats(tensors, underflow_dtype=torch.float16, backend="triton")
    want = tensor_stats_reference(tensors, underflow_dtype=torch.float16)
    _assert_rows_match(got, want, tensors)


def test_empty_tensors_give_identity_rows() -> None:
    dev = _device()
    tensors = [torch.empty(0, device=dev), torch.empty(0, 3, dtype=torch.bfloat16, device=dev)]
    got = tensor_stats(tensors, backend="triton").cpu()
    assert torch.equal(got, ts.empty_stats(2, "cpu"))


def test_strided_views() -> None:
    """Dense permutations are read in place; views with gaps are copied; both are correct."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(96, 80, generator=g).to(_device())
    base[3, 7] = float("inf")
    views = [base.t(), base[:, ::3], base[10:50, 5:70], base.view(12, 8, 80).permute(2, 0, 1)]
    got = tensor_stats(views, backend="triton")
    _assert_rows_match(got, tensor_stats_reference(views), views)


@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
def test_broadcast_views_are_measured_without_materializing(backend: str) -> None:
    """An expanded view counts each repeated element as often as it appears, without being
    copied: 10^12 elements (4 TB as a copy) from 10^6, and a small one checked against its
    copy."""
    dev = _device()
    g = torch.Generator().manual_seed(6)
    base = torch.randn(1, 1_000_000, generator=g).to(dev)
    base[0, :4] = torch.tensor([float("nan"), 0.0, float("inf"), -1e-40])
    huge = base.expand(1_000_000, -1)
    small_base = torch.randn(3, 1, 5, generator=g).to(dev, torch.bfloat16)
    small = small_base.expand(3, 7, 5).transpose(0, 2)  # stride 0 inside a permuted view
    got = tensor_stats([huge, base, small], backend=backend).cpu()
    one = tensor_stats_reference([base]).cpu()[0]
    for col in EXACT:
        repeat = 1 if col in (ABSMAX, MIN, MAX) else 10**6
        assert got[0, col] == one[col] * repeat, col
    assert got[0, SUM].item() == pytest.approx(one[SUM].item() * 10**6, rel=SUM_RTOL)
    assert got[0, SUMSQ].item() == pytest.approx(one[SUMSQ].item() * 10**6, rel=SUM_RTOL)
    _assert_rows_match(got[2:], tensor_stats_reference([small.contiguous()]), [small])


def test_deterministic_and_cache_tracks_data() -> None:
    """Same input, bitwise same row; new values at the same address are seen (cache = layout)."""
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(40000, generator=g).to(_device()), torch.randn(77, generator=g).to(_device())]
    first = tensor_stats(xs, backend="triton")
    assert torch.equal(first, tensor_stats(xs, backend="triton"))
    xs[0].mul_(2.0)
    xs[0][123] = float("nan")
    again = tensor_stats(xs, backend="triton")
    _assert_rows_match(again, tensor_stats_reference(xs), xs)
    assert again[0, NAN].item() == 1


def test_cached_table_follows_tensors_that_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same layout at new addresses (gradients after zero_grad(set_to_none=True)): the cached
    table is re-pointed, not rebuilt, and reads the new tensors, also when they move back."""
    builds = []
    build = ts._build_plan
    monkeypatch.setattr(ts, "_build_plan", lambda *a, **k: builds.append(1) or build(*a, **k))
    dev = _device()
    sizes = (40000, 77, 3000)
    a = [torch.full((n,), float(i + 1), device=dev) for i, n in enumerate(sizes)]
    b = [torch.full((n,), -float(i + 10), device=dev) for i, n in enumerate(sizes)]
    for xs, top in ((a, [1.0, 2.0, 3.0]), (b, [-10.0, -11.0, -12.0]), (a, [1.0, 2.0, 3.0])):
        out = tensor_stats(xs, backend="triton")
        assert out[:, MAX].tolist() == top
        assert out[:, NUMEL].tolist() == list(sizes)
    assert len(builds) <= 1  # 0 when an earlier test left this layout in the cache


@pytest.mark.parametrize("underflow", [None, torch.float16, torch.float64], ids=str)
def test_cpu_path_equals_the_reference(underflow) -> None:
    """The CPU path (a short path for tensors without NaN/Inf) gives the reference's rows: counts
    and extremes bitwise, sums up to float64 rounding order; planted tensors (with NaN/Inf) and
    finite ones of every dtype, with subnormals and zeros. (float64's threshold, below fp32's
    range, read as 0 on the short path: negative counts.)"""
    g = torch.Generator().manual_seed(11)
    tensors = []
    for i, dtype in enumerate([*KERNEL_DTYPES, torch.float32, torch.float64, torch.bfloat16]):
        x, _ = _planted(dtype, 1500 + 37 * i, seed=i)
        tensors.append(x)
    for dtype in [*KERNEL_DTYPES, torch.float64]:  # finite: the short path
        x = torch.randn(3000, generator=g).to(dtype)
        x[:7] = 0.0
        x[7:12] = _subnormal(dtype)
        x[12:15] = -torch.finfo(torch.float16).tiny / 8  # below fp16's smallest normal
        tensors.append(x)
    tensors.insert(3, torch.empty(0))
    tensors.append(torch.full((4,), float("nan")))  # no finite value
    got = ts.tensor_stats_cpu(tensors, underflow)
    want = tensor_stats_reference(tensors, underflow)
    assert torch.equal(got[:, EXACT], want[:, EXACT])
    torch.testing.assert_close(got[:, [SUM, SUMSQ]], want[:, [SUM, SUMSQ]], rtol=1e-12, atol=0)
    assert tensor_stats(tensors, underflow, backend="auto").equal(got)  # the CPU default


def test_sum_accuracy_float64_oracle_many_programs() -> None:
    """A small launch shape forces many programs and a multi-step finalize."""
    cfg = ts._Config(block=64, num_warps=1, min_iters=2, target_chunks=8, final_block=4)
    g = torch.Generator().manual_seed(6)
    x = (1.0 + torch.randn(9000, generator=g) * 1e-3).to(_device())  # large sum, no cancellation
    x[4444] = 0.0
    row = ts._tensor_stats_triton([x], cfg=cfg)[0].cpu()
    oracle = _oracle_moments(x.cpu())
    assert abs(row[SUM].item() - oracle[SUM]) <= SUM_RTOL * oracle[-1]
    assert math.isclose(row[SUMSQ].item(), oracle[SUMSQ], rel_tol=SUM_RTOL)
    assert (row[ZERO].item(), row[MIN].item()) == (1, 0.0)


def test_bf16_threshold_boundaries() -> None:
    """Values at and next to each threshold (zero, the smallest subnormal, bf16's and fp16's
    smallest normals), at odd and even positions of full tiles and in the masked tail, count
    exactly as the reference does."""
    tiny16 = 2.0**-14  # fp16's smallest normal, the underflow threshold
    below16 = torch.tensor(tiny16, dtype=torch.bfloat16).nextafter(torch.tensor(0.0)).item()
    values = [0.0, -0.0, 2.0**-133, -(2.0**-127), 2.0**-126, -below16, below16, tiny16, -tiny16]
    cfg = ts._Config(block=64, num_warps=1, min_iters=4, target_chunks=2, final_block=4)
    x = torch.ones(64 * 9 + 40, dtype=torch.bfloat16)
    for k, v in enumerate(values):
        x[k * 67] = v  # odd and even positions, every tile
        x[-1 - k] = v  # the tail
    x = x.to(_device())
    for uf in (torch.float16, None):
        got = ts._tensor_stats_triton([x], uf, cfg)
        _assert_rows_match(got, tensor_stats_reference([x], uf), [x])
    assert got[0, SUBNORMAL].item() == 4 and got[0, ZERO].item() == 4


@pytest.mark.parametrize("special", [float("inf"), float("-inf"), float("nan"), 3e38])
def test_one_special_value_alone_in_a_full_tile(special: float) -> None:
    """The fast pass finds a chunk to re-read from its lanes' sums alone: a single +Inf, -Inf
    or NaN must be found; finite values whose fp32 sum overflows (3e38 + 3e38) take the exact
    pass too and must still count as finite (their SUM is +inf: the documented fp32 limit)."""
    cfg = ts._Config(block=64, num_warps=1, min_iters=4, target_chunks=2, final_block=4)
    x = torch.ones(600)
    x[70] = special
    if special == 3e38:
        x[70 + 64] = special  # same lane, next tile: the lane's fp32 sum overflows
    x = x.to(_device())
    got = ts._tensor_stats_triton([x], cfg=cfg)
    if special == 3e38:
        assert torch.equal(got[:, EXACT].cpu(), tensor_stats_reference([x])[:, EXACT].cpu())
        assert got[0, SUM].item() == got[0, SUMSQ].item() == math.inf
    else:
        _assert_rows_match(got, tensor_stats_reference([x]), [x])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sumsq_of_finite_values_is_finite_where_float64_holds_it(dtype: torch.dtype) -> None:
    """2e19 squared passes fp32's 3.4e38: the reference and the CPU path square in float64, as
    the docstring promises (only the GPU kernel's fp32 partials may read +inf)."""
    x = torch.tensor([2e19, 1.0, -3.0], dtype=dtype)
    want = sum(v * v for v in x.double().tolist())
    for row in (tensor_stats_reference([x])[0], ts.tensor_stats_cpu([x])[0]):
        assert row[SUMSQ].item() == want


def test_backend_selection_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.tensor([1.0, float("nan")])
    assert torch.equal(tensor_stats([x], backend="auto"), tensor_stats_reference([x]))
    with pytest.raises(ValueError, match="backend must be"):
        tensor_stats([x], backend="cuda")
    with pytest.raises(TypeError, match="floating-point"):
        tensor_stats([torch.ones(3, dtype=torch.int32, device=_device())], backend="triton")
    with pytest.raises(ValueError, match="at least one"):
        tensor_stats([], backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        tensor_stats([x], backend="triton")


@requires_gpu
def test_gpu_auto_is_triton_and_never_syncs() -> None:
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(s, generator=g).cuda() for s in (3000, 5, 70000)]
    xs[2][9] = float("-inf")
    xs.append(torch.randn(100, generator=g).to("cuda", torch.bfloat16))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # table build (miss), hits
            got = tensor_stats(xs, underflow_dtype=torch.float16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_rows_match(got, tensor_stats_reference(xs, torch.float16), xs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_one_layout_on_two_gpus_gets_a_table_on_each():
    """A model split over two GPUs with the same gradient layout on each: the cached table of
    the first device must not serve the second (its launch failed: no gradient statistics)."""
    g = torch.Generator().manual_seed(0)
    host = [torch.randn(64, generator=g), torch.randn(8, generator=g)]
    for dev in ("cuda:0", "cuda:1"):
        rows = ts.tensor_stats([t.to(dev) for t in host], backend="triton")
        assert rows.device == torch.device(dev)
        want = ts.tensor_stats(host, backend="torch")
        torch.testing.assert_close(rows.cpu(), want, rtol=1e-5, atol=1e-6)
