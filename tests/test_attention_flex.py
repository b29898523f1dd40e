"""Attention probe on torch.nn.attention.flex_attention: eager calls measured like the
equivalent SDPA call (planted answers), compiled calls said to be unmeasured.

Before, flex_attention calls were not seen at all: no attn_* series, no word, so a model with
flex attention looked like one whose attention had nothing to report.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import Fixed, Net

from numwatch.probes import flex as flex_probe
from numwatch.testing import planted_sink_attention

fa = pytest.importorskip("torch.nn.attention.flex_attention")

# Every statistic of a head but the output error's, which is that of each kernel's own output.
SCORE_STATS = (
    "attn_rows",
    "attn_repeated_max_rows",
    "attn_tie_entries",
    "attn_saturated_rows",
    "attn_saturated_entries",
    "attn_max_logit",
    "attn_min_logit",
    "attn_entropy_mean",
    "attn_entropy_min",
)


@pytest.fixture(autouse=True)
def _quiet_eager_flex():
    """Eager flex_attention warns that it is unfused: true, and beside the point here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def measure(make_monitor, fn, q, k, v, **overrides):
    overrides.setdefault("sinks__console__enabled", False)
    overrides.setdefault("sinks__jsonl__enabled", False)
    overrides.setdefault("attention__batch", 0)
    model = Net(Fixed(q, k, v, fn))
    monitor = make_monitor(model, flush_every=1, attention__every=1, **overrides).attach()
    out = model()
    monitor.step()
    monitor.detach()
    return monitor.snapshot(), out


def heads(snap, name, H, layer="block.attn"):
    return [snap.get(name, layer=layer, head=str(h)) for h in range(H)]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_flex_causal_block_mask_measures_as_sdpa_is_causal(
    make_monitor, caplog, monkeypatch, dtype
):
    monkeypatch.setattr(flex_probe, "_told_compiled", False)
    B, H, T = 2, 3, 9
    q, k, v = planted_sink_attention(B=B, H=H, T=T, D=16, n_sink=3, dtype=dtype)
    mask = fa.create_block_mask(causal, None, None, T, T, device="cpu")
    flex, _ = measure(
        make_monitor, lambda q, k, v: fa.flex_attention(q, k, v, block_mask=mask), q, k, v
    )
    sdpa, _ = measure(
        make_monitor,
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        q,
        k,
        v,
    )
    for name in SCORE_STATS:
        assert heads(flex, name, H) == heads(sdpa, name, H), name
    # Planted: rows 1..8 of each batch element see >= 2 of the 3 tied sinks (row 0 sees one);
    # ties: 1 + 2 + 3 * 7 = 24 per batch element; sinks score gap + 1 = 15.
    assert heads(flex, "attn_repeated_max_rows", H) == [2 * 8] * H
    assert heads(flex, "attn_tie_entries", H) == [2 * 24] * H
    assert heads(flex, "attn_max_logit", H) == [15.0] * H
    assert flex.value("attn_calls", layer="block.attn") == 1
    assert None not in heads(flex, "attn_output_bias", H)
    # eager flex_attention compiles its call itself: not the compile the warning is about
    assert not [r for r in caplog.records if "inside torch.compile" in r.getMessage()]


def test_flex_score_mod_bias_measures_as_sdpa_additive_mask(make_monitor):
    """A score_mod that adds a bias is SDPA's additive mask; a mask_mod is its boolean mask."""
    B, H, T = 1, 2, 8
    q, k, v = planted_sink_attention(B=B, H=H, T=T, D=16, n_sink=2, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    bias = torch.randint(-8, 9, (H, T, T), generator=g).float() / 4  # exact in fp32
    bias[:, :, :2] = 0.5  # the sinks stay tied
    keep = torch.rand(T, T, generator=g) > 0.2
    keep[:, 0] = True  # every row keeps a key
    keep[::3, 1] = False  # rows 0, 3, 6 lose the second sink: no tie there

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    def mask_mod(b, h, q_idx, kv_idx):
        return keep[q_idx, kv_idx]

    mask = fa.create_block_mask(mask_mod, None, None, T, T, device="cpu")
    flex, _ = measure(
        make_monitor,
        lambda q, k, v: fa.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask),
        q, k, v,
    )  # fmt: skip
    additive = bias.masked_fill(~keep, float("-inf"))
    sdpa, _ = measure(
        make_monitor, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, additive), q, k, v
    )
    for name in SCORE_STATS:
        assert heads(flex, name, H) == heads(sdpa, name, H), name
    tied = (keep[:, 0] & keep[:, 1]).sum().item()  # rows that keep both sinks
    assert tied == 5
    assert heads(flex, "attn_repeated_max_rows", H) == [tied] * H
    assert heads(flex, "attn_max_logit", H) == [15.5] * H


def test_flex_gqa_and_sampling(make_monitor):
    B, Hq, T = 2, 4, 7
    q, k, v = planted_sink_attention(B=B, H=Hq, T=T, D=16, n_sink=2, dtype=torch.bfloat16)
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()  # 4 query heads share 2 KV heads
    flex_fn = lambda q, k, v: fa.flex_attention(q, k, v, enable_gqa=True)
    sdpa_fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    flex, _ = measure(make_monitor, flex_fn, q, k, v)
    sdpa, _ = measure(make_monitor, sdpa_fn, q, k, v)
    for name in SCORE_STATS:
        assert heads(flex, name, Hq) == heads(sdpa, name, Hq), name
    assert heads(flex, "attn_repeated_max_rows", Hq) == [B * T] * Hq  # both sinks in every row

    flex, _ = measure(make_monitor, flex_fn, q, k, v, attention__rows=3, attention__batch=1)
    assert heads(flex, "attn_rows", Hq) == [3] * Hq


def test_flex_output_error_is_that_of_its_own_output(make_monitor):
    """Eager flex_attention rounds the normalized P to bf16 before P @ V: on planted ties that
    error is one-signed. The probe reads the call's own output."""
    B, H, T = 1, 2, 16
    q, k, v = planted_sink_attention(B=B, H=H, T=T, D=16, n_sink=3, dtype=torch.bfloat16)
    mask = fa.create_block_mask(causal, None, None, T, T, device="cpu")
    snap, out = measure(
        make_monitor, lambda q, k, v: fa.flex_attention(q, k, v, block_mask=mask), q, k, v
    )
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    err = out.double() - ref  # (B, H, T, D)
    want = (err.sum((0, 2, 3)) / err.abs().sum((0, 2, 3))).tolist()
    assert heads(snap, "attn_output_bias", H) == pytest.approx(want, rel=1e-9)
    assert all(b < -0.5 for b in want)  # one-signed: V < 0 and P rounded up
    rms = err.square().mean((0, 2, 3)).sqrt().tolist()
    assert heads(snap, "attn_output_error_rms", H) == pytest.approx(rms, rel=1e-9)


def test_a_mod_that_cannot_be_evaluated_is_counted_and_said_once(make_monitor, caplog):
    """A score_mod that runs only while Dynamo traces it (as eager flex_attention's own compile
    does) fails on the probe's index tensors: the call is counted, said once, and training
    goes on with flex's output untouched."""
    T = 6
    q, k, v = planted_sink_attention(B=1, H=2, T=T, D=16, dtype=torch.float32)

    def compiled_only(score, b, h, q_idx, kv_idx):
        if not torch.compiler.is_compiling():
            raise RuntimeError("traced only")
        return score * 2

    fn = lambda q, k, v: fa.flex_attention(q, k, v, score_mod=compiled_only)
    model = Net(Fixed(q, k, v, fn))
    monitor = make_monitor(
        model, sinks__console__enabled=False, sinks__jsonl__enabled=False, flush_every=1,
        attention__every=1,
    ).attach()  # fmt: skip
    for _ in range(2):
        out = model()
        monitor.step()
    monitor.detach()
    snap = monitor.snapshot()
    assert snap.value("attn_unmeasured_calls_total", reason="flex_mods") == 2
    assert snap.get("attn_calls", layer="block.attn") is None
    assert snap.value("monitor_errors_total", component="attention") == 0
    told = [r.getMessage() for r in caplog.records if "flex_mods" in r.getMessage()]
    assert len(told) == 1 and "'block.attn'" in told[0] and "traced only" in told[0]
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, scale=2 * 16**-0.5))


@pytest.mark.parametrize("where", ["model", "function"])
def test_flex_inside_torch_compile_is_said_to_be_unmeasured(
    make_monitor, caplog, monkeypatch, where
):
    """Inside a compiled graph the probe cannot reach flex_attention without splitting the graph
    around its kernel: no series, one warning when Dynamo traces it, the same outputs."""
    monkeypatch.setattr(flex_probe, "_told_compiled", False)
    torch._dynamo.reset()
    T = 8
    q, k, v = planted_sink_attention(B=1, H=2, T=T, D=16, dtype=torch.float32)
    mask = fa.create_block_mask(causal, None, None, T, T, device="cpu")
    fn = (
        torch.compile(fa.flex_attention, backend="aot_eager")
        if where == "function"
        else fa.flex_attention
    )
    model = Net(Fixed(q, k, v, lambda q, k, v: fn(q, k, v, block_mask=mask)))
    run = torch.compile(model, backend="aot_eager") if where == "model" else model
    monitor = make_monitor(
        model, sinks__console__enabled=False, sinks__jsonl__enabled=False, flush_every=1,
        attention__every=1,
    ).attach()  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="numwatch"):
        outs = []
        for _ in range(3):
            outs.append(run())
            monitor.step()
    monitor.detach()
    snap = monitor.snapshot()
    assert snap.series("attn_calls") == []
    told = [
        r for r in caplog.records if "flex_attention runs inside torch.compile" in r.getMessage()
    ]
    assert len(told) == 1
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert all(torch.allclose(o, want, atol=1e-6) for o in outs)


def test_flex_not_sampled_is_not_measured(make_monitor):
    """Steps the probe does not sample run flex_attention with no interception at all."""
    q, k, v = planted_sink_attention(B=1, H=2, T=6, D=16, dtype=torch.float32)
    model = Net(Fixed(q, k, v, lambda q, k, v: fa.flex_attention(q, k, v)))
    monitor = make_monitor(
        model, sinks__console__enabled=False, sinks__jsonl__enabled=False, flush_every=4,
        attention__every=4,
    ).attach()  # fmt: skip
    for _ in range(4):
        model()
        monitor.step()
    monitor.detach()
    assert monitor.snapshot().value("attn_calls", layer="block.attn") == 1  # step 0 of 4
