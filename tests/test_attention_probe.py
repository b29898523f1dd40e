"""Attention probe: interception of every attention path, with exact planted answers."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import Fixed, Net
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import numwatch
from numwatch.probes.attention import SdpaCall
from numwatch.testing import kernel_devices, planted_sink_attention


@pytest.fixture
def make_monitor(tmp_path):
    def make(model, **overrides):
        overrides.setdefault("sinks__console__enabled", False)
        overrides.setdefault("sinks__jsonl__enabled", False)
        overrides.setdefault("flush_every", 1)
        overrides.setdefault("attention__every", 1)
        overrides.setdefault("attention__batch", 0)
        return numwatch.Monitor(model, **overrides).attach()

    return make


def wrap(**children):
    model = nn.Module()
    for name, child in children.items():
        model.add_module(name, child)
    model.forward = lambda x=None: [c(x) for c in children.values()]  # type: ignore[method-assign]
    return model


def oracle(q, k, *, causal=True, mask=None, scale=None):
    """Float64 direct computation of the planted statistics: (repeated rows, tie entries) / head."""
    D = q.shape[-1]
    rep = k.shape[1] and q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    s = (q.double() @ k.double().transpose(-1, -2)) * (scale if scale is not None else D**-0.5)
    keep = torch.ones_like(s, dtype=torch.bool)
    if causal:
        keep &= torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if mask is not None:
        keep &= mask
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True)
    ties = ((s == m) & keep).sum(-1)  # (B, H, Tq)
    valid = keep.any(-1)
    return ((ties >= 2) & valid).sum((0, 2)), (ties * valid).sum((0, 2)), valid.sum((0, 2))


def head_values(snap, name, layer, H):
    return [snap.value(name, layer=layer, head=str(h)) for h in range(H)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sdpa_planted_sink_ties_exact(make_monitor, dtype):
    q, k, v = planted_sink_attention(B=2, H=3, T=9, D=16, n_sink=3, dtype=dtype)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    model = Net(Fixed(q, k, v, sdpa))
    monitor = make_monitor(model)
    model()
    monitor.step()
    snap = monitor.snapshot()
    rep, ties, rows = oracle(q, k)
    assert rep.tolist() == [8, 8, 8] * 1 or rep.tolist() == [16, 16, 16]
    assert head_values(snap, "attn_repeated_max_rows", "block.attn", 3) == rep.tolist()
    assert head_values(snap, "attn_tie_entries", "block.attn", 3) == ties.tolist()
    assert head_values(snap, "attn_rows", "block.attn", 3) == rows.tolist()
    assert snap.value("attn_calls", layer="block.attn") == 1
    # Sinks score exactly gap + 1 = 15: every row's maximum.
    assert head_values(snap, "attn_max_logit", "block.attn", 3) == [15.0] * 3


def test_gqa_padding_mask_and_row_sampling(make_monitor):
    q, k, v = planted_sink_attention(B=2, H=4, T=7, D=16, n_sink=2, dtype=torch.bfloat16)
    k, v = k[:, :2], v[:, :2]  # GQA: 4 query heads share 2 KV heads
    pad = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    pad[1, ..., 1] = False  # batch 1 masks one of its two sinks: no repeated maxima there
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=pad, enable_gqa=True)
    model = Net(Fixed(q, k, v, sdpa))
    monitor = make_monitor(model)
    model()
    monitor.step()
    rep, ties, _ = oracle(q, k, causal=False, mask=pad)
    snap = monitor.snapshot()
    assert rep.tolist() == [7, 7, 7, 7]  # batch 0 only
    assert head_values(snap, "attn_repeated_max_rows", "block.attn", 4) == rep.tolist()
    assert head_values(snap, "attn_tie_entries", "block.attn", 4) == ties.tolist()

    monitor = make_monitor(model, attention__rows=3, attention__batch=1)
    model()
    monitor.step()
    assert head_values(monitor.snapshot(), "attn_rows", "block.attn", 4) == [3] * 4


def test_eager_softmax_attention_4d(make_monitor):
    q, k, v = planted_sink_attention(B=1, H=2, T=6, D=16, dtype=torch.float32)

    def eager(q, k, v):  # nanoGPT's slow path
        att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        att = att.masked_fill(torch.ones(6, 6).tril() == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v

    model = Net(Fixed(q, k, v, eager))
    monitor = make_monitor(model)
    model()
    monitor.step()
    rep, ties, _ = oracle(q, k)
    snap = monitor.snapshot()
    assert head_values(snap, "attn_repeated_max_rows", "block.attn", 2) == rep.tolist() == [5, 5]
    assert head_values(snap, "attn_tie_entries", "block.attn", 2) == ties.tolist()
    assert snap.get("attn_output_bias", layer="block.attn", head="0") is None  # SDPA only


def test_eager_softmax_shifted_by_its_row_max_reports_no_logits(make_monitor, caplog):
    """Eager attention that subtracts the row maximum before the softmax (GPT-OSS, for its
    sinks): attn_max_logit read 0 for every head whatever the logits did, so the logit rules
    could never fire. The logits are left out, said once; the counts are those of S."""
    q, k, v = planted_sink_attention(B=1, H=2, T=6, D=16, dtype=torch.float32)
    q = q * 40.0  # logits far from 0

    def eager(shift):
        def attend(q, k, v):
            att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
            att = att.masked_fill(torch.ones(6, 6).tril() == 0, float("-inf"))
            if shift:
                att = att - att.amax(-1, keepdim=True)
            return F.softmax(att, dim=-1) @ v

        return attend

    model = wrap(plain=Fixed(q, k, v, eager(False)), shifted=Fixed(q, k, v, eager(True)))
    monitor = make_monitor(model)
    with caplog.at_level("WARNING", logger="numwatch"):
        for _ in range(2):
            model()
            monitor.step()
    snap = monitor.snapshot()
    scores = (q @ k.transpose(-2, -1)).double() * 0.25
    top = scores.masked_fill(torch.ones(6, 6).tril() == 0, float("-inf")).amax((0, 2, 3))
    assert head_values(snap, "attn_max_logit", "plain", 2) == pytest.approx(top.tolist())
    assert snap.get("attn_max_logit", layer="shifted", head="0") is None
    assert snap.get("attn_min_logit", layer="shifted", head="1") is None
    rep, _, _ = oracle(q, k)
    assert head_values(snap, "attn_repeated_max_rows", "shifted", 2) == rep.tolist()
    warned = [
        r.getMessage() for r in caplog.records if "maximum is 0 in every row" in r.getMessage()
    ]
    assert len(warned) == 1 and "'shifted'" in warned[0]


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_both_paths(make_monitor, need_weights):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    model = nn.Sequential()
    model.add_module("mha", mha)
    model.forward = lambda x: mha(x, x, x, need_weights=need_weights)  # type: ignore[method-assign]
    monitor = make_monitor(model)
    x = torch.randn(2, 5, 16)
    x[:, 1] = x[:, 0]  # identical tokens 0 and 1 -> identical keys -> tie where they are the max
    model(x)
    monitor.step()
    snap = monitor.snapshot()
    assert snap.value("attn_calls", layer="mha") == 1
    assert head_values(snap, "attn_rows", "mha", 4) == [10] * 4  # B*T rows per head
    with torch.no_grad():
        qp, kp, _ = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, -1)
        q = qp.view(2, 5, 4, 4).transpose(1, 2)
        k = kp.view(2, 5, 4, 4).transpose(1, 2)
    _, ties, _ = oracle(q, k, causal=False)
    # Keys 0 and 1 are bitwise equal, so any row whose max is key 0 ties with key 1.
    assert head_values(snap, "attn_tie_entries", "mha", 4) == ties.tolist()


def _dyadic(*shape, gen, scale=8):
    """Small multiples of 1/scale: every product and sum the probe forms is exact in fp32."""
    return torch.randint(-scale, scale + 1, shape, generator=gen).float() / scale


def test_multihead_attention_bias_kv_zero_attn_and_padding(make_monitor):
    """add_bias_kv appends a learned key, add_zero_attn a zero key, and the padding mask widens
    to leave both visible. The learned key is planted equal to key 0 (exact dyadic values), so
    every row whose maximum is key 0 ties with it."""
    g = torch.Generator().manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True, add_bias_kv=True, add_zero_attn=True)
    x = _dyadic(2, 5, 16, gen=g, scale=2)
    x[1, 0] = x[0, 0]  # key 0 is the same in both batch elements
    with torch.no_grad():
        mha.in_proj_weight.copy_(_dyadic(48, 16, gen=g))
        mha.in_proj_bias.zero_()
        q = (x @ mha.in_proj_weight[:16].T).view(2, 5, 4, 4).transpose(1, 2)
        k = (x @ mha.in_proj_weight[16:32].T).view(2, 5, 4, 4).transpose(1, 2)
        mha.bias_k.copy_(k[0, :, 0].reshape(1, 1, 16))
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 4] = True  # batch element 1's last key is padding
    model = nn.Sequential()
    model.add_module("mha", mha)
    model.forward = lambda x: mha(x, x, x, key_padding_mask=pad, need_weights=False)  # type: ignore[method-assign]
    monitor = make_monitor(model)
    model(x)
    monitor.step()
    snap = monitor.snapshot()
    assert not any(monitor.errors.values())
    k_all = torch.cat([k, k[:1, :, :1].expand(2, -1, -1, -1), torch.zeros(2, 4, 1, 4)], dim=2)
    keep = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    keep[1, ..., 4] = False
    rep, ties, rows = oracle(q, k_all, causal=False, mask=keep)
    assert rep.sum() > 0  # the planted ties occur
    assert head_values(snap, "attn_repeated_max_rows", "mha", 4) == rep.tolist()
    assert head_values(snap, "attn_tie_entries", "mha", 4) == ties.tolist()
    assert head_values(snap, "attn_rows", "mha", 4) == rows.tolist() == [10] * 4
    s = (q.double() @ k_all.double().transpose(-1, -2) * 0.5).masked_fill(~keep, -math.inf)
    want_max = s.amax((0, 2, 3)).tolist()
    assert head_values(snap, "attn_max_logit", "mha", 4) == want_max


def test_static_k_of_the_functional_form(make_monitor):
    """F.multi_head_attention_forward with static_k: the given (N*H, S, hd) keys are used."""
    g = torch.Generator().manual_seed(1)
    w, b = _dyadic(48, 16, gen=g), torch.zeros(48)
    x = _dyadic(6, 2, 16, gen=g, scale=2)  # (L, N, E)
    static_k = _dyadic(2 * 4, 3, 4, gen=g)
    static_k[:, 2] = static_k[:, 0]  # keys 0 and 2 tie in every head

    def attend(_x=None):
        return F.multi_head_attention_forward(
            x, x, x, 16, 4, w, b, None, None, False, 0.0, torch.eye(16), torch.zeros(16),
            need_weights=False, static_k=static_k, static_v=static_k,
        )[0]  # fmt: skip

    model = Net(Fixed(None, None, None, lambda *_: attend()))
    monitor = make_monitor(model)
    model()
    monitor.step()
    snap = monitor.snapshot()
    q = (x @ w[:16].T).view(6, 2, 4, 4).permute(1, 2, 0, 3)
    rep, ties, _ = oracle(q, static_k.view(2, 4, 3, 4), causal=False)
    assert head_values(snap, "attn_tie_entries", "block.attn", 4) == ties.tolist()
    assert head_values(snap, "attn_repeated_max_rows", "block.attn", 4) == rep.tolist()


def test_no_interception_outside_sampled_steps(make_monitor):
    seen = []

    class Spy(nn.Module):
        def forward(self, x):
            seen.append(len(torch.overrides._get_current_function_mode_stack()))
            return F.scaled_dot_product_attention(x, x, x)

    model = Net(Spy())
    monitor = make_monitor(model, attention__every=3, flush_every=6)
    x = torch.randn(1, 2, 4, 8)
    for _ in range(6):
        model(x)
        monitor.step()
    assert seen == [1, 0, 0, 1, 0, 0]
    assert monitor.snapshot().value("attn_calls", layer="block.attn") == 2


@pytest.mark.parametrize("training_only", [True, False])
def test_evaluation_forwards_are_not_measured_by_default(make_monitor, training_only):
    """A validation pass (model.eval()) inside a sampled step is not training's attention."""

    class Attend(nn.Module):
        def forward(self, x):
            return F.scaled_dot_product_attention(x, x, x)

    model = Net(Attend())
    monitor = make_monitor(model, attention__training_only=training_only)
    x = torch.randn(1, 2, 4, 8)
    model(x)  # training
    model.eval()
    model(x)
    model(x)  # two evaluation batches
    model.train()
    monitor.step()
    snap = monitor.snapshot()
    assert snap.value("attn_calls", layer="block.attn") == (1 if training_only else 3)
    assert snap.value("attn_rows", layer="block.attn", head="0") == (4 if training_only else 12)


def cpu_sdpa_backends(make_monitor, q, k, v, metrics):
    """{SDPA backend: {metric: per-head values}} of one causal SDPA layer, measured once with
    torch's CPU flash kernel and once with its math backend."""
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    model = Net(Fixed(q, k, v, sdpa))
    got = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        monitor = make_monitor(model)
        with sdpa_kernel(backend):
            model()
        monitor.step()
        snap = monitor.snapshot()
        got[backend] = {m: head_values(snap, m, "block.attn", q.shape[1]) for m in metrics}
    return got


def test_output_bias_of_torch_cpu_flash_bf16_kernel(make_monitor):
    """DESIGN.md: torch's CPU flash SDPA in bf16 errs one-signed on planted sink ties."""
    q, k, v = planted_sink_attention(B=1, H=2, T=256, D=64, n_sink=2, gap=14.0)
    got = cpu_sdpa_backends(make_monitor, q, k, v, ("attn_output_bias",))
    bias = {backend: values["attn_output_bias"] for backend, values in got.items()}
    assert all(b < -0.9 for b in bias[SDPBackend.FLASH_ATTENTION]), bias  # measured -0.999
    # The math backend rounds an fp32 result once; rows share nearly one output value here, so
    # its ratio is a handful of correlated roundings (measured +0.07 and +0.29), never -1.
    assert all(abs(b) < 0.5 for b in bias[SDPBackend.MATH]), bias


def test_systematic_error_of_torch_cpu_flash_kernel_with_mixed_sign_values(make_monitor):
    """The same planted ties with V's sign alternating over the output dims: the flawed kernel's
    error still keeps one sign per dim, which the signed bias (cancelling across dims) misses and
    attn_output_systematic_error shows; the math backend errs little beyond correct rounding."""
    q, k, v = planted_sink_attention(B=1, H=2, T=256, D=64, n_sink=2, gap=14.0)
    v = v * torch.tensor([1.0, -1.0] * 32).to(v.dtype)
    metrics = ("attn_output_bias", "attn_output_systematic_error")
    got = cpu_sdpa_backends(make_monitor, q, k, v, metrics)
    flash, math_ = got[SDPBackend.FLASH_ATTENTION], got[SDPBackend.MATH]
    assert all(abs(b) < 0.1 for b in flash["attn_output_bias"]), got  # measured 0.0, -0.03
    assert all(x > 0.8 for x in flash["attn_output_systematic_error"]), got  # 0.91, 1.07
    assert all(x < 0.4 for x in math_["attn_output_systematic_error"]), got  # 0.16, 0.22


def test_layers_of_one_shape_are_measured_together(make_monitor, monkeypatch):
    """Sampled calls wait for the forward's end; calls of one shape (and one mask tensor) are
    measured in one statistics call with their layers stacked as heads. Each layer must still
    get exactly its own planted answer: three layers, two shapes, different sink counts."""
    from numwatch.kernels import attention_stats

    launches = []
    real = attention_stats.attention_head_stats
    monkeypatch.setattr(
        attention_stats, "attention_head_stats", lambda *a, **k: launches.append(1) or real(*a, **k)
    )
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    planted = {
        "a": planted_sink_attention(B=2, H=3, T=9, D=16, n_sink=3, seed=1),
        "b": planted_sink_attention(B=2, H=3, T=9, D=16, n_sink=1, seed=2),
        "c": planted_sink_attention(B=2, H=3, T=12, D=16, n_sink=2, seed=3),
    }
    model = wrap(**{name: Fixed(*qkv, sdpa) for name, qkv in planted.items()})
    monitor = make_monitor(model)
    model()
    assert launches == [1, 1]  # (a, b) together, c alone
    monitor.step()
    snap = monitor.snapshot()
    for name, (q, k, _) in planted.items():
        rep, ties, rows = oracle(q, k)
        assert head_values(snap, "attn_repeated_max_rows", name, 3) == rep.tolist(), name
        assert head_values(snap, "attn_tie_entries", name, 3) == ties.tolist(), name
        assert head_values(snap, "attn_rows", name, 3) == rows.tolist(), name
        assert snap.value("attn_output_error_rms", layer=name, head="0") < 0.05
    # the held copies' byte bound: at one byte, every call is measured as it comes
    from numwatch.probes import attention as probe_module

    monkeypatch.setattr(probe_module, "_HOLD_BYTES", 1)
    launches.clear()
    model()
    assert launches == [1, 1, 1]


@pytest.mark.parametrize("device", kernel_devices())
def test_output_errors_of_same_shaped_layers_in_one_launch(make_monitor, monkeypatch, device):
    """With the Triton backend, same-shaped layers' output errors are one launch (their layers
    stacked as heads); each layer still gets the error the torch path measures for it alone.
    bf16 SDPA errs by ~1e-3, far above the fp32 and float64 references' own error."""
    from numwatch.kernels import attention_stats

    launches = []
    real = attention_stats._output_error_triton
    monkeypatch.setattr(
        attention_stats, "_output_error_triton", lambda *a: launches.append(1) or real(*a)
    )
    g = torch.Generator().manual_seed(5)
    layers = {
        name: tuple(torch.randn(2, 3, 13, 16, generator=g).bfloat16().to(device) for _ in range(3))
        for name in ("a", "b")
    }
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    model = wrap(**{name: Fixed(*qkv, sdpa) for name, qkv in layers.items()})
    snaps = {}
    for backend in ("torch", "triton"):
        monitor = make_monitor(model, kernel_backend=backend)
        model()
        monitor.step()
        snaps[backend] = monitor.snapshot()
        monitor.detach()
    assert launches == [1]
    for name in layers:
        for metric in ("attn_output_bias", "attn_output_error_rms"):
            want = head_values(snaps["torch"], metric, name, 3)
            got = head_values(snaps["triton"], metric, name, 3)
            assert got == pytest.approx(want, rel=1e-3, abs=1e-6), (name, metric)


def test_probe_failure_survived(make_monitor, monkeypatch):
    from numwatch.kernels import attention_stats

    monkeypatch.setattr(attention_stats, "attention_head_stats", lambda *a, **k: 1 / 0)
    x = torch.randn(1, 2, 4, 8)
    model = Net(Fixed(x, x, x, F.scaled_dot_product_attention))
    monitor = make_monitor(model)
    out = model()
    monitor.step()
    assert torch.equal(out, F.scaled_dot_product_attention(x, x, x))
    assert monitor.snapshot().value("monitor_errors_total", component="attention") == 1


def test_a_failing_group_costs_only_its_layers(make_monitor, monkeypatch):
    """Held calls are measured group by group: a layer the statistics reject (here: its shape)
    is counted as one failure, and the other layer still gets its planted answer."""
    from numwatch.kernels import attention_stats

    real = attention_stats.attention_head_stats

    def rejecting(q, *a, **kw):
        if q.shape[2] == 6:
            raise ValueError("rejected")
        return real(q, *a, **kw)

    monkeypatch.setattr(attention_stats, "attention_head_stats", rejecting)
    q, k, v = planted_sink_attention(B=1, H=2, T=8, D=16, n_sink=2)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    bad = [t[:, :, :6] for t in (q, k, v)]
    model = wrap(bad=Fixed(*bad, sdpa), good=Fixed(q, k, v, sdpa))
    monitor = make_monitor(model)
    model()
    monitor.step()
    snap = monitor.snapshot()
    assert snap.value("monitor_errors_total", component="attention") == 1
    rep, _, _ = oracle(q, k)
    assert head_values(snap, "attn_repeated_max_rows", "good", 2) == rep.tolist()
    assert snap.get("attn_calls", layer="bad") is None


@pytest.mark.parametrize("where", ["model", "global"])
def test_a_pre_hook_that_raises_keeps_entry_and_exit_balanced(make_monitor, where):
    """A pre-hook that rejects a batch ran before numwatch's entry, but numwatch's always_call
    exit still ran: the depth went to -1 and the next sampled forward left its mode on the stack
    for good, also after detach."""
    x = torch.randn(1, 2, 4, 8)
    model = Net(Fixed(x, x, x, F.scaled_dot_product_attention))
    reject = [True]

    def check(module, _args):
        if reject[0] and module is model:
            raise ValueError("bad batch")

    if where == "model":  # registered before attach; a global one always runs first
        handle = model.register_forward_pre_hook(check)
        monitor = make_monitor(model)
    else:
        monitor = make_monitor(model)
        handle = torch.nn.modules.module.register_module_forward_pre_hook(check)
    try:
        with pytest.raises(ValueError, match="bad batch"):
            model()
        assert torch._C._len_torch_function_stack() == 0
        reject[0] = False
        model()
        assert torch._C._len_torch_function_stack() == 0
        monitor.step()
        assert monitor.snapshot().value("attn_calls", layer="block.attn") == 1
    finally:
        handle.remove()
    monitor.detach()
    assert torch._C._len_torch_function_stack() == 0


def test_a_nested_forward_rejected_by_a_pre_hook_leaves_the_outer_one_intercepted(make_monitor):
    """The rejected inner call's exit must undo only its own entry, not the outer forward's."""

    class Retrying(nn.Module):
        def forward(self, x, inner=False):
            if not inner:
                with pytest.raises(ValueError, match="rejected"):
                    self(x, True)
            return F.scaled_dot_product_attention(x, x, x)

    def reject_inner(_module, args):
        if len(args) == 2:
            raise ValueError("rejected")

    model = Retrying()
    model.register_forward_pre_hook(reject_inner)
    monitor = make_monitor(model)
    model(torch.randn(1, 2, 4, 8))
    assert torch._C._len_torch_function_stack() == 0
    monitor.step()
    assert monitor.snapshot().value("attn_calls", layer="") == 1


def test_detach_leaves_no_mode_of_a_forward_that_never_exited(make_monitor):
    """torch runs always_call hooks only for an Exception: a forward ended by a BaseException
    (KeyboardInterrupt) never reaches numwatch's exit, and detach must still remove the mode."""

    class Abort(BaseException):
        pass

    def abort(q, k, v):
        F.scaled_dot_product_attention(q, k, v)
        raise Abort

    x = torch.randn(1, 2, 4, 8)
    model = Net(Fixed(x, x, x, abort))
    monitor = make_monitor(model)
    with pytest.raises(Abort):
        model()
    assert torch._C._len_torch_function_stack() == 1
    monitor.detach()
    assert torch._C._len_torch_function_stack() == 0


def test_a_forward_that_never_exited_is_closed_at_the_next_step(make_monitor):
    """A Ctrl-C in a notebook cell left the mode entered until detach(): every later forward
    nested inside it, intercepted and sampled whatever attention.every said."""

    class Abort(BaseException):
        pass

    x = torch.randn(1, 2, 4, 8)
    aborting = [True]

    def maybe_abort(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v)
        if aborting[0]:
            raise Abort
        return out

    model = Net(Fixed(x, x, x, maybe_abort))
    monitor = make_monitor(model, flush_every=10, attention__every=10)
    with pytest.raises(Abort):
        model()
    aborting[0] = False
    for _ in range(20):
        model()
        monitor.step()
        assert torch._C._len_torch_function_stack() == 0
    assert monitor.snapshot().value("attn_calls", layer="block.attn") == 1  # 1 sampled step of 10


def test_an_attention_layer_added_after_attach_gets_its_own_label(make_monitor):
    """A layer appended after attach was labelled with the nearest known ancestor (the root
    here) and merged into it."""

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Fixed(x, x, x, F.scaled_dot_product_attention)])

        def forward(self):
            return [b() for b in self.blocks]

    x = torch.randn(1, 2, 4, 8)
    model = Blocks()
    monitor = make_monitor(model)
    model.blocks.append(Fixed(x, x, x, F.scaled_dot_product_attention))
    model()
    monitor.step()
    calls = {r.labels["layer"]: r.value for r in monitor.snapshot().series("attn_calls")}
    assert calls == {"blocks.0": 1.0, "blocks.1": 1.0}


@pytest.mark.parametrize("dropout_p", [0.0, 0.5])
def test_no_output_error_on_calls_with_dropout(make_monitor, dropout_p):
    """The output error compares with a recomputation without dropout: with dropout_p > 0 it
    measured dropout noise (rms ~0.1 against ~1e-3). The score statistics ignore dropout."""
    torch.manual_seed(0)
    q, k, v = planted_sink_attention(B=1, H=2, T=8, D=16, n_sink=2)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=True
    )
    model = Net(Fixed(q, k, v, sdpa))
    monitor = make_monitor(model)
    model()
    monitor.step()
    snap = monitor.snapshot()
    rep, ties, rows = oracle(q, k)
    assert head_values(snap, "attn_repeated_max_rows", "block.attn", 2) == rep.tolist() == [7, 7]
    assert head_values(snap, "attn_tie_entries", "block.attn", 2) == ties.tolist()
    assert head_values(snap, "attn_rows", "block.attn", 2) == rows.tolist()
    for metric in ("attn_output_bias", "attn_output_systematic_error", "attn_output_error_rms"):
        got = [snap.get(metric, layer="block.attn", head=str(h)) for h in range(2)]
        assert (got == [None, None]) == (dropout_p > 0), (metric, got)


def test_row_sampling_leaves_the_global_rng_alone(make_monitor):
    """attention.rows drew its rows from the global RNG: the user's dropout masks and every
    later random draw differed from an unmonitored run. The probe's own generator (seed
    _ROW_SEED, one per device) samples instead."""
    from numwatch.probes import attention as probe_module

    q, k, v = planted_sink_attention(B=1, H=2, T=8, D=16, n_sink=3)
    sdpa = lambda q, k, v: F.dropout(F.scaled_dot_product_attention(q, k, v, is_causal=True), 0.5)
    model = Net(Fixed(q, k, v, sdpa))

    def run(monitored):
        torch.manual_seed(0)
        monitor = make_monitor(model, attention__rows=3) if monitored else None
        outs = []
        for _ in range(3):
            outs.append(model())
            if monitor is not None:
                monitor.step()
        return torch.get_rng_state(), outs, monitor

    state, outs, _ = run(False)
    state_monitored, outs_monitored, monitor = run(True)
    assert torch.equal(state_monitored, state)
    assert all(torch.equal(a, b) for a, b in zip(outs_monitored, outs, strict=True))
    # the third sampled step's rows are the generator's third draw
    gen = torch.Generator().manual_seed(probe_module._ROW_SEED)
    rows = [torch.randperm(8, generator=gen)[:3] for _ in range(3)][-1]
    causal = torch.ones(8, 8, dtype=torch.bool).tril()[rows]
    _, ties, _ = oracle(q[:, :, rows], k, causal=False, mask=causal)
    snap = monitor.snapshot()
    assert head_values(snap, "attn_rows", "block.attn", 2) == [3, 3]
    assert head_values(snap, "attn_tie_entries", "block.attn", 2) == ties.tolist()


def test_unbatched_sdpa_is_measured_as_one_batch_element(make_monitor):
    """SDPA takes unbatched (H, T, D) inputs: measured like the (1, H, T, D) call."""
    q, k, v = planted_sink_attention(B=1, H=2, T=8, D=16, n_sink=2)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    model = Net(Fixed(q[0], k[0], v[0], sdpa))
    monitor = make_monitor(model)
    model()
    monitor.step()
    snap = monitor.snapshot()
    assert not any(monitor.errors.values())
    rep, ties, rows = oracle(q, k)
    assert head_values(snap, "attn_repeated_max_rows", "block.attn", 2) == rep.tolist() == [7, 7]
    assert head_values(snap, "attn_tie_entries", "block.attn", 2) == ties.tolist()
    assert head_values(snap, "attn_rows", "block.attn", 2) == rows.tolist() == [8, 8]
    assert snap.value("attn_output_error_rms", layer="block.attn", head="0") < 0.05


def test_a_mask_with_is_causal_is_measured_with_both(make_monitor):
    """SDPA's CPU path takes attn_mask and is_causal together (both apply); such calls were
    dropped as errors."""
    q, k, v = planted_sink_attention(B=1, H=2, T=8, D=16, n_sink=2)
    keep = torch.ones(8, 8, dtype=torch.bool)
    keep[5:, 1] = False  # rows 5-7 lose one of the two sinks
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=True)
    model = Net(Fixed(q, k, v, sdpa))
    monitor = make_monitor(model)
    model()
    monitor.step()
    snap = monitor.snapshot()
    assert not any(monitor.errors.values())
    rep, ties, rows = oracle(q, k, causal=True, mask=keep)
    assert head_values(snap, "attn_repeated_max_rows", "block.attn", 2) == rep.tolist() == [4, 4]
    assert head_values(snap, "attn_tie_entries", "block.attn", 2) == ties.tolist()
    assert head_values(snap, "attn_rows", "block.attn", 2) == rows.tolist()


@pytest.mark.parametrize("fill", [-1e9, -1e4, -5000.0, float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_additive_masks_mask_like_minus_infinity(make_monitor, fill, dtype):
    """A padding mask filled with -1e9 (or -1e4: -9984 in bf16) counted as logits: the padded
    query rows, all keys at one value, were rows of tied maxima (and swapped kernels)."""
    q, k, v = planted_sink_attention(B=1, H=2, T=8, D=16, n_sink=2)
    keep = torch.ones(8, 8, dtype=torch.bool)
    keep[:, 6:] = keep[6:, :] = False  # the last two tokens are padding: queries and keys
    keep[6:, 0] = True  # (a padded query row keeps a key: no fully masked row for SDPA)
    add = torch.zeros(8, 8, dtype=dtype).masked_fill(~keep, fill)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=add)
    model = Net(Fixed(q, k, v, sdpa))
    monitor = make_monitor(model)
    model()
    monitor.step()
    snap = monitor.snapshot()
    rep, ties, rows = oracle(q, k, causal=False, mask=keep)
    assert head_values(snap, "attn_repeated_max_rows", "block.attn", 2) == rep.tolist()
    assert head_values(snap, "attn_tie_entries", "block.attn", 2) == ties.tolist()
    assert head_values(snap, "attn_rows", "block.attn", 2) == rows.tolist() == [8, 8]
    assert min(head_values(snap, "attn_min_logit", "block.attn", 2)) > -100


def test_a_mask_buffer_refilled_for_the_next_layer_measures_each_layer_with_its_own(
    make_monitor,
):
    """The held call kept the mask by reference: a buffer refilled in place for layer b (a
    sliding window after a's causal mask) measured layer a with b's mask at the forward's end."""
    q, k, v = planted_sink_attention(B=1, H=2, T=8, D=16, n_sink=2)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    window = causal & ~torch.ones(8, 8, dtype=torch.bool).tril(-3)
    buf = torch.zeros(8, 8, dtype=torch.bool)

    def refilled(pattern):
        def call(q, k, v):
            buf.copy_(pattern)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=buf)

        return Fixed(q, k, v, call)

    model = wrap(a=refilled(causal), b=refilled(window))
    monitor = make_monitor(model)
    model()
    monitor.step()
    snap = monitor.snapshot()
    for layer, pattern in (("a", causal), ("b", window)):
        rep, ties, _ = oracle(q, k, causal=False, mask=pattern)
        assert head_values(snap, "attn_repeated_max_rows", layer, 2) == rep.tolist()
        assert head_values(snap, "attn_tie_entries", layer, 2) == ties.tolist()
    assert (
        oracle(q, k, causal=False, mask=causal)[1].tolist()
        != oracle(q, k, causal=False, mask=window)[1].tolist()
    )  # the two masks give different answers


@pytest.mark.parametrize("batch", [0, 2])
@pytest.mark.parametrize("broadcast", ["kv_batch", "q_heads"])
def test_broadcast_batch_and_heads_are_measured_as_sdpa_broadcasts_them(
    make_monitor, batch, broadcast
):
    """K/V shared by the batch (batch dim 1), or one query head against several K/V heads:
    SDPA broadcasts them, and the statistics are those of the broadcast call."""
    q, k, v = planted_sink_attention(B=2, H=2, T=8, D=16, n_sink=2)
    if broadcast == "kv_batch":
        k, v = k[:1], v[:1]
        full = (q, k.expand(2, -1, -1, -1))
    else:
        q = q[:, :1]
        full = (q.expand(-1, 2, -1, -1), k)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    model = Net(Fixed(q, k, v, sdpa))
    monitor = make_monitor(model, attention__batch=batch)
    model()
    monitor.step()
    snap = monitor.snapshot()
    assert not any(monitor.errors.values())
    rep, ties, rows = oracle(*full)
    assert head_values(snap, "attn_repeated_max_rows", "block.attn", 2) == rep.tolist()
    assert head_values(snap, "attn_tie_entries", "block.attn", 2) == ties.tolist()
    assert head_values(snap, "attn_rows", "block.attn", 2) == rows.tolist() == [16, 16]
    assert snap.value("attn_output_error_rms", layer="block.attn", head="1") < 0.05


def test_fp32_inputs_under_autocast_are_measured_as_the_kernel_sees_them(make_monitor):
    """Under autocast SDPA computes with bf16 copies of fp32 q, k, v: two keys that differ in
    fp32 but round to one bf16 value tie for the kernel, and the statistics must say so."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, 8, generator=g).bfloat16().float()
    k = torch.randn(1, 1, 4, 8, generator=g).bfloat16().float()
    v = torch.randn(1, 1, 4, 8, generator=g)
    k[:, :, 0] = (q[0, 0].sum(0) * 2).bfloat16().float()
    k[:, :, 1] = k[:, :, 0] * (1 + 2**-12)  # a different fp32 key, the same bf16 one
    assert not torch.equal(k[:, :, 0], k[:, :, 1])

    def sdpa(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.scaled_dot_product_attention(q, k, v)

    model = Net(Fixed(q, k, v, sdpa))
    monitor = make_monitor(model)
    model()
    monitor.step()
    snap = monitor.snapshot()
    rep, ties, _ = oracle(q.bfloat16(), k.bfloat16(), causal=False)
    assert rep.tolist() == [4]
    assert snap.value("attn_repeated_max_rows", layer="block.attn", head="0") == 4
    assert snap.value("attn_tie_entries", layer="block.attn", head="0") == ties.item()
    # the bf16 kernel against a recomputation from its own bf16 operands: correct rounding
    assert snap.value("attn_output_systematic_error", layer="block.attn", head="0") < 0.5


def test_float64_attention_and_calls_without_keys_are_skipped(make_monitor):
    """float64 attention (the statistics are defined for bf16/fp16/fp32) and calls without keys
    (nothing to measure) failed on every sampled step; they are skipped, in every path."""
    x64 = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    q, no_keys = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 0, 8)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).double()
    model = wrap(
        sdpa64=Fixed(x64, x64, x64, F.scaled_dot_product_attention),
        mha64=Fixed(x64[0], x64[0], x64[0], lambda q, k, v: mha(q, k, v)),
        eager64=Fixed(x64, x64, x64, lambda q, k, v: F.softmax(q @ k.mT, -1) @ v),
        empty=Fixed(q, no_keys, no_keys, F.scaled_dot_product_attention),
        eager_empty=Fixed(q, no_keys, no_keys, lambda q, k, v: F.softmax(q @ k.mT, -1) @ v),
    )
    monitor = make_monitor(model)
    model()
    monitor.step()
    snap = monitor.snapshot()
    assert snap.value("monitor_errors_total", component="attention") == 0
    assert snap.series("attn_calls") == []


def test_windowed_sdpa_folds_its_leading_dims(make_monitor):
    """SDPA takes (B, ..., H, T, D) (windowed attention: B, windows, H, T, D), broadcasting the
    leading dims: measured as the 4-D call of the sampled batch elements with all their windows,
    a 4-D (windows, 1, T, S) mask following its window."""
    q, k, v = planted_sink_attention(B=6, H=2, T=8, D=16, n_sink=2)
    q, k, v = (t.view(2, 3, 2, 8, 16) for t in (q, k, v))
    keep = torch.ones(3, 1, 8, 8, dtype=torch.bool)
    keep[1, :, 4:, 0] = False  # window 1 loses a sink in rows 4-7
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k[:1], v, attn_mask=keep)
    model = Net(Fixed(q, k, v, sdpa))
    monitor = make_monitor(model, attention__batch=1)
    model()
    monitor.step()
    snap = monitor.snapshot()
    assert not any(monitor.errors.values())
    rep, ties, rows = oracle(q[0], k[0], causal=False, mask=keep)
    assert head_values(snap, "attn_rows", "block.attn", 2) == rows.tolist() == [24, 24]
    assert head_values(snap, "attn_repeated_max_rows", "block.attn", 2) == rep.tolist()
    assert rep.tolist() == [20, 20]
    assert head_values(snap, "attn_tie_entries", "block.attn", 2) == ties.tolist()
    assert snap.value("attn_output_error_rms", layer="block.attn", head="0") < 0.05
    monitor.detach()


def test_sdpa_of_mixed_ranks_is_a_clear_error(make_monitor):
    q = torch.randn(2, 1, 2, 4, 8)
    model = Net(Fixed(q, q[0], q[0], F.scaled_dot_product_attention))
    monitor = make_monitor(model, strict=True)
    with pytest.raises(ValueError, match=r"\(B, ..., H, T, D\) or unbatched \(H, T, D\)"):
        model()
    monitor.detach()


def test_sdpa_with_keyword_query_key_value(make_monitor):
    """F.scaled_dot_product_attention(query=..., key=..., value=...) is measured (and can be
    routed): the arguments were unpacked positionally."""
    q, k, v = planted_sink_attention(B=1, H=2, T=8, D=16, n_sink=2)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True)
    model = Net(Fixed(q, k, v, sdpa))
    monitor = make_monitor(model)
    model()
    monitor.step()
    rep, _, _ = oracle(q, k)
    snap = monitor.snapshot()
    assert head_values(snap, "attn_repeated_max_rows", "block.attn", 2) == rep.tolist() == [7, 7]
    call = SdpaCall.from_args((q,), {"key": k, "value": v, "is_causal": True, "other": 1})
    assert call.q is q and call.k is k and call.v is v
    assert (call.is_causal, call.extra) == (True, {"other": 1})


transformers = pytest.importorskip("transformers")


def tiny_llama(attn_implementation):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    cfg._attn_implementation = attn_implementation
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("impl", ["sdpa", "eager", "numwatch"])
def test_transformers_llama_every_implementation(make_monitor, impl):
    from numwatch.integrations.transformers import register_attention

    register_attention()
    model = tiny_llama(impl)  # in eval mode (no dropout): measured all the same
    monitor = make_monitor(model, activations__enabled=False, attention__training_only=False)
    ids = torch.randint(0, 32, (2, 7))
    model(input_ids=ids)
    monitor.step()
    snap = monitor.snapshot()
    layers = {r.labels["layer"] for r in snap.series("attn_calls")}
    assert layers == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    for layer in layers:
        assert head_values(snap, "attn_rows", layer, 4) == [14] * 4  # 2 x 7 rows, causal


def test_transformers_numwatch_implementation_keeps_padding_masks():
    from numwatch.integrations.transformers import register_attention

    register_attention()
    ref, ours = tiny_llama("sdpa"), tiny_llama("numwatch")
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(1, 32, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    other = ids.clone()
    other[1, :3] = 5  # different tokens under the padding must not change anything
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = ours(input_ids=other, attention_mask=mask).logits
        c = ref(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(a[1, 3:], b[1, 3:], atol=1e-5)
    assert torch.allclose(a, c, atol=1e-5)


def test_numwatch_implementation_refuses_attention_sdpa_cannot_compute():
    """GPT-OSS's learned sinks: transformers refuses "sdpa" for it, but took "numwatch", whose
    SDPA path dropped the sinks silently (logits 0.18 off eager's); Gemma 2's soft-capping
    raised an error that named sdpa."""
    try:
        from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM
    except ImportError:
        pytest.skip("this transformers has no GPT-OSS or Gemma 2")
    from numwatch.integrations.transformers import register_attention

    register_attention()
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    gpt_oss = GptOssForCausalLM(
        GptOssConfig(
            vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
            num_experts_per_tok=1, _attn_implementation="numwatch",
        )
    )  # fmt: skip
    with pytest.raises(ValueError, match="attention sinks of GptOssAttention"):
        gpt_oss(input_ids=ids)
    gemma2 = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            _attn_implementation="numwatch",
        )
    )  # fmt: skip
    with pytest.raises(ValueError, match=r'soft-capping .*attn_implementation="eager"'):
        gemma2(input_ids=ids)


def test_numwatch_implementation_refuses_per_token_sinks_and_passes_other_keywords():
    """Inkling2 passes its learned sinks as `sinks=`, not GPT-OSS's `s_aux=`: the SDPA path
    dropped them (logits 0.05 off eager's). Keywords SDPA rightly ignores still pass."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from numwatch.integrations.transformers import numwatch_attention_forward

    layer = nn.Linear(1, 1)
    q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)  # (B, H, T, D)
    with pytest.raises(ValueError, match=r"learned attention sinks of Linear \(sinks=\)"):
        numwatch_attention_forward(layer, q, k, v, None, sinks=torch.zeros(2))
    harmless = dict(sliding_window=3, position_ids=torch.arange(5), num_items_in_batch=7)
    out, _ = numwatch_attention_forward(layer, q, k, v, None, scaling=0.5, **harmless)
    assert torch.equal(out, sdpa_attention_forward(layer, q, k, v, None, scaling=0.5)[0])


def test_attach_refuses_numwatch_implementation_on_models_that_cannot_run_it(make_monitor):
    """Bloom computes attention in its own code: transformers took "numwatch" for it, never
    called numwatch's attention, and Bloom added the None/boolean mask made for SDPA as a float
    mask (no causal mask: a changed last token moved the logits before it by 1.5e-3). GPT-OSS
    (learned sinks), which transformers refuses "sdpa" for, is refused at attach too."""
    try:
        from transformers import BloomConfig, BloomForCausalLM, GptOssConfig, GptOssForCausalLM
    except ImportError:
        pytest.skip("this transformers has no GPT-OSS")
    from numwatch.errors import NumwatchConfigError
    from numwatch.integrations.transformers import register_attention

    register_attention()
    cfg = BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4)
    cfg._attn_implementation = "numwatch"
    bloom = BloomForCausalLM(cfg)
    with pytest.raises(
        NumwatchConfigError,
        match=r'BloomForCausalLM computes attention in its own code.*attn_implementation="eager",',
    ):
        make_monitor(bloom)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in bloom.modules())
    gpt_oss = GptOssForCausalLM(
        GptOssConfig(
            vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
            num_experts_per_tok=1, _attn_implementation="numwatch",
        )
    )  # fmt: skip
    with pytest.raises(NumwatchConfigError, match='GptOssForCausalLM is refused "sdpa"'):
        make_monitor(gpt_oss)
    make_monitor(tiny_llama("numwatch")).detach()  # through AttentionInterface, SDPA's math


# A trust_remote_code-style model file: {attention} computes the (B, H, T, D) attention output.
_REMOTE_MODEL = """
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


class TinyConfig(PretrainedConfig):
    model_type = "tiny-remote"


class TinyAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config, self.qkv = config, nn.Linear(8, 24)
        self.scaling, self.is_causal = 0.5, True

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, 2, 4).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        out = {attention}
        return out.transpose(1, 2).reshape(B, T, C)


class TinyModel(PreTrainedModel):
    config_class = TinyConfig
    _supports_sdpa = True

    def __init__(self, config):
        super().__init__(config)
        self.attn = TinyAttention(config)
        self.post_init()

    def forward(self, x):
        return self.attn(x)
"""
_INDEXED = (
    "ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]"
    "(self, q, k, v, None)[0].transpose(1, 2)"
)
_GET_INTERFACE = (
    "ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)"
    "(self, q, k, v, None)[0].transpose(1, 2)"
)
_OWN_CODE = "torch.softmax(q @ k.transpose(-1, -2) * self.scaling, -1) @ v"


@pytest.mark.parametrize(
    ("name", "attention", "readable", "compiled", "runs_it"),
    [
        pytest.param(*case, id=case[0])
        for case in [
            ("remote_indexed", _INDEXED, True, False, True),  # transformers 4.5x style
            ("remote_compiled", _INDEXED, True, True, True),  # compiled after attach
            ("notebook_interface", _GET_INTERFACE, False, False, True),  # a notebook's class
            ("notebook_own_code", _OWN_CODE, False, False, False),
        ]
    ],
)
def test_attach_takes_numwatch_implementation_where_the_source_test_cannot_tell(
    make_monitor, tmp_path, monkeypatch, caplog, name, attention, readable, compiled, runs_it
):
    """transformers' _can_set_attn_implementation is a text search for
    ALL_ATTENTION_FUNCTIONS.get_interface( in the model's file: False for a model that indexes
    ALL_ATTENTION_FUNCTIONS[...] and for one whose file cannot be read, though both run
    numwatch's attention. attach() refused them; it now takes them and checks the first forward
    instead (compiled: numwatch's attention runs while Dynamo traces it), which warns, once,
    where numwatch's attention did not run."""
    import importlib
    import linecache

    from numwatch.integrations.transformers import register_attention

    register_attention()
    (tmp_path / f"{name}.py").write_text(_REMOTE_MODEL.format(attention=attention))
    monkeypatch.syspath_prepend(str(tmp_path))
    remote = importlib.import_module(name)
    monkeypatch.delitem(sys.modules, name)
    if not readable:  # as a class defined in a notebook cell or read from stdin
        (tmp_path / f"{name}.py").unlink()
        linecache.clearcache()
    model = remote.TinyModel(remote.TinyConfig(attn_implementation="numwatch"))
    assert model.config._attn_implementation == "numwatch"
    assert remote.TinyModel._can_set_attn_implementation() is False
    monitor = make_monitor(model, attention__every=1)
    run = torch.compile(model, backend="eager") if compiled else model
    x = torch.randn(2, 3, 8)
    for _ in range(2):
        run(x)
        monitor.step()
    told = [r.getMessage() for r in caplog.records if "without calling numwatch" in r.getMessage()]
    monitor.detach()
    if runs_it:
        assert told == []
        assert monitor.snapshot().series("attn_max_logit")  # measured through numwatch's SDPA
    else:
        assert len(told) == 1  # the first forward only
        assert told[0].startswith(
            'numwatch: attn_implementation="numwatch": TinyModel ran a forward without calling '
            "numwatch's attention: it computes attention in its own code"
        )


@pytest.mark.parametrize("impl", ["sdpa", "numwatch"])
def test_generate_with_a_padding_mask_measures_every_forward_by_query_head(make_monitor, impl):
    """Decoding with a mask, Hugging Face's SDPA attention packs a GQA query (B, heads, 1, D) as
    (B, key heads, group, D). Measured as it came, the layer's head count changed after the
    prefill and the window's statistics started over (the prefill lost), with key heads
    labelled as heads."""
    from numwatch.integrations.transformers import register_attention

    if impl == "numwatch":
        register_attention()
    model = tiny_llama(impl)
    ids = torch.randint(2, 32, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded batch
    layer = "model.layers.0.self_attn"
    for new in (1, 3):
        monitor = make_monitor(
            model, attention__training_only=False, attention__batch=1, flush_every=1000,
            strict=True,
        )  # fmt: skip
        model.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0
        )
        snap = monitor.flush()
        assert snap.value("attn_calls", layer=layer) == new
        # batch element 0 (7 real tokens): 7 prefill rows, then one row per decoded token
        assert head_values(snap, "attn_rows", layer, 4) == [7 + new - 1] * 4
        monitor.detach()


def test_generate_of_an_encoder_decoder_measures_the_encoder(make_monitor):
    """generate() runs the encoder through get_encoder(), outside the model's forward: its
    attention was never measured."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BartConfig(
        vocab_size=32, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, forced_eos_token_id=None,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(cfg).eval()
    ids = torch.randint(3, 32, (2, 7), generator=torch.Generator().manual_seed(0))
    monitor = make_monitor(model, attention__training_only=False, flush_every=1000)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    calls = {r.labels["layer"]: r.value for r in monitor.flush().series("attn_calls")}
    assert calls == {
        "model.encoder.layers.0.self_attn": 1.0,
        "model.decoder.layers.0.self_attn": 3.0,
        "model.decoder.layers.0.encoder_attn": 3.0,
    }
    monitor.detach()
    assert not model.get_encoder()._forward_pre_hooks


def test_activation_statistics_do_not_pass_through_the_attention_mode(make_monitor, monkeypatch):
    """On sampled steps the attention probe's TorchFunctionMode sees every torch call of the
    forward; the activation probe's own calls (hooks, statistics) must not add to them."""
    from numwatch.probes import attention as probe_module

    calls = []
    real = probe_module._Interceptor.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        calls.append(func)
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(probe_module._Interceptor, "__torch_function__", counting)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x):
            h = self.proj(x).view(2, 9, 1, 16).transpose(1, 2)
            return F.scaled_dot_product_attention(h, h, h, is_causal=True).sum()

    model = nn.Sequential(Block(), nn.Identity())
    x = torch.randn(2, 9, 16)
    counts = {}
    for activations in (False, True):
        monitor = make_monitor(
            model, activations__enabled=activations, activations__every=1,
            activations__max_pending_bytes=1,  # measure in every hook, inside the forward
        )  # fmt: skip
        calls.clear()
        model(x)
        counts[activations] = len(calls)
        monitor.step()
        assert monitor.snapshot().value("monitor_errors_total", component="activations") == 0
        if activations:
            assert monitor.snapshot().value("activation_numel", module="0.proj") == 2 * 9 * 16
        monitor.detach()
    assert counts[True] == counts[False] > 0
