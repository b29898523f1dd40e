"""Warm-started power iteration against planted spectra and torch.linalg.matrix_norm(ord=2).

Every test runs the torch path and, where a device can run Triton kernels (the CPU interpreter or
a GPU), the Triton path too. Matrices are small: the interpreter runs each program in Python.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from numwatch.kernels import power_iteration as pi
from numwatch.kernels.power_iteration import PowerIteration, head_views, qk_logit_bound
from numwatch.testing import kernel_devices, requires_gpu

BACKENDS = [("torch", "cpu")] + [("triton", d) for d in kernel_devices()[:1]]


def _planted(m: int, k: int, spectrum: list[float], seed: int) -> torch.Tensor:
    """U diag(s) V^T with orthonormal U (m, r), V (k, r): singular values exactly ``spectrum``."""
    g = torch.Generator().manual_seed(seed)
    r = len(spectrum)
    u, _ = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(k, r, generator=g, dtype=torch.float64))
    return (u * torch.tensor(spectrum, dtype=torch.float64)) @ v.T


def _sigma(a: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(a.double().cpu(), ord=2)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_planted_spectra_converge(backend: str, device: str) -> None:
    a = _planted(48, 40, [5.0, 1.5, 1.0, 0.2], seed=1).float()
    b = _planted(33, 70, [2.0, 0.6, 0.5], seed=2).to(torch.bfloat16)  # odd sizes, bf16
    c = _planted(40, 64, [0.7, 0.2], seed=3).float().t()  # column-major view (read transposed)
    # pass 1 splits these rows in 2 segments (1024 + 76); the top direction lives in the second
    tall = torch.cat([_planted(1024, 8, [0.5, 0.3], seed=4), _planted(76, 8, [2.0, 0.2], seed=9)])
    tall = tall.half()
    wide = _planted(8, 1500, [4.0, 1.0], seed=5).float()  # 24 column blocks
    mats = [m.to(device) for m in (a, b, c, tall, wide)]
    est = PowerIteration(backend=backend).step(mats, iters=6).cpu()
    want = torch.stack([_sigma(m) for m in mats]).float()
    assert est.dtype == torch.float32 and est.shape == (5,)
    # gap s2/s1 <= 0.3: the error after 6 iterations is ~0.3**24, below fp32 rounding
    torch.testing.assert_close(est, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_warm_start_tracks_slow_drift(backend: str, device: str, monkeypatch) -> None:
    """Trained-like matrix (noise + close top directions): one iteration per step suffices once
    warm, and the first call warms up (WARMUP_ITERS), where one iteration from scratch is far
    off: estimates started low and "grew" for ~10 calls on constant weights."""
    g = torch.Generator().manual_seed(4)
    signal = _planted(64, 48, [6.0, 5.4, 2.0], seed=5)
    noise = torch.randn(64, 48, generator=g, dtype=torch.float64) * 0.1
    drift = torch.randn(64, 48, generator=g, dtype=torch.float64) * 2e-3
    warm = PowerIteration(iters=1, backend=backend)
    errors = []
    for t in range(30):
        a = (signal + noise + t * drift).float().to(device)
        est = warm.step([a])[0].item()
        errors.append(abs(est - _sigma(a).item()) / _sigma(a).item())
    monkeypatch.setattr(pi, "WARMUP_ITERS", 1)
    cold = PowerIteration(iters=1, backend=backend, seed=1).step([a])[0].item()
    assert abs(cold - _sigma(a).item()) / _sigma(a).item() > 0.01
    assert max(errors) < 0.01  # within 1 % from the first call, every step


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_shape_change_reinitializes_only_that_entry(backend: str, device: str) -> None:
    a = _planted(24, 20, [3.0, 1.0], seed=6).float().to(device)
    b = _planted(16, 16, [2.0, 0.5], seed=7).float().to(device)
    c = _planted(30, 12, [4.0, 3.5, 1.0], seed=8).float().to(device)
    p, q = PowerIteration(backend=backend), PowerIteration(backend=backend)
    p.step([a, b], iters=2)
    q.step([a, b], iters=2)
    after_change = p.step([a, c], iters=1).cpu()
    continued = q.step([a, b], iters=1).cpu()
    torch.testing.assert_close(after_change[0], continued[0], rtol=1e-6, atol=0)  # a kept its u
    est = p.step([a, c], iters=30).cpu()
    torch.testing.assert_close(est[1], _sigma(c).float(), rtol=1e-4, atol=0)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_weights_moved_to_new_storage_are_not_kept_alive(backend: str, device: str) -> None:
    """model.half() / .double() gives the same Parameters new storage: the layout of the old one
    is never met again, and its cached views held a full copy of every old weight."""
    ws = [
        torch.nn.Parameter(_planted(16, 12, [2.0, 1.0], seed=s).float().to(device)) for s in (1, 2)
    ]
    est = PowerIteration(backend=backend)
    est.step(ws, iters=2)
    old = {w.untyped_storage().data_ptr() for w in ws}
    for w in ws:
        w.data = w.data.half() if backend == "triton" else w.data.double()
    out = est.step(ws, iters=30).cpu()
    held = est._state[1].views
    assert not any(v.untyped_storage().data_ptr() in old for v in held)
    torch.testing.assert_close(out, torch.tensor([2.0, 2.0]), rtol=1e-2, atol=0)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_matrices_stay_swappable(backend: str, device: str) -> None:
    """torch.utils.swap_tensors (model.to, load_state_dict) refuses a tensor with a weak
    reference: the iteration kept one to each matrix. A swapped matrix is read anew."""
    w = torch.nn.Parameter(_planted(16, 12, [2.0, 1.0], seed=1).float().to(device))
    est = PowerIteration(backend=backend)
    est.step([w], iters=30)
    torch.utils.swap_tensors(w, torch.nn.Parameter(w.detach() * 3.0))
    torch.testing.assert_close(
        est.step([w], iters=30).cpu(), torch.tensor([6.0]), rtol=1e-4, atol=0
    )


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_per_head_norms_of_fused_qkv_and_linear(backend: str, device: str) -> None:
    d, n_head = 32, 4
    dh = d // n_head
    # GPT-2 Conv1D c_attn weight (d, 3d): y = x @ W; head h of Q is the column block h
    w = torch.zeros(d, 3 * d, dtype=torch.float64)
    for h in range(2 * n_head + n_head):  # Q, K, V heads with distinct spectra
        w[:, h * dh : (h + 1) * dh] = _planted(d, dh, [1.0 + h, 0.4 + 0.1 * h], seed=10 + h)
    w = w.float().to(device)
    qk = head_views(w[:, : 2 * d], 2 * n_head, out_dim=1)  # (8, d, dh), strided, no copy
    assert qk.data_ptr() == w.data_ptr()
    # nn.Linear q_proj weight (d_out, d_in): head h is the row block h
    wq = torch.cat([_planted(dh, d, [2.0 + h, 1.0], seed=30 + h) for h in range(n_head)])
    wq = wq.float().to(device)
    # top-two gaps >= 2: eight iterations from scratch converge below fp32 rounding
    est = PowerIteration(backend=backend).step([qk, head_views(wq, n_head, out_dim=0)], iters=8)
    want_qk = [_sigma(w[:, h * dh : (h + 1) * dh]) for h in range(2 * n_head)]
    want_q = [_sigma(wq[h * dh : (h + 1) * dh]) for h in range(n_head)]
    want = torch.stack(want_qk + want_q).float()
    torch.testing.assert_close(est.cpu(), want, rtol=1e-4, atol=0)
    bound = qk_logit_bound(est[:n_head], est[n_head : 2 * n_head], dh**-0.5).cpu()
    want_bound = torch.tensor([(1.0 + h) * (5.0 + h) * dh**-0.5 for h in range(n_head)])
    torch.testing.assert_close(bound, want_bound, rtol=2e-4, atol=0)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_zero_and_nonfinite_matrices_restart(backend: str, device: str) -> None:
    good = _planted(20, 12, [3.0, 1.0], seed=40).float().to(device)
    p = PowerIteration(backend=backend)
    assert p.step([torch.zeros_like(good)]).item() == 0.0
    bad = good.clone()
    bad[3, 4] = float("nan")
    assert torch.isnan(p.step([bad])).item()
    # the vectors restarted from their initial values instead of staying NaN / zero
    assert abs(p.step([good], iters=20).item() - 3.0) < 1e-4


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
@pytest.mark.parametrize("magnitude", [1e-33, 1e-25, 1e25, 1e33])
def test_tiny_and_huge_weights_read_their_sigma(backend: str, device: str, magnitude: float):
    """Weights far outside 1 (where ||A v||^2 underflows or overflows float32) read their sigma:
    the per-matrix power-of-two scale keeps the squares near 1. Before it, 1e-25 read 0 and 1e25
    NaN. The bf16 copy has the same exponent range."""
    a = _planted(40, 24, [3.0, 1.0], seed=41) * magnitude
    mats = [a.float().to(device), a.to(torch.bfloat16).to(device)]
    est = PowerIteration(backend=backend).step(mats, iters=12).cpu().double()
    want = torch.stack([_sigma(m) for m in mats])
    torch.testing.assert_close(est / magnitude, want / magnitude, rtol=1e-5, atol=0)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_a_weight_shrinking_by_1e4_per_step_is_tracked(backend: str, device: str) -> None:
    """One iteration per step follows a weight across 32 orders of magnitude: each step's scale
    comes from the previous estimate."""
    a = _planted(30, 20, [2.0, 0.5], seed=42)
    p = PowerIteration(backend=backend)
    p.step([a.float().to(device)], iters=10)
    for t in range(1, 9):
        scaled = (a * 1e-4**t).float().to(device)
        est = p.step([scaled]).item()
        assert est == pytest.approx(_sigma(scaled).item(), rel=1e-5, abs=0)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
@pytest.mark.parametrize("final", [1e-25, 1e22])
def test_a_weight_far_from_its_first_scale_recovers_from_a_nan(backend, device, final):
    """A restart took the scale back to the first call's: a weight that had drifted to 1e-25
    (1e22) read 0 (NaN) for ever after one NaN iteration."""
    a = _planted(8, 6, [2.0, 0.5], seed=43).float()
    p = PowerIteration(backend=backend)
    f = final ** (1 / 40)
    for t in range(1, 41):
        p.step([(a * f**t).to(device)])
    w = (a * f**40).to(device)
    assert torch.isnan(p.step([torch.full_like(w, float("nan"))])).item()
    est = [p.step([w]).item() for _ in range(3)]
    assert est[-1] == pytest.approx(_sigma(w).item(), rel=1e-4, abs=0)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_a_zero_initialized_weight_is_read_once_it_trains(backend, device):
    """A zero weight (an output projection initialized to 0) grows its scale while it reads 0;
    bounded, so the first nonzero values (1e-3 here, or 10) are read at once, not NaN."""
    for scale in (1e-3, 10.0):
        p = PowerIteration(backend=backend)
        zero = torch.zeros(8, 6, device=device)
        assert [p.step([zero]).item() for _ in range(6)] == [0.0] * 6
        w = (_planted(8, 6, [2.0, 0.5], seed=44) * scale).float().to(device)
        est = [p.step([w]).item() for _ in range(4)]
        assert all(math.isfinite(e) for e in est)
        assert est[-1] == pytest.approx(_sigma(w).item(), rel=1e-4, abs=0)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_age_counts_iterations_since_a_restart_and_warm_up_converges(backend, device):
    """A weight that reads 0 (zero-initialized) or NaN restarts its vector: its first estimates
    once it trains were ~20 % low and crept up at one iteration a call, while the first call
    warmed up. ``age`` tells the restart, ``warm_up()`` gives the next call the warm-up."""
    w = _planted(64, 48, [2.0, 1.9, 1.8, 1.7], seed=3).float().to(device)
    p = PowerIteration(backend=backend)
    p.step([torch.zeros_like(w), w])
    assert p.age.tolist() == [0.0, 30.0]  # the first call warms up: 30 iterations
    low = p.step([w, w])
    assert p.age.tolist() == [1.0, 31.0]
    assert low[0].item() < 0.99 * 2.0  # one iteration from the restart vector (CUDA: 1.963)
    p.warm_up()
    est = p.step([w, w])
    assert p.age.tolist() == [31.0, 61.0]
    torch.testing.assert_close(est.cpu(), torch.tensor([2.0, 2.0]), rtol=1e-3, atol=0)
    p.step([torch.full_like(w, float("nan")), w])
    assert p.age.tolist() == [0.0, 62.0]


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_view_with_no_contiguous_dim_is_copied(backend: str, device: str) -> None:
    base = _planted(40, 36, [2.0, 0.5], seed=50).float().to(device)
    view = base[::2, ::3]  # neither dim has stride 1
    est = PowerIteration(backend=backend).step([view], iters=30)
    torch.testing.assert_close(est.cpu()[0], _sigma(view).float(), rtol=1e-4, atol=0)


@pytest.mark.skipif(len(BACKENDS) < 2, reason="no device can run Triton kernels")
def test_triton_and_torch_paths_agree() -> None:
    device = BACKENDS[1][1]
    mats = [
        _planted(50, 30, [1.0, 0.9, 0.8], seed=60).float(),
        torch.randn(2, 24, 40, generator=torch.Generator().manual_seed(61)),
    ]
    mats = [m.to(device) for m in mats]
    p, q = PowerIteration(backend="torch"), PowerIteration(backend="triton")
    for _ in range(3):  # same seed, same start: the paths differ only by fp32 rounding
        torch.testing.assert_close(q.step(mats), p.step(mats), rtol=1e-5, atol=0)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="iters"):
        PowerIteration(iters=0)
    for iters in (0, -1):  # the Triton path returned uninitialised memory, the torch one raised
        with pytest.raises(ValueError, match="step iters must be >= 1"):  # an UnboundLocalError
            PowerIteration().step([torch.ones(3, 3)], iters=iters)
    with pytest.raises(ValueError, match="backend"):
        PowerIteration(backend="cuda")
    with pytest.raises(ValueError, match="2-D matrices or 3-D"):
        PowerIteration().step([torch.ones(3)])
    with pytest.raises(ValueError, match="do not split"):
        head_views(torch.ones(10, 6), 4)


@requires_gpu
def test_gpu_auto_is_triton_and_never_syncs() -> None:
    w = _planted(256, 768, [3.0, 1.0, 0.5], seed=70).float().cuda()
    qkv = torch.cat([_planted(256, 64, [2.0 + h, 1.0], seed=71 + h) for h in range(12)], dim=1)
    heads = head_views(qkv.float().cuda()[:, :512], 8, out_dim=1)  # (8, 256, 64) strided
    p = PowerIteration()
    p.step([w, heads])  # vectors and table built
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        est = p.step([w, heads], iters=10)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = torch.tensor([3.0] + [2.0 + h for h in range(8)])
    torch.testing.assert_close(est.cpu(), want, rtol=1e-4, atol=0)


# ------------------------------------------------------------------------- one read per iteration


def _float64_iteration(a: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(v', sigma) of one iteration from unit v, in float64: v' = A^T A v / ||A^T A v||."""
    a, v = a.double().cpu(), v.double().cpu()
    w = a @ v
    z = a.T @ w
    return z / z.norm(), (z.norm() / w.norm()).item()


@pytest.mark.parametrize("finish_segs", [16, 2])
@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_one_iteration_is_v_to_AtAv(
    backend: str, device: str, finish_segs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each call maps every unit v to A^T A v / ||A^T A v|| and reports ||A^T A v|| / ||A v||,
    with rows split over several programs and blocks of rows (a small tile config), and the
    segments' ||w||^2 read by the finishing program in one load or in several (2 at a time)."""
    if backend == "torch" and finish_segs != 16:
        pytest.skip("the finish is the Triton path's")
    monkeypatch.setattr(pi, "_FINISH_SEGS", finish_segs)
    g = torch.Generator().manual_seed(21)
    mats = [
        torch.randn(70, 24, generator=g),  # 70 rows: 5 segments of 16, the last one partial
        torch.randn(3, 33, 40, generator=g).to(torch.bfloat16),  # odd rows, a batch
        torch.randn(9, 130, generator=g).half(),  # rows padded to 256 in registers
    ]
    mats = [m.to(device) for m in mats]
    p = PowerIteration(backend=backend)
    p._cfg = pi._Config(tile=64, elems=300, num_warps=4, stages=2)
    flat = [a for m in mats for a in (m if m.dim() == 3 else m[None])]
    for _ in range(3):
        v = p._vec.v.clone() if p._vec is not None else None
        est = p.step(mats).cpu()
        if v is None:
            continue
        vs = v.cpu().split([a.shape[1] for a in flat])
        new = p._vec.v.cpu().split([a.shape[1] for a in flat])
        for j, a in enumerate(flat):
            want_v, want_sigma = _float64_iteration(a, vs[j])
            torch.testing.assert_close(new[j].double(), want_v, rtol=0, atol=2e-5)
            assert est[j].item() == pytest.approx(want_sigma, rel=2e-5)
    if backend == "triton":
        plan = p._state[1].plan
        assert plan is not None and plan.n_tiles > len(flat)  # several segments really ran
        assert not plan.done.any()  # every matrix's count was reset by its finishing program


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_estimate_is_a_lower_bound_that_rises(backend: str, device: str) -> None:
    a = _planted(60, 50, [3.0, 2.8, 1.0], seed=22).float().to(device)  # slow gap
    p = PowerIteration(backend=backend)
    est = [p.step([a]).item() for _ in range(60)]
    assert all(e <= 3.0 * (1 + 1e-6) for e in est)
    assert all(b >= a_ * (1 - 1e-6) for a_, b in itertools.pairwise(est))
    assert est[-1] == pytest.approx(3.0, rel=1e-3)


def test_torch_path_batches_at_most_group_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same-shape matrices are batched into float32 copies of at most GROUP_BYTES (a whole
    model's weights are not copied at once); the estimates do not depend on the cut."""
    g = torch.Generator().manual_seed(24)
    mats = [torch.randn(20, 12, generator=g) for _ in range(5)]
    mats.append(torch.randn(3, 20, 12, generator=g))
    whole = PowerIteration(backend="torch")
    want = [whole.step(mats) for _ in range(3)]
    monkeypatch.setattr(pi, "GROUP_BYTES", 2 * 20 * 12 * 4)  # two matrices per batch
    cut = PowerIteration(backend="torch")
    for w in want:
        torch.testing.assert_close(cut.step(mats), w, rtol=1e-6, atol=0)
    assert pi._chunks([m if m.dim() == 3 else m[None] for m in mats], list(range(6))) == [
        [0, 1],
        [2, 3],
        [4],
        [5],  # a batch of 3 is larger than the cap: whole, alone
    ]


@pytest.mark.skipif(len(BACKENDS) < 2, reason="no device can run Triton kernels")
def test_rows_longer_than_a_program_holds_run_on_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Matrices with rows over MAX_ROW go through torch, the others through Triton, in one call
    and in list order; the estimates and vectors are those of the torch path."""
    device = BACKENDS[1][1]
    monkeypatch.setattr(pi, "MAX_ROW", 32)
    g = torch.Generator().manual_seed(23)
    mats = [
        torch.randn(20, 40, generator=g),  # long rows: torch
        torch.randn(2, 16, 24, generator=g),  # Triton
        torch.randn(20, 40, generator=g).t(),  # read transposed: rows of 40, torch
        torch.randn(30, 8, generator=g).bfloat16(),  # Triton
    ]
    mats = [m.to(device) for m in mats]
    split, ref = PowerIteration(backend="triton"), PowerIteration(backend="torch")
    for _ in range(5):  # on a GPU, steps 3-5 replay the split step as a CUDA graph
        torch.testing.assert_close(split.step(mats), ref.step(mats), rtol=1e-5, atol=0)
    torch.testing.assert_close(split._vec.v, ref._vec.v, rtol=0, atol=1e-6)
    assert torch.equal(split._vec.c, ref._vec.c)
    state = split._state[1]
    assert state.plan is not None and state.plan.n_mats == 3 and state.rest == [0, 2]


def test_a_moved_weight_s_new_layout_is_cached(monkeypatch) -> None:
    """After a weight moved to new storage (same shape), the state was rebuilt at every step
    (no cache entry was made for the new layout: on CUDA no graph was ever captured)."""
    calls = []
    prepare = PowerIteration._prepare
    monkeypatch.setattr(
        PowerIteration, "_prepare", lambda self, m: calls.append(1) or prepare(self, m)
    )
    a = torch.randn(16, 16)
    p = PowerIteration(backend="torch")
    for _ in range(3):
        p.step([a])
    moved = a.clone()
    for _ in range(3):
        p.step([moved])
    assert len(calls) == 2
