"""Attention statistics: the Triton kernel and the chunked torch path against a float64 oracle.

Planted inputs are dyadic (small integers times powers of two) so that every score is exact in
fp32 whatever the summation order, and planted gaps to the row max sit at least 2^-13 away from
the saturation thresholds: fp32 rounding cannot flip a count, so counts are compared exactly.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from numwatch.kernels import attention_stats as A
from numwatch.testing import devices, host_never_waits, kernel_devices, requires_gpu

IMPLS = [("torch", d) for d in devices()] + [("triton", d) for d in kernel_devices()]
COUNTS = [A.ROWS, A.REPEATED_MAX_ROWS, A.TIE_ENTRIES, A.SATURATED_ROWS, A.SATURATED_ENTRIES]
THR64 = {
    torch.bfloat16: math.log1p(-(2.0**-9)),
    torch.float16: math.log1p(-(2.0**-12)),
    torch.float32: 0.0,
}
# (inside, outside) planted gaps below the row max, in S units, per saturation dtype
GAPS = {
    torch.bfloat16: (2.0**-10, 2.0**-8),
    torch.float16: (2.0**-13, 2.0**-11),
    torch.float32: (None, 2.0**-12),
}


# ------------------------------------------------------------------------------------------
# float64 oracle on materialized tensors
# ------------------------------------------------------------------------------------------


def oracle_from_scores(S: torch.Tensor, sat: torch.dtype, entropy: bool = True) -> torch.Tensor:
    """S (B, H, Tq, Tk) float64 with -inf where masked -> (H, N_HEAD_STATS)."""
    H, Tk = S.shape[1], S.shape[-1]
    out = torch.zeros(H, A.N_HEAD_STATS, dtype=torch.float64)
    for h in range(H):
        Sh = S[:, h].reshape(-1, Tk).cpu()
        mx = Sh.amax(-1)
        ok = mx > float("-inf")
        Sh, mx = Sh[ok], mx[ok]
        ties = (Sh == mx[:, None]).sum(-1)
        satn = (Sh - mx[:, None] >= THR64[sat]).sum(-1)
        p = torch.softmax(Sh, -1)
        ent = -torch.where(p > 0, p * p.log(), 0.0).sum(-1)
        unmasked = Sh[Sh > float("-inf")]
        out[h, A.ROWS] = ok.sum()
        out[h, A.REPEATED_MAX_ROWS] = (ties >= 2).sum()
        out[h, A.TIE_ENTRIES] = ties.sum()
        out[h, A.SATURATED_ROWS] = (satn >= 2).sum()
        out[h, A.SATURATED_ENTRIES] = satn[satn >= 2].sum()
        out[h, A.MAX_LOGIT] = unmasked.max() if unmasked.numel() else float("-inf")
        out[h, A.MIN_LOGIT] = unmasked.min() if unmasked.numel() else float("inf")
        has = entropy and ent.numel() > 0
        out[h, A.ENTROPY_SUM] = ent.sum() if entropy else 0.0
        out[h, A.ENTROPY_MIN] = ent.min() if has else float("inf")
    return out


def oracle(q, k, *, mask=None, causal=False, scale=None, rows=None, batch=None, sat=None,
           entropy=True):  # fmt: skip
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kk = k.double().repeat_interleave(Hq // Hkv, 1)
    S = scale * (q.double() @ kk.transpose(-1, -2))
    valid = torch.ones(B, Hq, Tq, Tk, dtype=torch.bool, device=q.device)
    if causal:
        valid &= torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        if mask.dtype == torch.bool:
            valid &= mask
        else:
            valid &= mask > torch.finfo(mask.dtype).min
            S = S + mask.double()
    S = S.masked_fill(~valid, float("-inf"))
    if batch is not None:
        S = S[batch]
    if rows is not None:
        S = S[:, :, rows]
    return oracle_from_scores(S, sat or torch.bfloat16, entropy)


def assert_stats(got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.cpu()
    assert got.dtype == torch.float64 and got.shape == want.shape
    torch.testing.assert_close(got[:, COUNTS], want[:, COUNTS], rtol=0, atol=0)
    lim = [A.MAX_LOGIT, A.MIN_LOGIT]
    torch.testing.assert_close(got[:, lim], want[:, lim], rtol=1e-6, atol=0)
    # entropy: fp32 running sums over a row vs float64 softmax
    torch.testing.assert_close(got[:, A.ENTROPY_SUM], want[:, A.ENTROPY_SUM], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[:, A.ENTROPY_MIN], want[:, A.ENTROPY_MIN], rtol=0, atol=1e-4)


def stats(impl, q, k, **kw):
    backend, device = impl
    move = {n: (v.to(device) if isinstance(v, torch.Tensor) else v) for n, v in kw.items()}
    return A.attention_head_stats(q.to(device), k.to(device), backend=backend, **move)


# ------------------------------------------------------------------------------------------
# planted inputs
# ------------------------------------------------------------------------------------------


def planted(plan, *, B=2, Hq=4, Tq=48, Tk=48, D=16, dtype=torch.bfloat16, sat=torch.bfloat16,
            seed=0):  # fmt: skip
    """q (B, Hq, Tq, D), k (B, len(plan), Tk, D) with scale 1/sqrt(16) = 0.25.

    Background entries are in {-1/4, 0, 1/4}: background scores stay below 0.25. Dim 0 carries
    the planted top score 0.25 * (2 * 4) = 2; dim 1 (q = 1) shifts a planted key below it by an
    exact gap. plan[kv_head] = {"tie": positions at the max, "in": positions inside the
    saturation window of `sat`, "out": positions just outside it}.
    """
    g = torch.Generator().manual_seed(seed)
    scale = 1.0 / math.sqrt(D)
    q = torch.randint(-1, 2, (B, Hq, Tq, D), generator=g).double() / 4
    k = torch.randint(-1, 2, (B, len(plan), Tk, D), generator=g).double() / 4
    q[..., 0], q[..., 1] = 2.0, 1.0
    k[..., 0], k[..., 1] = 0.0, 0.0
    inside, outside = GAPS[sat]
    for hk, p in enumerate(plan):
        for kind, gap in (("tie", 0.0), ("in", inside), ("out", outside)):
            for pos in p.get(kind, ()):
                k[:, hk, pos] = 0.0
                k[:, hk, pos, 0] = 4.0
                k[:, hk, pos, 1] = -gap / scale
    assert torch.equal(q.to(dtype).double(), q) and torch.equal(k.to(dtype).double(), k)
    return q.to(dtype), k.to(dtype)


PLAN = [
    {"tie": [5], "in": [20, 33], "out": [40]},  # one max, two saturated companions
    {"tie": [3, 17, 30], "out": [9, 44]},  # three tied maxima
]


# ------------------------------------------------------------------------------------------
# head statistics
# ------------------------------------------------------------------------------------------


def test_columns_and_names_agree():
    assert len(A.HEAD_STAT_NAMES) == A.N_HEAD_STATS and len(A.ERR_STAT_NAMES) == A.N_ERR_STATS
    cols = [A.ROWS, *COUNTS[1:], A.MAX_LOGIT, A.MIN_LOGIT, A.ENTROPY_SUM, A.ENTROPY_MIN]
    assert cols == list(range(A.N_HEAD_STATS))
    err_cols = [A.ERR_SUM, A.ERR_ABS_SUM, A.ERR_SQ_SUM, A.ERR_COUNT, A.ERR_EXCESS_COHERENT_SUM]
    assert list(range(A.N_ERR_STATS)) == err_cols
    assert A.saturation_threshold(torch.float32) == 0.0
    thr = A.saturation_threshold(torch.bfloat16)
    assert torch.tensor(thr, dtype=torch.float32).item() == thr  # an fp32 constant
    # the threshold is where exp() starts rounding to exactly 1.0 in bf16
    e = torch.tensor([thr + 1e-6, thr - 1e-6], dtype=torch.float64).exp().to(torch.bfloat16)
    assert e.tolist() == [1.0, 1.0 - 2.0**-8]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "dtype,sat",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float16),
    ],
)
def test_planted_counts_exact(impl, dtype, sat):
    plan = [dict(p) for p in PLAN]
    if GAPS[sat][0] is None:  # fp32: only exact ties saturate
        plan[0].pop("in")
    q, k = planted(plan, dtype=dtype, sat=sat)
    got = stats(impl, q, k, saturation_dtype=sat)
    want = oracle(q, k, sat=sat)
    n = 2 * 48  # B * Tq rows per head
    n_sat0 = 1 + len(plan[0].get("in", ()))
    hand = {  # closed form, per q head (heads 0, 1 -> kv 0; 2, 3 -> kv 1)
        A.ROWS: [n] * 4,
        A.REPEATED_MAX_ROWS: [0, 0, n, n],
        A.TIE_ENTRIES: [n, n, 3 * n, 3 * n],
        A.SATURATED_ROWS: [n if n_sat0 >= 2 else 0] * 2 + [n, n],
        A.SATURATED_ENTRIES: [n * n_sat0 if n_sat0 >= 2 else 0] * 2 + [3 * n, 3 * n],
        A.MAX_LOGIT: [2.0] * 4,
    }
    for col, vals in hand.items():
        assert want[:, col].tolist() == vals  # the oracle agrees with the closed form
    assert_stats(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_causal_gqa_odd_lengths_and_sampling(impl):
    plan = [
        {"tie": [2, 40], "in": [15, 70], "out": [33]},
        {"tie": [36], "in": [37], "out": [1, 60]},
    ]
    q, k = planted(plan, B=2, Hq=4, Tq=77, Tk=77, seed=1)
    q[:, 1, 10:20, 0] = 0.0  # rows whose max is a background score
    got = stats(impl, q, k, is_causal=True)
    assert_stats(got, oracle(q, k, causal=True))
    rows = torch.tensor([76, 0, 39, 40, 41, 12, 75])
    batch = torch.tensor([1])
    got = stats(impl, q, k, is_causal=True, rows=rows, batch=batch)
    assert_stats(got, oracle(q, k, causal=True, rows=rows, batch=batch))
    assert got[:, A.ROWS].tolist() == [7.0] * 4


# the interpreter warns when it scales finfo.min mask values (masked anyway) by 1 / scale
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("impl", IMPLS)
def test_padding_masks_and_fully_masked_rows(impl):
    plan = [{"tie": [4, 45], "in": [30], "out": [8]}, {"tie": [60, 61], "in": [2]}]
    q, k = planted(plan, B=2, Hq=2, Tq=40, Tk=70, seed=2)
    keep = torch.ones(2, 1, 1, 70, dtype=torch.bool)
    keep[1, ..., 50:] = False  # batch 1 pads keys 50..69: it loses a tie in head 0, both in head 1
    for mask in (
        keep,
        torch.zeros(keep.shape).masked_fill(~keep, float("-inf")).to(torch.bfloat16),
        torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min),
    ):
        assert_stats(stats(impl, q, k, attn_mask=mask), oracle(q, k, mask=mask))
    # fully masked query rows are excluded from everything, ROWS included
    rowmask = keep.expand(2, 1, 40, 70).clone()
    rowmask[0, :, [3, 7]] = False
    got = stats(impl, q, k, attn_mask=rowmask)
    assert_stats(got, oracle(q, k, mask=rowmask))
    assert got[:, A.ROWS].tolist() == [78.0, 78.0]
    # an additive bias that is not a mask shifts the scores (dyadic, so still exact)
    bias = (torch.arange(70) % 3 - 1).to(torch.float32) / 8
    got = stats(impl, q, k, attn_mask=bias, batch=torch.tensor([0]))
    assert_stats(got, oracle(q, k, mask=bias, batch=torch.tensor([0])))


@pytest.mark.parametrize("impl", IMPLS)
def test_max_arriving_in_a_later_tile(impl):
    """Entries saturated relative to an early, lower max must be recounted or dropped.

    Per head, keys in the first tile sit just below the final max, which arrives at key 200
    (a later tile for every tile width up to 128). u = 2^-13; bf16 window = 16u.
    """
    u = 2.0**-13
    early = [
        [(1, -10 * u), (3, -20 * u)],  # window held a non-tie below the old max: exact recount
        [(1, -10 * u), (3, -10 * u)],  # old window = two ties, both inside the final window
        [(1, -40 * u), (3, -40 * u)],  # old window outside the final one: dropped
    ]
    q, k = planted([{"tie": [200]}] * 3, B=1, Hq=3, Tq=8, Tk=260, seed=3)
    k = k.double()
    for h, keys in enumerate(early):
        for pos, gap in keys:
            k[:, h, pos] = 0.0
            k[:, h, pos, 0] = 4.0
            k[:, h, pos, 1] = gap / 0.25
    k = k.to(torch.bfloat16)
    got = stats(impl, q, k)
    want = oracle(q, k)
    assert want[:, A.SATURATED_ENTRIES].tolist() == [16.0, 24.0, 0.0]  # 8 rows x (2, 3, 1)
    assert want[:, A.TIE_ENTRIES].tolist() == [8.0, 8.0, 8.0]
    assert_stats(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_repeated_maxima_past_the_64th_key_tile(impl):
    """Repeated maxima in a key tile past the 64th (for tile widths up to 64), alone or tied
    with a key in the first tile: any per-tile bookkeeping (tile indices, bit masks) must hold.

    S = k[:, 0] + k[:, 1] (q = (1, 1), scale 1): a background of distinct values per tile, far
    below the planted maxima 8, so that no other tile holds two entries near a running max.
    """
    Tk, D = 4128, 16
    k = torch.zeros(1, 2, Tk, D)
    k[..., 0] = -2.0 - torch.arange(Tk) % 200
    inside = -(2.0**-10)  # in the bf16 window (2^-9)
    for h, (ties, near) in enumerate((([4100, 4101], [4105]), ([5, 4100], [6, 4101]))):
        k[0, h, ties + near, 0] = 8.0
        k[0, h, near, 1] = inside
    q = torch.zeros(1, 2, 4, D)
    q[..., :2] = 1.0
    got = stats(impl, q.bfloat16(), k.bfloat16(), scale=1.0).cpu()
    assert got[:, A.TIE_ENTRIES].tolist() == [8.0, 8.0]  # 4 rows x 2 ties
    assert got[:, A.REPEATED_MAX_ROWS].tolist() == [4.0, 4.0]
    assert got[:, A.SATURATED_ENTRIES].tolist() == [12.0, 16.0]
    assert got[:, A.MAX_LOGIT].tolist() == [8.0, 8.0]


@pytest.mark.parametrize("impl", IMPLS)
def test_row_max_near_zero(impl):
    """Scores of a few 2^-14: row maxima within 2|thr| of 0 (rows recounted entry by entry)."""
    g = torch.Generator().manual_seed(4)
    q = (torch.randint(-2, 3, (1, 2, 40, 16), generator=g) / 64).to(torch.bfloat16)
    k = (torch.randint(-2, 3, (1, 2, 50, 16), generator=g) / 64).to(torch.bfloat16)
    got = stats(impl, q, k)
    want = oracle(q, k)
    assert want[:, A.SATURATED_ROWS].min() > 0
    assert_stats(got, want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("sat", [torch.bfloat16, torch.float32])
def test_zero_and_subnormal_row_maxima(impl, sat):
    """Rows whose max is 0 (zero queries: every entry tied, in every tile) or about 2^-123 (a
    max within 2|thr| of 0, whose ulp is subnormal: recounted entry by entry); the other rows
    of the same blocks keep their counts."""
    g = torch.Generator().manual_seed(6)
    q = (torch.randint(-4, 5, (2, 3, 70, 16), generator=g) / 4).to(torch.float32)
    k = (torch.randint(-4, 5, (2, 3, 90, 16), generator=g) / 4).to(torch.float32)
    q[:, 0, 5:40] = 0.0  # S == 0 everywhere in these rows
    q[:, 1, ::3] = 0.0
    q[:, 2, :, 1:] = 0.0  # head 2: S = q0 * k0 / 4, multiples of 2^-124 (normal floats)
    q[:, 2, :, 0] = 2.0**-60
    k[:, 2, :, 0] *= 2.0**-60
    for causal in (False, True):
        got = stats(impl, q, k, is_causal=causal, saturation_dtype=sat)
        want = oracle(q, k, causal=causal, sat=sat)
        zero_row_entries = sum(i + 1 for i in range(5, 40)) if causal else 35 * 90
        assert want[0, A.TIE_ENTRIES] >= 2 * zero_row_entries
        assert_stats(got, want)


def _next_up(x: torch.Tensor, n: int = 1) -> torch.Tensor:
    for _ in range(abs(n)):
        x = torch.nextafter(x, torch.tensor(math.copysign(math.inf, n), dtype=x.dtype))
    return x


@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_rounding_at_the_saturation_boundary(impl):
    """Saturation is fp32(S - max) >= thr with thr an fp32 constant, also where that
    subtraction rounds. Scores are planted as exact fp32 values (q = e0, k[j] = v_j e0,
    scale 1) and the answer is that definition evaluated entry by entry in fp32.

    Heads 0, 1: max +-48, where fp32(max + thr) rounds down: entries one float either side.
    Head 2: max just above -thr, where S - max is inexact: 1.5 * 2^-33 < fp32(max + thr)
    saturates, 2^-34 does not.
    Head 3: two ties at thr, then the max 0 in a later tile (for any tile width): exactly at
    the threshold, the old ties stay saturated.
    Head 4: logits of 2^70, two tied (the GPU's counting trick needs a bound below 2^64).
    """
    thr = torch.tensor(A.saturation_threshold(torch.bfloat16), dtype=torch.float32)
    rows = []
    for m in (torch.tensor(48.0), torch.tensor(-48.0)):
        c = m + thr
        assert c.double() < m.double() + thr.double()  # rounded down
        rows.append([m, _next_up(c, -1), c, _next_up(c), _next_up(c, 2)])
    m = _next_up(-thr)
    rows.append([m, torch.tensor(1.5 * 2.0**-33), torch.tensor(2.0**-34), m + thr])
    rows.append([thr, thr, torch.tensor(0.0)])
    big = torch.tensor(2.0**70)
    rows.append([big, _next_up(big, -1), big])
    Tk, D = 210, 16
    k = torch.full((1, 5, Tk, D), 0.0)
    k[..., 0] = -1000.0
    want_sat = []
    for h, vals in enumerate(rows):
        v = torch.stack(vals).float()
        k[0, h, [3, 9, 200, 33, 38][: len(v)], 0] = v
        want_sat.append(((v - v.max()) >= thr).sum().item())
    q = torch.zeros(1, 5, 5, D)
    q[..., 0] = 1.0
    got = stats(impl, q, k, scale=1.0).cpu()
    assert want_sat == [3, 3, 3, 3, 2]
    assert got[:, A.SATURATED_ENTRIES].tolist() == [5.0 * n for n in want_sat]
    assert got[:, A.TIE_ENTRIES].tolist() == [5.0] * 4 + [10.0]


def _bf16_chunks(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (..., ) as three bf16 parts (..., 3) whose fp32 sum is exactly x: with q's
    first three dims 1, q . k adds them exactly in any order (every partial sum fits 24 bits)."""
    parts = []
    rest = x.double()
    for _ in range(3):
        part = rest.to(torch.bfloat16, copy=True)
        part = torch.where(part.double().abs() > rest.abs(), _toward_zero(part), part)
        parts.append(part)
        rest = rest - part.double()
    assert rest.eq(0).all()
    return torch.stack(parts, -1)


def _toward_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x.float(), torch.zeros_like(x.float())).to(torch.bfloat16)


def _least_at_least(f, b: torch.Tensor, near: torch.Tensor) -> torch.Tensor:
    """The smallest fp32 x with f(x) >= b, for f monotone and the answer within 8 floats of
    ``near``."""
    x = _next_up(near, -8)
    assert f(x) < b and f(_next_up(near, 8)) >= b
    while f(x) < b:
        x = _next_up(x)
    return x


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [0.3, 1 / math.sqrt(128)])
def test_fp32_rounding_of_a_general_scale(impl, scale):
    """S = fp32(fp32(QK^T) * scale): distinct products that round to one S value tie, and the
    saturation boundary is met in S, one float apart, in one key tile or across several.

    QK^T values: the max X, whose S the float below X shares (a tie); P, the least product
    whose S saturates; the floats below P, which do not. Head 0 has X, X-, P, P-, P-- in one
    key tile; head 1 in separate tiles with the max last; head 2 is head 1 negated; head 3 has
    X, then P- in a later tile; head 4 X and P in one tile, where (at scale 0.3) P lies below
    fp32(bound / scale), the bound's image through the reciprocal of the scale; head 5 X, then
    X- in a later tile.
    """
    thr = torch.tensor(A.saturation_threshold(torch.bfloat16), dtype=torch.float32)
    c = torch.tensor(scale, dtype=torch.float32)

    def big(x):
        return x * c

    def edges(sign: int, below_reciprocal: bool) -> tuple[torch.Tensor, ...]:
        # S just above a power of two: its floats are coarser than the products' there
        X = sign * torch.tensor(32.3, dtype=torch.float32) / c
        for _ in range(100):
            M = big(X)
            bound = _least_at_least(lambda s, M=M: s - M, thr, M + thr)
            P = _least_at_least(big, bound, bound / c)
            tie = big(_next_up(X, -1)) == M
            if tie and (not below_reciprocal or bound * (1 / c) > P):
                return X, P
            X = _next_up(X)
        raise AssertionError("no such max within 100 floats")

    X, P = edges(1, False)
    Xn, Pn = edges(-1, False)
    Xp, Pp = edges(1, scale == 0.3)
    plans = [
        ([X, _next_up(X, -1), P, _next_up(P, -1), _next_up(P, -2)], [100, 101, 102, 103, 104]),
        ([X, _next_up(X, -1), P, _next_up(P, -1), _next_up(P, -2)], [200, 3, 40, 70, 150]),
        ([Xn, _next_up(Xn, -1), Pn, _next_up(Pn, -1), _next_up(Pn, -2)], [200, 3, 40, 70, 150]),
        ([X, _next_up(P, -1)], [3, 200]),
        ([Xp, Pp], [100, 101]),
        ([X, _next_up(X, -1)], [3, 200]),
    ]
    want = [(2, 3), (2, 3), (2, 3), (1, 1), (1, 2), (2, 2)]
    Tk, D = 210, 16
    k = torch.zeros(1, len(plans), Tk, D)
    k[..., 0] = -1000.0  # background: far below every window
    for h, (vals, pos) in enumerate(plans):
        k[0, h, pos, 0:3] = _bf16_chunks(torch.stack(vals)).float()
        k[0, h, pos, 3:] = 0.0
    q = torch.zeros(1, len(plans), 6, D)
    q[..., 0:3] = 1.0
    got = stats(impl, q.bfloat16(), k.bfloat16(), scale=scale).cpu()
    for h, (vals, _) in enumerate(plans):
        row = big(torch.stack([*vals, torch.tensor(-1000.0)]))
        ties, sat = int((row == row.max()).sum()), int((row - row.max() >= thr).sum())
        assert (ties, sat) == want[h]
        assert got[h, A.TIE_ENTRIES] == 6 * ties and got[h, A.REPEATED_MAX_ROWS] == 6 * (ties > 1)
        assert got[h, A.SATURATED_ENTRIES] == (6 * sat if sat > 1 else 0)
        assert got[h, A.MAX_LOGIT] == row.max().double()
        assert got[h, A.MIN_LOGIT] == row.min().double()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [None, -0.3])
def test_dyadic_random_general_scale(impl, scale):
    """D = 32: the default scale 1/sqrt(32) is no power of two (S is multiplied in the loop)."""
    g = torch.Generator().manual_seed(5)
    q = (torch.randint(-8, 9, (2, 2, 33, 32), generator=g) / 8).to(torch.bfloat16)
    k = (torch.randint(-8, 9, (2, 1, 45, 32), generator=g) / 8).to(torch.bfloat16)
    k[:, :, 20] = k[:, :, 7]  # a repeated key: ties wherever it holds the row max
    for causal in (False, True):
        got = stats(impl, q, k, scale=scale, is_causal=causal)
        assert_stats(got, oracle(q, k, scale=scale, causal=causal))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [None, 0.25])
def test_every_key_twice(impl, scale):
    """Every key next to its copy: every row max is tied, and nearly every key tile holds a row
    with two entries at its running max (the statistics kernel's worst case for its cost:
    bench/bench_attention_stats.py's stats_all_rows_tied). 2200 keys: past the 64th tile for
    tile widths up to 32."""
    g = torch.Generator().manual_seed(7)
    q = (torch.randint(-8, 9, (1, 2, 40, 32), generator=g) / 8).to(torch.bfloat16)
    k = (torch.randint(-8, 9, (1, 2, 2200, 32), generator=g) / 8).to(torch.bfloat16)
    k[:, :, 1::2] = k[:, :, 0::2]
    for causal in (False, True):
        got = stats(impl, q, k, scale=scale, is_causal=causal)
        want = oracle(q, k, scale=scale, causal=causal)
        if not causal:  # (causal rows may end between a key and its copy)
            assert want[:, A.REPEATED_MAX_ROWS].tolist() == [40.0, 40.0]
        assert_stats(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_entropy_off_and_empty_sample(impl):
    q, k = planted(PLAN)
    full = stats(impl, q, k)
    off = stats(impl, q, k, entropy=False).cpu()
    torch.testing.assert_close(off[:, : A.ENTROPY_SUM], full[:, : A.ENTROPY_SUM].cpu())
    assert off[:, A.ENTROPY_SUM].eq(0).all() and off[:, A.ENTROPY_MIN].eq(float("inf")).all()
    empty = stats(impl, q, k, rows=torch.empty(0, dtype=torch.long)).cpu()
    assert empty[:, COUNTS].eq(0).all() and empty[:, A.ENTROPY_SUM].eq(0).all()
    assert empty[:, A.MAX_LOGIT].eq(float("-inf")).all()
    assert empty[:, A.MIN_LOGIT].eq(float("inf")).all()


def test_torch_path_chunks_give_the_same_answer():
    q, k = planted(PLAN, Tq=33)
    whole = A.attention_head_stats(q, k, backend="torch", is_causal=True)
    one_row = A.attention_head_stats(q, k, backend="torch", is_causal=True, memory_budget=1)
    assert torch.equal(whole, one_row)


def test_score_head_stats_matches_oracle():
    """Eager attention: statistics of the materialized softmax input, masks already added."""
    q, k = planted(PLAN, Tq=20)
    scores = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / 4).float()
    scores[:, :, :, 40:] = torch.finfo(torch.float32).min  # HF eager's masked value
    scores[0, :, 5] = float("-inf")  # a fully masked row
    S = scores.double().masked_fill(scores <= torch.finfo(torch.float32).min, float("-inf"))
    assert_stats(A.score_head_stats(scores), oracle_from_scores(S, torch.bfloat16))
    rows = torch.tensor([5, 6])
    assert_stats(
        A.score_head_stats(scores, rows=rows), oracle_from_scores(S[:, :, rows], torch.bfloat16)
    )


@pytest.mark.parametrize("pattern", ["fp16_added", "bf16_upcast"])
def test_score_head_stats_sees_mask_values_that_no_longer_read_as_finfo_min(pattern):
    """Eager attention in fp16 adds finfo(fp16).min to scores (20 + -65504 rounds to -65472, above
    the minimum); MPT masks bf16 scores with finfo(bf16).min and runs softmax on .float() (above
    fp32's minimum). Both were counted as real logits: padded rows counted as rows (repeated-max,
    saturated) and attn_min_logit read -65472 or -3.4e38."""
    T = 6
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(1, 2, T, T, generator=g) * 4 + 20
    keep = torch.ones(T, T, dtype=torch.bool).tril()
    keep[:, 0] = False  # a left pad: row 0 sees nothing
    if pattern == "fp16_added":
        mask = torch.where(keep, 0.0, torch.finfo(torch.float16).min).half()
        scores = raw.half() + mask
    else:
        scores = raw.bfloat16().masked_fill(~keep, torch.finfo(torch.bfloat16).min).float()
    S = scores.double().masked_fill(~keep, float("-inf"))
    assert_stats(A.score_head_stats(scores), oracle_from_scores(S, torch.bfloat16))


def test_score_head_stats_of_fp16_eager_masks_with_logits_up_to_32736():
    """fp16 eager attention adds finfo(fp16).min = -65504 to the scores: a masked entry with a
    score above 504 left -65504 + s above the old floor (-65000) and counted as a logit
    (attn_min_logit -64992, a fully padded row counted in attn_rows)."""
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    keep[:, 0] = False  # a left pad: row 0 sees nothing
    raw = torch.tensor([600.0, 32736.0, -1000.0, 2000.0]).expand(1, 1, 4, 4)  # (B, H, Tq, Tk)
    scores = raw.half() + torch.where(keep, 0.0, torch.finfo(torch.float16).min).half()
    got = A.score_head_stats(scores)[0]
    assert got[A.ROWS] == 3  # rows 1-3; row 0 fully masked
    assert (got[A.MAX_LOGIT], got[A.MIN_LOGIT]) == (32736.0, -1000.0)
    S = raw.double().masked_fill(~keep, float("-inf"))
    assert_stats(A.score_head_stats(scores), oracle_from_scores(S, torch.bfloat16))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_a_mask_with_is_causal_applies_both(impl, kind):
    """SDPA's CPU path takes a mask together with is_causal: both apply (their AND)."""
    q, k = planted(PLAN, Tq=20)
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(20, 48, generator=g) > 0.3
    keep[3] = False  # a fully masked row
    if kind == "bool":
        mask = keep
    else:
        mask = torch.randn(20, 48, generator=g).masked_fill(~keep, float("-inf"))
    got = stats(impl, q, k, attn_mask=mask, is_causal=True)
    assert_stats(got, oracle(q, k, mask=mask, causal=True))


@pytest.mark.parametrize("device", devices())
def test_output_error_of_a_mask_with_is_causal(device):
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g) for _ in range(3))
    keep = torch.rand(12, 12, generator=g) > 0.4
    keep[:, 0] = True  # no fully masked row
    out = reference_output(q, k, v, mask=keep, causal=True) + 0.5
    e = A.attention_output_error(
        *(t.to(device) for t in (q, k, v, out)), attn_mask=keep.to(device), is_causal=True
    ).cpu()
    torch.testing.assert_close(
        e[:, A.ERR_SUM] / e[:, A.ERR_COUNT], torch.full((2,), 0.5, dtype=torch.float64)
    )


def test_argument_errors():
    q, k = planted(PLAN)
    with pytest.raises(ValueError, match="backend"):
        A.attention_head_stats(q, k, backend="cuda")
    with pytest.raises(ValueError, match="multiple"):
        A.attention_head_stats(q[:, :3], k)
    with pytest.raises(ValueError, match="saturation_dtype"):
        A.attention_head_stats(q, k, saturation_dtype=torch.float64)


EMPTY = {A.MAX_LOGIT: float("-inf"), A.MIN_LOGIT: float("inf"), A.ENTROPY_MIN: float("inf")}


def assert_empty(got: torch.Tensor) -> None:
    """The statistics of no rows: counts and ENTROPY_SUM 0, the max and min columns at their
    identities."""
    want = torch.zeros(got.shape, dtype=torch.float64)
    for col, val in EMPTY.items():
        want[:, col] = val
    assert torch.equal(got.cpu(), want)


@pytest.fixture
def device_indices(monkeypatch):
    """Index tensors as a GPU has them: no host range check (it would cost a sync), so indices
    out of range reach the implementations."""
    monkeypatch.setattr(A, "_check_index", lambda name, idx, n: None)


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_device_indices_are_not_sampled(impl, device_indices):
    """Rows and batch elements out of range are skipped, identically in both paths: never read
    (the kernel would read outside q and the mask) and never counted."""
    q, k = planted(PLAN, B=2, Hq=4, Tq=40, Tk=48)
    rows, batch = torch.tensor([39, 40, -1, 0, 1000]), torch.tensor([1, 2, -1])
    in_range = {"rows": torch.tensor([39, 0]), "batch": torch.tensor([1])}
    keep = torch.ones(2, 1, 40, 48, dtype=torch.bool)  # one mask row per query row
    keep[1, :, 39, 30:] = False
    for kw, oracle_kw in (({}, {}), ({"is_causal": True}, {"causal": True}),
                          ({"attn_mask": keep}, {"mask": keep})):  # fmt: skip
        got = stats(impl, q, k, rows=rows, batch=batch, **kw)
        assert_stats(got, oracle(q, k, **in_range, **oracle_kw))
        assert got[:, A.ROWS].tolist() == [2.0] * 4
    assert_empty(stats(impl, q, k, rows=torch.tensor([40, -40])))
    assert_empty(stats(impl, q, k, rows=torch.tensor([40, -40]), is_causal=True))
    assert_empty(stats(impl, q, k, batch=torch.tensor([2]), attn_mask=keep))


def test_score_head_stats_skips_out_of_range_device_indices(device_indices):
    q, k = planted(PLAN, Tq=20)
    scores = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / 4).float()
    got = A.score_head_stats(scores, rows=torch.tensor([3, 20, -1]), batch=torch.tensor([5, 1]))
    S = scores.double()[[1]][:, :, [3]]
    assert_stats(got, oracle_from_scores(S, torch.bfloat16))
    assert got[:, A.ROWS].tolist() == [1.0] * 4


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_host_indices_raise(impl):
    """Index tensors on the CPU are checked up front, whatever device q is on."""
    backend, device = impl
    q, k = (t.to(device) for t in planted(PLAN))  # B = 2, Tq = 48
    bad = [
        (
            {"rows": torch.tensor([0, 48, -1])},
            r"rows indices must lie in \[0, 48\), got \[48, -1\]",
        ),
        ({"batch": torch.tensor([2])}, r"batch indices must lie in \[0, 2\), got \[2\]"),
        ({"rows": torch.tensor([[0]])}, "1-D int64"),
        ({"batch": torch.tensor([0.0])}, "1-D int64"),
    ]
    scores = torch.zeros(2, 4, 48, 48)
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            A.attention_head_stats(q, k, backend=backend, **kw)
        with pytest.raises(ValueError, match=msg):
            A.score_head_stats(scores, **kw)
        with pytest.raises(ValueError, match=msg):
            A.attention_output_error(q, k, k, q, **kw)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_keys_no_rows_no_batch_give_the_empty_statistics(impl):
    q, k = (
        torch.ones(2, 4, 8, 16, dtype=torch.bfloat16),
        torch.ones(2, 2, 8, 16, dtype=torch.bfloat16),
    )
    no_keys = {"rows": torch.tensor([0, 7]), "batch": torch.tensor([1])}
    for qq, kk, kws in (
        (q, k[:, :, :0], [{}, {"is_causal": True}, no_keys]),
        (q, k[:, :, :0], [{"attn_mask": torch.ones(2, 1, 8, 0, dtype=torch.bool)}]),
        (q[:, :, :0], k, [{}, {"is_causal": True}]),
        (q[:0], k[:0], [{}, {"batch": torch.empty(0, dtype=torch.long)}]),
    ):
        for kw in kws:
            assert_empty(stats(impl, qq, kk, **kw))
    for shape in ((2, 4, 8, 0), (2, 4, 0, 8), (0, 4, 8, 8)):
        assert_empty(A.score_head_stats(torch.zeros(shape)))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_mask_that_does_not_broadcast_is_refused_up_front(impl):
    backend, device = impl
    q, k = (t.to(device) for t in planted(PLAN))  # B = 2, Hq = 4, Tq = Tk = 48
    for shape in ((3, 48), (3, 1, 1, 48), (48, 47), (1, 2, 4, 48, 48)):
        mask = torch.ones(shape, dtype=torch.bool, device=device)
        with pytest.raises(ValueError, match=r"does not broadcast to \(B, Hq, Tq, Tk\)"):
            A.attention_head_stats(q, k, attn_mask=mask, backend=backend)
        with pytest.raises(ValueError, match=r"does not broadcast to \(B, Hq, Tq, Tk\)"):
            A.attention_output_error(q, k, k, q, attn_mask=mask)


def test_head_dim_zero_is_refused():
    """No score exists (the default scale 1/sqrt(D) does not either)."""
    q, k = planted(PLAN)
    for scale in (None, 1.0):
        with pytest.raises(ValueError, match="head dim"):
            A.attention_head_stats(q[..., :0], k[..., :0], scale=scale)
        with pytest.raises(ValueError, match="head dim"):
            A.attention_output_error(q[..., :0], k[..., :0], k, q, scale=scale)


@requires_gpu
def test_gpu_autotuned_path_and_torch_memory_bound():
    """Big enough to autotune (and to tune for every mode); the torch path at T = 8192 stays
    within its memory budget instead of materializing B*H*T*T."""
    g = torch.Generator().manual_seed(6)
    q = (torch.randint(-8, 9, (4, 16, 1024, 64), generator=g) / 8).to(torch.bfloat16).cuda()
    k = (torch.randint(-8, 9, (4, 16, 1024, 64), generator=g) / 8).to(torch.bfloat16).cuda()
    for causal in (False, True):
        got = A.attention_head_stats(q, k, is_causal=causal, backend="triton")
        want = A.attention_head_stats(q, k, is_causal=causal, backend="torch")
        torch.testing.assert_close(got[:, COUNTS], want[:, COUNTS], rtol=0, atol=0)
        torch.testing.assert_close(got[:, 5:], want[:, 5:], rtol=1e-4, atol=1e-3)
    q8 = torch.randn(1, 2, 8192, 64, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    A.attention_head_stats(q8, q8, is_causal=True, backend="torch")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    full = 2 * 8192 * 8192 * 4  # S alone, fp32, if materialized
    assert peak < 0.75 * full, peak


# ------------------------------------------------------------------------------------------
# output error
# ------------------------------------------------------------------------------------------


def reference_output(q, k, v, *, mask=None, causal=False):
    _B, Hq, Tq, D = q.shape
    g = Hq // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    S = (q.double() @ kk.transpose(-1, -2)) / math.sqrt(D)
    valid = torch.ones_like(S, dtype=torch.bool)
    if causal:
        valid &= torch.ones(Tq, k.shape[2], dtype=torch.bool).tril()
    if mask is not None:
        valid &= mask
    return torch.softmax(S.masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0) @ vv


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("c", [0.5, -0.25])
def test_output_error_planted_offset(device, c):
    """out = O_ref + c: bias exactly sign(c), rms |c|; fully masked rows excluded."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 30, 16, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA
    mask = torch.ones(2, 1, 30, 30, dtype=torch.bool)
    mask[1, :, 4] = False  # one fully masked row in batch 1
    out = reference_output(q, k, v, mask=mask) + c
    e = A.attention_output_error(
        *(t.to(device) for t in (q, k, v, out)), attn_mask=mask.to(device)
    ).cpu()
    assert e[:, A.ERR_COUNT].tolist() == [59 * 16.0] * 4
    torch.testing.assert_close(
        e[:, A.ERR_SUM] / e[:, A.ERR_ABS_SUM],
        torch.full((4,), math.copysign(1.0, c), dtype=torch.float64),
        rtol=0,
        atol=1e-9,
    )
    rms = (e[:, A.ERR_SQ_SUM] / e[:, A.ERR_COUNT]).sqrt()
    torch.testing.assert_close(
        rms, torch.full((4,), abs(c), dtype=torch.float64), rtol=1e-6, atol=0
    )
    sampled = A.attention_output_error(
        q, k, v, out, attn_mask=mask, rows=torch.tensor([4, 5]), batch=torch.tensor([1])
    )
    assert sampled[:, A.ERR_COUNT].tolist() == [16.0] * 4  # row 4 of batch 1 is masked


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("causal", [False, True])
def test_output_error_whole_path_equals_the_chunked_path(device, causal):
    """Calls without mask or row sampling take the one-piece path; a tiny memory budget forces
    the chunked one. Both measure the same planted error (GQA, odd lengths, Tq != Tk)."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(3, 4, 21, 16, generator=g)
    k, v = (torch.randn(3, 2, 27, 16, generator=g) for _ in range(2))
    ref = reference_output(q, k, v, causal=causal)
    offset = torch.where(torch.rand(ref.shape, generator=g) < 0.7, 0.25, -0.5)
    out = (ref + offset).to(device)
    q, k, v = (t.to(device) for t in (q, k, v))
    # float64 on a CPU; fp32 on a GPU, where the two paths round O_ref differently (~1e-7 each)
    tol = {"rtol": 1e-9, "atol": 1e-9} if device == "cpu" else {"rtol": 1e-5, "atol": 1e-3}
    torch_path = {"is_causal": causal, "backend": "torch"}  # on a GPU "auto" takes the kernel
    whole = A.attention_output_error(q, k, v, out, **torch_path).cpu()
    chunked = A.attention_output_error(q, k, v, out, memory_budget=1, **torch_path).cpu()
    torch.testing.assert_close(whole, chunked, **tol)
    assert whole[:, A.ERR_COUNT].tolist() == [3 * 21 * 16.0] * 4
    per_head = offset.double().sum((0, 2, 3))
    torch.testing.assert_close(whole[:, A.ERR_SUM], per_head, **tol)
    one = A.attention_output_error(q, k, v, out, batch=torch.tensor([2]), **torch_path).cpu()
    torch.testing.assert_close(one[:, A.ERR_SUM], offset[2].double().sum((1, 2)), **tol)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize(
    "shape", [(2, 4, 2, 21, 27, 16, 16, True), (1, 3, 3, 33, 33, 24, 40, False)]
)
def test_output_error_kernel_equals_the_torch_path(device, shape):
    """The one-launch kernel (fp32 online softmax) against the float64 torch path on planted
    errors: bf16 inputs, GQA, odd and unequal lengths, head dims off a power of two, Dv != D,
    a sampled batch element."""
    B, Hq, Hkv, Tq, Tk, D, Dv, causal = shape
    g = torch.Generator().manual_seed(13)
    q = torch.randn(B, Hq, Tq, D, generator=g).bfloat16()
    k = torch.randn(B, Hkv, Tk, D, generator=g).bfloat16()
    v = torch.randn(B, Hkv, Tk, Dv, generator=g).bfloat16()
    ref = reference_output(q.double(), k.double(), v.double(), causal=causal)
    offset = torch.where(torch.rand(ref.shape, generator=g) < 0.7, 1e-2, -3e-2)
    out = (ref + offset).float()
    oracle = A.attention_output_error(q, k, v, out, is_causal=causal, backend="torch")
    args = (t.to(device) for t in (q, k, v, out))
    got = A.attention_output_error(*args, is_causal=causal, backend="triton").cpu()
    assert got[:, A.ERR_COUNT].tolist() == [B * Tq * Dv * 1.0] * Hq
    # fp32 O_ref: ~1e-7 per entry against errors of 1e-2
    torch.testing.assert_close(got[:, :3], oracle[:, :3], rtol=1e-4, atol=1e-4)
    col = A.ERR_EXCESS_COHERENT_SUM
    torch.testing.assert_close(got[:, col], oracle[:, col], rtol=1e-4, atol=1e-4)
    planted = offset.double()
    coherent = planted.sum((0, 2)).abs().sum(-1)  # per head: sum over dims of |sum over rows|
    torch.testing.assert_close(got[:, A.ERR_EXCESS_COHERENT_SUM], coherent, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got[:, A.ERR_SUM], planted.sum((0, 2, 3)), rtol=1e-3, atol=1e-3)
    one = A.attention_output_error(
        *(t.to(device) for t in (q, k, v, out)), is_causal=causal, batch=torch.tensor([B - 1]),
        backend="triton",
    ).cpu()  # fmt: skip
    torch.testing.assert_close(one[:, A.ERR_SUM], planted[B - 1].sum((1, 2)), rtol=1e-3, atol=1e-3)
    no_keys = [t[:, :, :0].to(device) for t in (k, v)]  # every row fully masked: excluded
    for backend in ("torch", "triton"):
        empty = A.attention_output_error(q.to(device), *no_keys, out.to(device), backend=backend)
        assert empty.cpu().tolist() == [[0.0] * A.N_ERR_STATS] * Hq


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("path", ["chunked", "whole", "kernel"])
def test_output_error_systematic_part_sees_mixed_sign_errors_not_rounding(device, path):
    """ERR_EXCESS_COHERENT_SUM / ERR_ABS_SUM: an error of fixed size whose sign depends only on
    the output dim (as V of mixed signs gives) makes it exactly 1 while the signed bias cancels
    to 0; independent random signs per entry give about 1/sqrt(rows); a correctly rounded bf16
    output gives 0 although its rounding error is not."""
    if path == "kernel" and device not in kernel_devices():
        pytest.skip("no device can run Triton kernels")
    g = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=g) for _ in range(3))
    ref = reference_output(q, k, v, causal=True)
    signs = torch.tensor([1.0, -1.0] * 8, dtype=torch.float64)
    noise = torch.where(torch.rand(ref.shape, generator=g) < 0.5, 1.0, -1.0).double()
    kw = {
        "chunked": {"memory_budget": 1, "backend": "torch"},
        "whole": {"backend": "torch"},
        "kernel": {"backend": "triton"},
    }[path]
    outs = {"mixed signs": ref + 1e-2 * signs, "noise": ref + 1e-2 * noise}
    outs = {name: out.float() if path == "kernel" else out for name, out in outs.items()}
    outs["rounded"] = ref.bfloat16()
    for name, out in outs.items():
        e = A.attention_output_error(
            *(t.to(device) for t in (q, k, v, out)), is_causal=True, **kw
        ).cpu()
        bias = e[:, A.ERR_SUM] / e[:, A.ERR_ABS_SUM]
        systematic = e[:, A.ERR_EXCESS_COHERENT_SUM] / e[:, A.ERR_ABS_SUM]
        if name == "mixed signs":
            assert bias.abs().max() < 1e-3
            torch.testing.assert_close(systematic, torch.ones_like(systematic), rtol=1e-3, atol=0)
        elif name == "noise":  # 128 rows: E|sum of 128 signs| / 128 is about 0.07
            assert systematic.max() < 0.2
        else:  # the fp32 reference of the kernel path may round a few ties the other way
            assert (e[:, A.ERR_ABS_SUM] > 0).all() and systematic.max() < 0.02, systematic


@pytest.mark.parametrize("device", devices())
def test_output_error_skips_out_of_range_device_indices(device, device_indices):
    """Each path (one piece, chunked, the kernel where it runs) measures the in-range
    indices only."""
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(3, 2, 10, 16, generator=g) for _ in range(3))
    offset = torch.where(torch.rand(3, 2, 10, 16, generator=g) < 0.5, 0.25, -0.5)
    out = (reference_output(q, k, v) + offset).float()
    q, k, v, out = (t.to(device) for t in (q, k, v, out))
    paths = [{"backend": "torch"}, {"backend": "torch", "memory_budget": 1}]
    paths += [{"backend": "triton"}] if device in kernel_devices() else []
    # the sums differ in order; on a GPU, fp32 products batched differently round differently
    tol = {"rtol": 1e-12, "atol": 1e-12} if device == "cpu" else {"rtol": 1e-5, "atol": 1e-4}
    for path in paths:
        for bad, good in (
            ({"batch": torch.tensor([2, 3, -1])}, {"batch": torch.tensor([2])}),
            ({"rows": torch.tensor([4, 10, -2])}, {"rows": torch.tensor([4])}),
        ):
            if "rows" in bad and path["backend"] == "triton":
                continue  # row sampling takes the chunked path
            got = A.attention_output_error(q, k, v, out, **path, **bad).cpu()
            want = A.attention_output_error(q, k, v, out, **path, **good).cpu()
            torch.testing.assert_close(got, want, **tol)
            assert got[0, A.ERR_COUNT] == (10 if "batch" in bad else 3) * 16


def test_output_error_path_choice(monkeypatch):
    """The probe's usual call (no mask, all rows, sampled batch) takes the one-piece path; a
    mask, row sampling or scores over the memory budget take the chunked one."""
    calls = []
    whole = A._output_error_whole
    monkeypatch.setattr(A, "_output_error_whole", lambda *a: calls.append(1) or whole(*a))
    q, k, v = (torch.randn(4, 2, 32, 8) for _ in range(3))
    out = torch.zeros_like(q)
    A.attention_output_error(q, k, v, out, is_causal=True, batch=torch.tensor([0]))
    assert len(calls) == 1
    A.attention_output_error(q, k, v, out, attn_mask=torch.ones(32, 32, dtype=torch.bool))
    A.attention_output_error(q, k, v, out, rows=torch.tensor([3]))
    A.attention_output_error(q, k, v, out, memory_budget=4 * 2 * 32 * 32 * 16 * 2 - 1)
    assert len(calls) == 1


def test_output_error_and_score_stats_ignore_the_users_autocast():
    """The probe runs inside the user's autocast forward: its fp32 recomputation must not be
    cast to bf16 (the matmuls of both output-error paths and of the torch statistics)."""
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(3))
    out = reference_output(q, k, v, causal=True).float() + 1e-3
    mask = torch.ones(2, 1, 40, 40, dtype=torch.bool).tril()

    def measure():
        f32 = torch.float32
        return (
            A.attention_output_error(q, k, v, out, is_causal=True, compute_dtype=f32),
            A.attention_output_error(q, k, v, out, attn_mask=mask, compute_dtype=f32),
            A.attention_head_stats(q, k, is_causal=True, backend="torch"),
        )

    plain = measure()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = measure()
    for a, b in zip(plain, under_autocast, strict=True):
        assert torch.equal(a, b)


def test_output_error_sees_the_cpu_flash_kernels_one_signed_error():
    """DESIGN.md §1: torch's CPU flash SDPA in bf16 on planted sink ties has bias ~ -1, while
    its math backend's error is not one-signed."""
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 1, 2, 256, 64
    q = torch.randn(B, H, T, D, generator=g) * 0.5
    k = torch.randn(B, H, T, D, generator=g) * 0.5
    q[..., 0], k[..., 0] = 4.0, 0.0
    k[:, :, :2] = 0.0  # two identical sink keys, 14 above the other logits
    k[:, :, :2, 0] = 14 / (4.0 / math.sqrt(D))
    v = torch.rand(B, H, T, D, generator=g) * 2 - 4  # V in [-4, -2)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    bias = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        e = A.attention_output_error(q, k, v, out, is_causal=True)
        bias[backend] = e[:, A.ERR_SUM] / e[:, A.ERR_ABS_SUM]
    assert (bias[SDPBackend.FLASH_ATTENTION] < -0.98).all(), bias
    assert (bias[SDPBackend.MATH].abs() < 0.3).all(), bias
    stats = A.attention_head_stats(q, k, is_causal=True, backend="torch")
    assert stats[:, A.REPEATED_MAX_ROWS].tolist() == [255.0, 255.0]  # row 0 sees one sink


@requires_gpu
def test_gpu_statistics_never_sync_after_the_first_call():
    """The host path of a sampled step (launch, per-block reduction, merges of several calls)
    issues no host sync: a list index into a device tensor, as the merges used, copies a CPU
    index tensor and waits for the GPU (about 0.1 ms a call on the H200)."""
    from numwatch.probes.attention import merge_heads

    g = torch.Generator(device="cuda").manual_seed(3)
    q, k = (
        torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "qk"
    )
    mask = torch.rand(2, 1, 1, 256, device="cuda", generator=g) > 0.1
    rows = torch.arange(0, 256, 3, device="cuda")
    calls = [
        {"is_causal": True},
        {"attn_mask": mask, "entropy": True},
        {"is_causal": True, "rows": rows},
    ]
    for kw in calls:  # compile (and tune) first
        A.attention_head_stats(q, k, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        parts = [A.attention_head_stats(q, k, **kw) for kw in calls]
        merged = merge_heads(parts)
        acc = A._merge_head_partials(parts[0], parts[1])
        empty = A._empty_head_stats(4, q.device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with host_never_waits():  # the waits inside the driver too
        again = merge_heads([A.attention_head_stats(q, k, **kw) for kw in calls])
    assert again.equal(merged)
    assert merged[:, A.MAX_LOGIT].equal(torch.stack([p[:, A.MAX_LOGIT] for p in parts]).amax(0))
    assert acc[:, A.MIN_LOGIT].equal(
        torch.minimum(parts[0][:, A.MIN_LOGIT], parts[1][:, A.MIN_LOGIT])
    )
    assert (empty[:, A.MAX_LOGIT] == -math.inf).all() and (empty[:, A.MIN_LOGIT] == math.inf).all()


_COMPILE_STATS = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from numwatch.kernels import attention_stats as A
mask_kind, causal, mul_scale, entropy = (int(x) for x in sys.argv[1:])
constants = dict(
    HAS_ROWS=True, HAS_BATCH=False, MASK_KIND=mask_kind, IS_CAUSAL=bool(causal),
    ENTROPY=bool(entropy), MUL_SCALE=bool(mul_scale), UPCAST=False,
    PRECISION="tf32", EVEN_D=True, BLOCK_M=64, BLOCK_N=128, BLOCK_D=64,
)
names = A._head_stats_kernel.arg_names
pointers = {"Q": "*bf16", "K": "*bf16", "MASK": "*u8" if mask_kind == 1 else "*bf16",
            "ROWS_IDX": "*i64", "BATCH_IDX": "*i64", "PART": "*fp64"}
floats = ("scale", "unit", "thr", "mask_floor")
signature = {n: pointers.get(n) or ("fp32" if n in floats else "i32") for n in names}
signature.update(dict.fromkeys(constants, "constexpr"))
kernel = triton.compile(ASTSource(A._head_stats_kernel, signature, constants),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
sys.stdout.write(kernel.asm["ptx"])
"""


@pytest.mark.parametrize(
    ("mask_kind", "causal", "mul_scale", "entropy"), [(0, 1, 1, 0), (2, 0, 0, 1)]
)
def test_statistics_kernel_compiles_to_sm90_code(mask_kind, causal, mul_scale, entropy):
    """The kernel as the GPU compiles it, in a fresh process (the interpreter runs code that a
    compile refuses, such as one name bound to two types in the branches of an if)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    flags = [str(x) for x in (mask_kind, causal, mul_scale, entropy)]
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE_STATS, *flags], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "wgmma.mma_async" in run.stdout and "set.ge.f32.f32" in run.stdout
