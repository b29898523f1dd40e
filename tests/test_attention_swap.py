"""Kernel hot-swap: routing attention layers to numwatch's flash attention at step boundaries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import numwatch
from numwatch.actions import swap_kernel
from numwatch.actions.library import SwapAttentionKernel
from numwatch.kernels.flash_attention import flash_attention, flash_attention_fallbacks
from numwatch.testing import planted_sink_attention


class Attn(nn.Module):
    def __init__(self, d=32, heads=2, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.dropout = dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return out.transpose(1, 2).reshape(x.shape)


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Attn()
        self.b = Attn()

    def forward(self, x):
        return self.b(self.a(x))


def spy_kernel(monkeypatch, *keys: str) -> list:
    """The ``keys`` arguments of each call of numwatch's kernel through the routing (one value
    per call for one key, else a tuple); the kernel still runs."""
    seen = []
    real = swap_kernel.flash_attention

    def spy(q, *args, **kwargs):
        got = tuple(kwargs[k] for k in keys)
        seen.append(got[0] if len(keys) == 1 else got)
        return real(q, *args, **kwargs)

    monkeypatch.setattr(swap_kernel, "flash_attention", spy)
    return seen


@pytest.fixture
def calls(monkeypatch):
    """The mode of each call of numwatch's kernel through the routing."""
    return spy_kernel(monkeypatch, "mode")


def monitor_for(model, **kw):
    kw.setdefault("sinks__console__enabled", False)
    kw.setdefault("sinks__jsonl__enabled", False)
    kw.setdefault("flush_every", 1)
    return numwatch.Monitor(model, **kw).attach()


def test_swap_routes_exactly_the_chosen_layers(calls):
    torch.manual_seed(0)
    model = Two().to(torch.bfloat16)
    monitor = monitor_for(model)
    x = torch.randn(2, 7, 32, dtype=torch.bfloat16)
    native = model(x)
    monitor.step()
    snap = monitor.snapshot()
    assert snap.value("attn_kernel_stabilized", layer="a") == 0
    monitor.swap_attention("b", beta=4.0)  # between steps: applies at once
    out = model(x)
    monitor.step()
    assert calls == ["stabilized"]  # one call: layer b only
    assert monitor.attention_kernel("b") == swap_kernel.AttentionKernel(beta=4.0)
    assert monitor.attention_kernel("a") is None
    snap = monitor.snapshot()
    assert snap.value("attn_kernel_stabilized", layer="b") == 1
    assert snap.value("attn_kernel_stabilized", layer="a") == 0
    # bf16 outputs of two correct kernels: within a few bf16 ulps of each other
    torch.testing.assert_close(out, native, atol=3e-2, rtol=3e-2)

    monitor.restore_attention()
    model(x)
    monitor.step()
    assert len(calls) == 1
    assert monitor.snapshot().value("attn_kernel_stabilized", layer="b") == 0


class Checkpointed(nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        self.a = Attn()
        self.use_reentrant = use_reentrant

    def forward(self, x):
        if self.use_reentrant is None:
            return self.a(x)
        return torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpointed_layer_recomputes_with_the_kernel_it_is_routed_to(calls, use_reentrant):
    """Activation checkpointing runs a layer's forward again in backward, outside the model's
    forward. That recompute ran native SDPA: non-reentrant checkpointing refused the mismatch
    (a CheckpointError: backward failed), reentrant silently took native SDPA's gradients. A
    route set before the layer was ever seen holds too; the recompute is not measured again."""

    def run(use_reentrant):
        torch.manual_seed(0)
        model = Checkpointed(use_reentrant).to(torch.bfloat16)
        hooks = (dict(model.a._forward_pre_hooks), dict(model.a._forward_hooks))
        monitor = monitor_for(model, attention__every=1)
        monitor.swap_attention(mode="paper_repro")  # before the first forward
        x = (torch.randn(2, 16, 32) * 4).to(torch.bfloat16).requires_grad_()
        model(x).float().mul(torch.linspace(-1, 1, 32)).sum().backward()
        monitor.step()
        rows = monitor.snapshot().value("attn_rows", layer="a", head="0")
        monitor.detach()
        assert (dict(model.a._forward_pre_hooks), dict(model.a._forward_hooks)) == hooks
        return model.a.qkv.weight.grad, x.grad, rows

    plain = run(None)
    checkpointed = run(use_reentrant)
    assert torch.equal(checkpointed[0], plain[0]) and torch.equal(checkpointed[1], plain[1])
    assert checkpointed[2] == plain[2] > 0
    assert calls == ["paper_repro"] * 3  # forward; forward and its recompute


def test_a_keyboard_interrupt_in_a_routed_recompute_leaves_the_next_step_working(calls):
    """Ctrl-C inside a checkpointed layer's recompute (in backward): its exit hook never ran and
    the autograd engine dropped the mode the entry pushed. The stale state then popped the
    model's own mode in the next forward: 'trying to pop from empty mode stack'."""
    torch.manual_seed(0)
    model = Checkpointed(use_reentrant=False).to(torch.bfloat16)
    monitor = monitor_for(model)
    monitor.swap_attention()
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    interrupt = [False]

    def ctrl_c(_module, _inputs):
        if interrupt[0]:
            interrupt[0] = False
            raise KeyboardInterrupt

    model.a.qkv.register_forward_pre_hook(ctrl_c)
    loss = model(x).float().sum()
    interrupt[0] = True
    with pytest.raises(KeyboardInterrupt):
        loss.backward()
    monitor.step()
    model(x).float().sum().backward()
    monitor.step()
    assert calls == ["stabilized"] * 3  # forward, interrupted step; forward, recompute
    assert torch.overrides._get_current_function_mode_stack() == []
    monitor.detach()


def test_a_keyboard_interrupt_in_a_routed_layer_called_alone_leaves_no_mode_behind(calls):
    """Ctrl-C inside a routed layer called outside the model (nothing unwinds the mode stack
    there): its mode stayed entered, and every later sampled step counted attention twice."""
    torch.manual_seed(0)
    model = Two().to(torch.bfloat16)
    monitor = monitor_for(model, attention__every=1)
    monitor.swap_attention("a")
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16)

    def train_step():
        model(x).float().sum().backward()
        monitor.step()
        snap = monitor.snapshot()
        return [snap.value("attn_rows", layer=layer, head="0") for layer in ("a", "b")]

    assert train_step() == [8, 8]  # the first batch element's rows
    ctrl_c = model.a.qkv.register_forward_pre_hook(
        lambda *_: (_ for _ in ()).throw(KeyboardInterrupt)
    )
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model.a(x)
    ctrl_c.remove()
    assert train_step() == [8, 8]  # the first batch element's rows
    assert torch.overrides._get_current_function_mode_stack() == []
    monitor.detach()


def test_a_layer_first_seen_inside_a_routed_call_leaves_no_mode_after_detach(calls):
    """A routed layer called alone whose child calls SDPA for the first time: hooking the
    child unhooked every routed layer, the running one's exit hook too, and its mode stayed on
    the stack after detach(): the model ran numwatch's kernel from then on."""

    class Cross(nn.Module):
        def forward(self, x):
            return _self_attention(x)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.cross = Cross()

        def forward(self, x, cross=False):
            x = _self_attention(self.lin(x))
            return self.cross(x) if cross else x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = Outer()

        def forward(self, x, cross=False):
            return self.p(x, cross)

    model = Model().to(torch.bfloat16)
    monitor = monitor_for(model)
    monitor.swap_attention()
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    monitor.step()
    with torch.no_grad():
        model.p(x, cross=True)  # the layer alone, its child seen first here
    assert torch.overrides._get_current_function_mode_stack() == []
    assert len(calls) == 3  # p in the forward; p and p.cross alone
    monitor.detach()
    with torch.no_grad():
        model(x)
        model.p(x)
    assert len(calls) == 3


def _self_attention(x):
    B, T, C = x.shape
    q = x.view(B, T, 2, C // 2).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(x.shape)


def test_routed_models_under_torch_func_transforms(calls):
    """torch.func through a routed model (per-sample gradients): the kernel cannot run the
    transform's tensors and raised; it falls back to SDPA now. A vmap call on a sampled step
    held batched tensors for the flush, which failed and lost the step's attention statistics."""
    torch.manual_seed(0)
    model = Attn()
    monitor = monitor_for(model, attention__every=1, strict=True)
    x = torch.randn(4, 8, 32)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi):
        return torch.func.functional_call(model, p, (xi[None],)).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))
    for routed in (False, True):
        if routed:
            monitor.swap_attention()
        before = flash_attention_fallbacks().get("functorch", 0)
        grads = per_sample(params, x)
        model(x).sum().backward()
        monitor.step()
        assert grads["qkv.weight"].shape == (4, 96, 32)
        assert monitor.snapshot().value("attn_rows", layer="", head="0") == 8
        assert flash_attention_fallbacks().get("functorch", 0) - before == routed
    assert calls == ["stabilized"] * 2  # the routed step's vmap call (fell back) and forward
    monitor.detach()


def test_kernel_fallbacks_are_counted_per_monitor():
    """attn_kernel_fallbacks_total was the process's count: a later run (another monitor, no
    route) reported an earlier one's fallbacks, and calls outside the monitor counted in."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)  # fp32: each routed call falls back (reason 'dtype')
    first = monitor_for(Attn())
    first.swap_attention()
    before = flash_attention_fallbacks().get("dtype", 0)
    for step in range(3):
        first.model(x)
        if step == 2:  # numwatch's kernel called directly, not through the monitor's routes
            flash_attention(x.view(2, 8, 2, 16), x.view(2, 8, 2, 16), x.view(2, 8, 2, 16))
        first.step()
    assert first.snapshot().value("attn_kernel_fallbacks_total", reason="dtype") == 3
    assert flash_attention_fallbacks().get("dtype", 0) - before == 4
    first.detach()
    second = monitor_for(Attn())
    second.model(x)
    second.step()
    assert second.snapshot().series("attn_kernel_fallbacks_total") == []
    second.detach()


def test_a_routed_layer_whose_calls_fall_back_to_sdpa_reads_the_share_the_kernel_ran(caplog):
    """A layer with attention dropout (Hugging Face GPT-2's default attn_pdrop=0.1) routed to
    the stabilized kernel read attn_kernel_stabilized 1 while every call of it fell back to
    SDPA, unsaid. It reads the share of its step's calls that ran the kernel, and is named once
    with the reason."""
    torch.manual_seed(0)
    model = Two().to(torch.bfloat16)
    model.b.dropout = 0.1
    monitor = monitor_for(model)
    monitor.swap_attention()
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)

    def step(*train: bool) -> list[float]:  # one forward per mode: dropout in train mode only
        for mode in train:
            model.train(mode)(x)
        monitor.step()
        s = monitor.snapshot()
        mode_b = s.value("attn_kernel_mode", layer="b", mode="stabilized")
        return [s.value("attn_kernel_stabilized", layer=name) for name in "ab"] + [mode_b]

    with caplog.at_level("WARNING", logger="numwatch"):
        assert step(True) == [1.0, 0.0, 0.0]
        assert step(True, False) == [1.0, 0.5, 0.5]
        assert step(False) == [1.0, 1.0, 1.0]
    said = [r.getMessage() for r in caplog.records if "fall back" in r.getMessage()]
    assert len(said) == 1 and "layer 'b'" in said[0] and "dropout_p > 0" in said[0], said
    assert monitor.snapshot().value("attn_kernel_fallbacks_total", reason="dropout") == 2
    assert monitor.attention_kernel("b") == swap_kernel.AttentionKernel()  # routed all along


def test_a_routed_fp32_model_reads_0_and_says_why(caplog):
    model = Two()  # fp32: every routed call falls back (reason 'dtype')
    monitor = monitor_for(model)
    monitor.swap_attention()
    with caplog.at_level("WARNING", logger="numwatch"):
        model(torch.randn(2, 5, 32))
        monitor.step()
    snap = monitor.snapshot()
    assert [snap.value("attn_kernel_stabilized", layer=name) for name in "ab"] == [0.0, 0.0]
    said = [r.getMessage() for r in caplog.records if "fall back" in r.getMessage()]
    assert len(said) == 2 and all("not bf16 or fp16" in m for m in said), said


def test_routes_that_name_only_multihead_attention_leave_forwards_alone(calls):
    """Routes naming nn.MultiheadAttention layers (which cannot be swapped; the default rules'
    swaps name layers) kept the mode entered in every forward, which turns
    nn.TransformerEncoder's nested-tensor fast path off: a validation forward's outputs at
    padded positions changed."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(3, 6, 16)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True
    with torch.no_grad():
        ref = enc(x, src_key_padding_mask=pad)  # the fast path: zeros at padded positions
    monitor = monitor_for(enc)
    monitor.swap_attention(["layers.0.self_attn", "layers.1.self_attn"])
    with torch.no_grad():
        enc(x, src_key_padding_mask=pad)  # the first forward finds the layers unroutable
        out = enc(x, src_key_padding_mask=pad)
    monitor.detach()
    assert torch.equal(out, ref)


def test_a_layer_routed_before_it_ever_ran_is_routed_on_every_step(calls):
    """A route set before its layer first called SDPA (a branch taken on later steps only)
    must take it on unsampled steps too."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Attn(), Attn()

        def forward(self, x, use_b=False):
            x = self.a(x)
            return self.b(x) if use_b else x

    torch.manual_seed(0)
    model = Branchy().to(torch.bfloat16)
    monitor = monitor_for(model, attention__every=50)
    x = torch.randn(2, 7, 32, dtype=torch.bfloat16)
    model(x)
    monitor.step()
    monitor.swap_attention("b")
    for step in range(1, 5):
        model(x, use_b=step >= 2)
        monitor.step()
    assert calls == ["stabilized"] * 3
    monitor.detach()


def test_multihead_attention_cannot_be_swapped_and_says_so(calls, caplog):
    """nn.MultiheadAttention computes attention inside torch's multi_head_attention_forward,
    out of the interception's reach: the swap warns once and the metric stays 0 (it said 1 while
    no call reached the kernel)."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(32, 2, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    torch.manual_seed(0)
    model = Block()
    monitor = monitor_for(model, attention__every=1)
    x = torch.randn(2, 5, 32)
    native = model(x)
    monitor.step()
    monitor.swap_attention("mha")
    with caplog.at_level("WARNING", logger="numwatch"):
        for _ in range(2):
            out = model(x)
            monitor.step()
    assert calls == []
    assert torch.equal(out, native)
    warned = [r.getMessage() for r in caplog.records if "cannot be swapped" in r.getMessage()]
    assert len(warned) == 1 and "'mha' is nn.MultiheadAttention" in warned[0]
    assert monitor.snapshot().value("attn_kernel_stabilized", layer="mha") == 0


def test_swap_mid_step_waits_for_the_step_boundary(calls):
    torch.manual_seed(0)
    model = Two().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = monitor_for(model)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    model(x).float().square().mean().backward()  # micro-batch 1
    monitor.swap_attention()  # requested in the middle of gradient accumulation
    model(x).float().square().mean().backward()  # micro-batch 2: still native
    assert calls == []
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    opt.zero_grad()
    monitor.step()  # boundary: the swap takes effect now
    assert all(torch.equal(v, state_before[k]) for k, v in model.state_dict().items())
    assert opt.state == {}  # the swap touches no optimizer state
    loss = model(x).float().square().mean()
    loss.backward()
    assert calls == ["stabilized", "stabilized"]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_each_flush_reports_the_kernels_its_step_ran(calls, caplog):
    """A swap queued mid-step was reported by that step's flush although the step ran native
    SDPA; a reproduction mode read like native SDPA (attn_kernel_stabilized 0, no other
    trace)."""
    torch.manual_seed(0)
    model = Two().to(torch.bfloat16)
    monitor = monitor_for(model)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)

    def step():
        model(x).float().square().mean().backward()
        monitor.step()

    model(x).float().square().mean().backward()
    monitor.swap_attention("a")  # mid-step: from step 1 on
    step()  # step 0: native
    step()  # step 1: layer a stabilized
    with caplog.at_level("WARNING", logger="numwatch"):
        monitor.swap_attention("b", mode="paper_repro")  # between steps: now
    step()  # step 2: a stabilized, b the paper's emulation
    assert any("for reproductions and tests" in r.getMessage() for r in caplog.records)
    got = [
        (
            s.value("attn_kernel_stabilized", layer="a"),
            s.value("attn_kernel_stabilized", layer="b"),
            {tuple(r.labels.values()) for r in s.series("attn_kernel_mode")},
        )
        for s in monitor.history
    ]
    assert got == [
        (0.0, 0.0, set()),
        (1.0, 0.0, {("a", "stabilized")}),
        (1.0, 0.0, {("a", "stabilized"), ("b", "paper_repro")}),
    ]


def test_split_sum_is_routed_reported_and_upgraded_by_the_action(monkeypatch):
    """swap_attention(split_sum=True) reaches the kernel and names itself in attn_kernel_mode;
    a swap_attention_kernel action with split_sum re-routes a layer that runs the stabilized
    kernel without it (and leaves one that has it)."""
    seen = spy_kernel(monkeypatch, "mode", "split_sum")
    torch.manual_seed(0)
    model = Two().to(torch.bfloat16)
    monitor = monitor_for(model)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    monitor.swap_attention("a", split_sum=True)
    monitor.swap_attention("b")
    model(x)
    monitor.step()
    assert seen == [("stabilized", True), ("stabilized", False)]
    modes = {tuple(r.labels.values()) for r in monitor.snapshot().series("attn_kernel_mode")}
    assert modes == {("a", "stabilized_split"), ("b", "stabilized")}
    action = SwapAttentionKernel(split_sum=True)
    for layer in ("a", "b"):
        event = numwatch.Event(kind="precursor", step=1, message="m", labels={"layer": layer})
        done = action.run(monitor, event)
        assert (done is None) == (layer == "a"), (layer, done)
    assert monitor.attention_kernel("b") == swap_kernel.AttentionKernel(split_sum=True)
    # the default action (no split) leaves a split layer as it is: it only ever upgrades
    event = numwatch.Event(kind="precursor", step=2, message="m", labels={"layer": "a"})
    assert SwapAttentionKernel().run(monitor, event) is None
    monitor.swap_attention("a", mode="plain", split_sum=True)  # plain split: stabilized, split
    assert SwapAttentionKernel().run(monitor, event) is not None
    assert monitor.attention_kernel("a") == swap_kernel.AttentionKernel(split_sum=True)
    with pytest.raises(ValueError, match="split_sum"):
        monitor.swap_attention("a", mode="paper_repro", split_sum=True)


def test_swapping_all_layers_keeps_a_layer_already_on_a_stabilized_kernel(monkeypatch):
    """scope 'all' set a '*' route over every per-layer one: a layer the user had put on the
    split sum with its own beta was taken back to one sum and beta 2; the others are routed."""
    seen = spy_kernel(monkeypatch, "beta", "split_sum")
    torch.manual_seed(0)
    model = Two().to(torch.bfloat16)
    monitor = monitor_for(model)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    monitor.swap_attention("a", beta=4.0, split_sum=True)
    model(x)
    monitor.step()
    event = numwatch.Event(kind="precursor", step=1, message="m", labels={"layer": "b"})
    assert SwapAttentionKernel(scope="all").run(monitor, event) is not None
    assert monitor.attention_kernel("a") == swap_kernel.AttentionKernel(beta=4.0, split_sum=True)
    assert monitor.attention_kernel("b") == swap_kernel.AttentionKernel()
    seen.clear()
    model(x)
    monitor.step()
    assert seen == [(4.0, True), (2.0, False)]
    # an action with split_sum upgrades the kept layer, beta still its own
    SwapAttentionKernel(scope="all", split_sum=True).run(monitor, event)
    assert monitor.attention_kernel("a") == swap_kernel.AttentionKernel(beta=4.0, split_sum=True)
    assert monitor.attention_kernel("b") == swap_kernel.AttentionKernel(split_sum=True)


@pytest.mark.parametrize("kind", ["eager", "direct_kernel"])
def test_attention_a_route_cannot_take_is_not_reported_as_swapped(kind, caplog):
    """Eager softmax and numwatch's kernel called by the model itself are observed only: the
    swap action said it routed them (training unchanged), and a layer on paper_repro read as
    stabilized."""
    from numwatch.actions.library import SwapAttentionKernel
    from numwatch.events import Event
    from numwatch.kernels import flash_attention

    class Layer(nn.Module):
        def forward(self, x):
            q = x.view(1, 2, -1, 8)
            if kind == "eager":
                return torch.softmax(q @ q.transpose(-1, -2), dim=-1) @ q
            return flash_attention(q, q, q, mode="paper_repro")

    model = nn.Sequential(Layer())
    monitor = monitor_for(model, attention__every=1)
    x = torch.randn(6, 16, dtype=torch.bfloat16)
    model(x)
    monitor.step()
    event = Event(kind="precursor", step=0, message="m", rule="r", labels={"layer": "0"})
    with caplog.at_level("WARNING", logger="numwatch"):
        assert SwapAttentionKernel().run(monitor, event) is None
    assert any("cannot route layer '0'" in r.getMessage() for r in caplog.records)
    monitor.swap_attention("0")
    model(x)
    monitor.step()
    snap = monitor.snapshot()
    assert snap.get("attn_kernel_stabilized", layer="0") in (None, 0.0)
    assert snap.series("attn_kernel_mode") == []


def test_swap_needs_an_attached_monitor():
    monitor = numwatch.Monitor(Two(), sinks__console__enabled=False, sinks__jsonl__enabled=False)
    with pytest.raises(numwatch.NumwatchError, match="attached"):
        monitor.swap_attention()
    monitor.attach()
    with pytest.raises(ValueError, match="beta"):
        monitor.swap_attention(beta=0.5)


def test_layers_given_as_a_generator_are_routed_and_restored_like_a_list(calls):
    """A generator was used up by the pattern check: swap and restore routed nothing, and a
    user who restored native SDPA that way stayed on numwatch's kernel."""
    model = Two()
    monitor = monitor_for(model)
    model(torch.randn(2, 5, 32))
    monitor.step()
    monitor.swap_attention(name for name in ("a", "b"))
    assert {k: v is not None for k, v in monitor.attention_routing().items()} == {
        "a": True, "b": True
    }  # fmt: skip
    monitor.restore_attention(name for name in ("a",))
    assert {k: v is not None for k, v in monitor.attention_routing().items()} == {
        "a": False, "b": True
    }  # fmt: skip
    with pytest.raises(TypeError, match=r"globs \(str\), got Attn"):
        monitor.swap_attention([model.a])
    monitor.detach()


def test_a_layer_pattern_that_matches_no_module_says_so(caplog):
    monitor = monitor_for(Two())
    with caplog.at_level("WARNING", logger="numwatch"):
        monitor.swap_attention(["a", "blocks.*.attn"])  # the second: a typo'd path
        monitor.restore_attention("b*")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "'blocks.*.attn' matches no module" in said[0]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()
        self.mlp = nn.Linear(32, 32)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


def test_a_pattern_naming_a_block_routes_its_attention_and_one_naming_no_attention_says_so(
    calls, caplog
):
    """Routes matched only the module that calls SDPA: swap_attention('blocks.0') (the block
    whose attention a user means) and swap_attention('blocks.0.mlp') routed nothing, unsaid. A
    pattern takes the attention layers inside the modules it matches; one that takes no layer
    calling SDPA is said once, after the first forward that shows which layers do."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).to(torch.bfloat16)
    monitor = monitor_for(model)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)

    def step() -> list[float]:
        model(x)
        monitor.step()
        return [monitor.snapshot().value("attn_kernel_stabilized", layer=f"{i}.attn") for i in "01"]

    monitor.swap_attention("0")
    with caplog.at_level("WARNING", logger="numwatch"):
        assert step() == [1.0, 0.0]
        assert calls == ["stabilized"]
        assert monitor.attention_kernel("10.attn") is None  # '0' is a path, not a prefix
        monitor.restore_attention("0.attn")  # the last route wins, as between globs
        assert step() == [0.0, 0.0]
        monitor.swap_attention("1.mlp")
        assert step() == [0.0, 0.0]
        assert step() == [0.0, 0.0]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "'1.mlp' matches no layer that calls" in said[0], said
    assert "'0.attn', '1.attn'" in said[0]


class Planted(nn.Module):
    def __init__(self, q, k, v):
        super().__init__()
        self.q, self.k, self.v = q, k, v

    def forward(self):
        return F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=True)


class Holder(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self):
        return self.attn()


def test_probe_sees_paper_kernel_bias_and_stabilized_kernel_without_it():
    """The closed loop in small: the probe measures the signed error of the routed kernel."""
    q, k, v = planted_sink_attention(B=1, H=2, T=128, D=64, n_sink=2, gap=14.0)
    model = Holder(Planted(q, k, v))
    bias = {}
    for mode in ("paper_repro", "stabilized", "paper_repro_stabilized"):
        monitor = monitor_for(model, attention__every=1)
        monitor.swap_attention(mode=mode)
        model()
        monitor.step()
        snap = monitor.snapshot()
        bias[mode] = [snap.value("attn_output_bias", layer="attn", head=str(h)) for h in (0, 1)]
        monitor.detach()
    assert all(b < -0.9 for b in bias["paper_repro"]), bias
    assert all(abs(b) < 0.5 for b in bias["stabilized"]), bias
    assert all(abs(b) < 0.5 for b in bias["paper_repro_stabilized"]), bias  # the paper's fix
