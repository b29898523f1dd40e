"""Monitoring a torch.compile'd model: the hooks run outside the compiled graphs
(``torch.compiler.disable``), so observation neither breaks nor splits them.

Before, Dynamo traced numwatch's hooks: AOTAutograd then failed on a sampled step with both the
activation and the attention probe on (a view of an activation the hook had kept was replayed
from the wrong base: "shape '[4, 64, 384]' is invalid for input of size 32768").
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import numwatch
from numwatch.kernels.flash_attention import flash_attention_fallbacks
from numwatch.probes.tensors import ActivationProbe
from numwatch.testing import requires_gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt2 import GPT, GPTConfig, train_step

CFG = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32)


def _run(compiled: bool, steps: int, make_monitor) -> tuple[numwatch.Monitor, list]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = make_monitor(
        model,
        flush_every=4,
        activations__every=2,
        attention__every=2,
        weights__every=2,
        optimizer__every=2,
    ).attach(opt)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    g = torch.Generator().manual_seed(1)
    frames = []
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
        torch._dynamo.utils.counters.clear()
        train_step(run, opt, x, x.roll(-1, 1), monitor)
        frames.append(sum(torch._dynamo.utils.counters["frames"].values()))
    monitor.detach()
    return monitor, frames


def test_compiled_model_is_monitored_like_the_eager_one(make_monitor):
    torch._dynamo.reset()
    compiled, frames = _run(True, 8, make_monitor)
    eager, _ = _run(False, 8, make_monitor)
    assert not compiled._guard.errors and not eager._guard.errors
    got, want = compiled.snapshot(), eager.snapshot()
    for name, labels in [
        ("grad_absmax", {"param": "h.0.attn.c_attn.weight"}),
        ("activation_absmax", {"module": "h.0.attn.c_attn"}),
        ("attn_max_logit", {"layer": "h.0.attn", "head": "1"}),
        ("attn_rows", {"layer": "h.0.attn", "head": "0"}),
        ("weight_spectral_norm", {"param": "h.0.attn.c_attn.weight"}),
    ]:
        assert got.value(name, **labels) == pytest.approx(want.value(name, **labels), rel=1e-5)
    # Steps 6 and 7 (sampled, then not) reuse graphs compiled earlier: no new frames.
    assert frames[6:] == [0, 0]
    # The hooks' wrapper is never compiled as a frame of its own (once per module type it met,
    # up to Dynamo's recompile limit, when it was)
    hook_code = ActivationProbe._hook.__code__
    assert torch._dynamo.eval_frame._debug_get_cache_entry_list(hook_code) == []


@pytest.mark.parametrize(
    ("device", "n_embd"),
    [
        ("cpu", 32),
        pytest.param("cuda", 32, marks=requires_gpu),
        pytest.param("cuda", 256, marks=requires_gpu),  # head dim 128: the Gluon forward
    ],
)
@pytest.mark.parametrize("fullgraph", [False, True])
def test_routed_attention_under_compile_trains_as_in_eager(make_monitor, device, n_embd, fullgraph):
    """A layer routed to numwatch's kernel trains compiled as in eager mode: on the CPU the
    paper's emulation (in the Triton interpreter under the test suite), bitwise; on a GPU the
    compiled stabilized kernel, to 1e-5 (cuBLAS may pick other algorithms for the compiled
    graphs' layouts). Its launches run between graphs, or with fullgraph=True in the graph
    (the kernel's custom ops)."""
    mode = "paper_repro" if device == "cpu" else "stabilized"
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=n_embd)

    def losses(compiled: bool) -> list[float]:
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = make_monitor(model, flush_every=4, attention__every=2).attach(opt)
        monitor.swap_attention(mode=mode, stabilize=mode == "stabilized")
        run = torch.compile(model, backend="aot_eager", fullgraph=fullgraph) if compiled else model
        g = torch.Generator().manual_seed(1)
        out = []
        for _ in range(5):
            x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g).to(device)
            out.append(train_step(run, opt, x, x.roll(-1, 1), monitor).item())
        assert not monitor._guard.errors
        assert monitor.snapshot().value("attn_kernel_stabilized", layer="h.0.attn") == (
            mode == "stabilized"
        )
        monitor.detach()
        return out

    torch._dynamo.reset()
    fallbacks = flash_attention_fallbacks()
    compiled, eager = losses(True), losses(False)
    assert flash_attention_fallbacks() == fallbacks  # every call ran numwatch's kernel
    if device == "cpu":
        assert compiled == eager
    else:
        assert compiled == pytest.approx(eager, rel=1e-5)


def test_a_compiled_wrapper_is_monitored_under_its_modules_names(make_monitor):
    """Monitor(torch.compile(model)) labelled everything '_orig_mod.…' (user globs selected
    nothing) and measured the model itself as a submodule '_orig_mod'."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CFG)
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = make_monitor(
        compiled, flush_every=1, activations__every=1, gradients__params=["h.0.*"]
    ).attach(opt)
    assert monitor.model is model
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    train_step(compiled, opt, x, x.roll(-1, 1), monitor)
    snap = monitor.snapshot()
    monitor.detach()
    params = {r.labels["param"] for r in snap.series("grad_absmax")}
    assert params and all(p.startswith("h.0.") for p in params)
    modules = {r.labels["module"] for r in snap.series("activation_absmax")}
    assert "h.0.attn.c_attn" in modules and not any(m.startswith("_orig_mod") for m in modules)


@pytest.mark.parametrize("root", ["gpt", "sequential"])
def test_fullgraph_compile_trains_with_the_monitor_attached(
    make_monitor, caplog, monkeypatch, root
):
    """fullgraph=True with the monitor attached crashed the first forward: Dynamo refused the
    graph break of numwatch's hooks ("Skip calling torch.compiler.disable()d function"), on
    submodules (the activation probe's) and, for a torch.nn root such as nn.Sequential, whose
    own hooks Dynamo traces, on the root (the attention probe's, always registered). Now the
    hooks are skipped in such a graph, said once, and training runs as unmonitored."""
    import numwatch.hooks

    monkeypatch.setattr(numwatch.hooks, "_told_one_graph", False)

    def losses(monitored: bool) -> tuple[list[float], numwatch.Monitor | None]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        if root == "gpt":
            model = GPT(CFG)
        else:
            model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = None
        if monitored:
            monitor = make_monitor(
                model, flush_every=1, activations__every=1, attention__every=1
            ).attach(opt)
        run = torch.compile(model, backend="aot_eager", fullgraph=True)
        g = torch.Generator().manual_seed(1)
        out = []
        for _ in range(3):
            if root == "gpt":
                x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
                out.append(train_step(run, opt, x, x.roll(-1, 1), monitor).item())
            else:
                loss = run(torch.randn(2, 16, generator=g)).square().mean()
                loss.backward()
                if monitor is not None:
                    monitor.step(loss)
                opt.step()
                opt.zero_grad()
                out.append(loss.item())
        if monitor is not None:
            monitor.detach()
        return out, monitor

    plain, _ = losses(False)
    got, monitor = losses(True)
    assert got == plain
    assert not any(monitor.errors.values())
    snap = monitor.snapshot()
    assert snap.step == 2 and snap.series("grad_absmax")  # gradients are measured
    told = [r for r in caplog.records if "fullgraph=True" in r.getMessage()]
    assert len(told) == 1 and "activations and attention" in told[0].getMessage()


def test_attaching_after_a_compiled_forward_warns(make_monitor, caplog):
    """A model compiled and run before attach(): its graphs, traced without numwatch's hooks,
    kept running without them (Dynamo does not guard on module hooks), and with the attention
    probe off the activation probe measured nothing, without a word."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CFG)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    torch.compile(model, backend="aot_eager")(x)
    monitor = make_monitor(model, attention__enabled=False).attach()
    monitor.detach()
    told = [r.getMessage() for r in caplog.records if "before attach()" in r.getMessage()]
    assert len(told) == 1 and "compiled GPT.forward before attach()" in told[0]
    caplog.clear()
    torch._dynamo.reset()  # what the warning advises: the next compile traces the hooks
    make_monitor(model, attention__enabled=False).attach().detach()
    assert not [r for r in caplog.records if "before attach()" in r.getMessage()]


def _shared_wrapper(forward):
    """A forward decorator like transformers' (can_return_tuple...): one wrapper code object
    serves every class that uses it."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return wrapper


class _Doubles(torch.nn.Module):
    @_shared_wrapper
    def forward(self, x):
        return 2 * x


class _Halves(torch.nn.Module):
    @_shared_wrapper
    def forward(self, x):
        return x / 2


def test_a_forward_wrapper_compiled_for_another_class_does_not_warn(make_monitor, caplog):
    """Classes whose forward goes through one shared decorator share its code object: compiling
    one (a BERT) made attach() on another, never compiled (a GPT-2), warn that its forward was
    compiled and advise torch._dynamo.reset(), which would throw the BERT's graphs away."""
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model

    torch._dynamo.reset()
    assert _Doubles.forward.__code__ is _Halves.forward.__code__
    torch.compile(_Doubles(), backend="eager")(torch.ones(2))
    bert = BertModel(
        BertConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            vocab_size=100,
        )
    ).eval()  # fmt: skip
    with torch.no_grad():
        torch.compile(bert, backend="eager")(input_ids=torch.randint(0, 100, (1, 8)))
    assert BertModel.forward.__code__ is GPT2Model.forward.__code__
    gpt2 = GPT2Model(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100))
    for model in (_Halves(), gpt2):
        make_monitor(model, attention__enabled=False).attach().detach()
    assert not [r for r in caplog.records if "before attach()" in r.getMessage()]
    for model, name in [(_Doubles(), "_Doubles"), (bert, "BertModel")]:  # compiled: told
        caplog.clear()
        make_monitor(model, attention__enabled=False).attach().detach()
        told = [r.getMessage() for r in caplog.records if "before attach()" in r.getMessage()]
        assert len(told) == 1 and f"compiled {name}.forward before attach()" in told[0]


# Two layers: routes can take one and not the other.
ROUTED = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32)


class _CountingBackend:
    """aot_eager, counting the graphs it is given (a recompile is one more)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, example_inputs)


def _step_with_grads(run, model, opt, monitor, x, autocast=True) -> tuple[float, torch.Tensor]:
    """train_step without clipping, keeping the loss and the gradients of every parameter."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = run(x)
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), x.roll(-1, 1).reshape(-1))
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    monitor.step(loss)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), grads


def _kernels(monitor: numwatch.Monitor) -> dict:
    snap = monitor.snapshot()
    return {
        (name, *sorted(r.labels.items())): r.value
        for name in ("attn_kernel_stabilized", "attn_kernel_mode")
        for r in snap.series(name)
    }


def test_fullgraph_compile_runs_routed_layers_in_the_graph_as_in_eager(make_monitor):
    """With a layer routed to numwatch's kernel (swap_attention, or the swap action),
    fullgraph=True failed: the routed call left the graph ("Skip calling
    torch.compiler.disable()d function"), and a model compiled whole, whose root hooks are
    traced, ran native SDPA unsaid while attn_kernel_stabilized read 1. Now the routing mode
    is entered in the traced hooks and the kernel's custom ops join the graph: losses and
    gradients are eager's, bitwise, through swaps and restores between steps, which recompile
    the graph once each (Dynamo guards on the routes); steps that change nothing compile
    nothing."""
    schedule = {
        1: lambda m: m.swap_attention("h.0"),
        3: lambda m: m.swap_attention("h.1", mode="plain"),
        5: lambda m: m.restore_attention("h.0"),
        6: lambda m: m.restore_attention(),
    }

    def run(compiled: bool, swaps: dict) -> tuple[list, list, list, list]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(ROUTED)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = make_monitor(model, flush_every=1, attention__every=2).attach(opt)
        backend = _CountingBackend()
        fwd = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
        g = torch.Generator().manual_seed(1)
        losses, grads, kernels, graphs = [], [], [], []
        for step in range(8):
            if step in swaps:
                swaps[step](monitor)
            before = backend.graphs
            x = torch.randint(0, ROUTED.vocab_size, (2, ROUTED.block_size), generator=g)
            loss, grad = _step_with_grads(fwd, model, opt, monitor, x)
            losses.append(loss)
            grads.append(grad)
            kernels.append(_kernels(monitor))
            graphs.append(backend.graphs - before)
        assert not any(monitor.errors.values())
        monitor.detach()
        return losses, grads, kernels, graphs

    native = run(False, {})
    eager = run(False, schedule)
    compiled = run(True, schedule)
    assert compiled[0] == eager[0]
    assert all(torch.equal(a, b) for a, b in zip(compiled[1], eager[1], strict=True))
    # the routes change the arithmetic: equal results are the kernel's, not SDPA's
    assert not torch.equal(eager[1][1], native[1][1])
    # attn_kernel_* as in eager from the first route on (before it, no layer is seen: a graph
    # that may not break observes nothing)
    assert compiled[2][1:] == eager[2][1:]
    assert eager[2][2] == {
        ("attn_kernel_mode", ("layer", "h.0.attn"), ("mode", "stabilized")): 1.0,
        ("attn_kernel_stabilized", ("layer", "h.0.attn")): 1.0,
        ("attn_kernel_stabilized", ("layer", "h.1.attn")): 0.0,
    }
    assert compiled[3][2] == compiled[3][4] == compiled[3][7] == 0


def test_blocks_compiled_one_by_one_with_fullgraph_route_only_their_own_layer(make_monitor):
    """Dynamo shares one graph among modules of one structure: compiled block by block, the
    graph traced for h.0 (native SDPA) ran for h.1 too, routed to the kernel. The graph is
    guarded on the layer it routes: each block gets its own."""

    def losses(compiled: bool) -> list[float]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(ROUTED)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = make_monitor(model, flush_every=1, attention__every=2).attach(opt)
        monitor.swap_attention("h.1", mode="paper_repro")
        if compiled:
            for block in model.h:
                block.compile(backend="aot_eager", fullgraph=True)
        g = torch.Generator().manual_seed(1)
        out = []
        for _ in range(4):
            x = torch.randint(0, ROUTED.vocab_size, (2, ROUTED.block_size), generator=g)
            out.append(train_step(model, opt, x, x.roll(-1, 1), monitor).item())
        assert monitor.attention_kernel("h.1.attn").mode == "paper_repro"
        assert monitor.attention_kernel("h.0.attn") is None
        monitor.detach()
        return out

    assert losses(True) == losses(False)


def test_a_routed_call_that_falls_back_under_fullgraph_reads_0_and_never_recompiles(
    make_monitor, caplog
):
    """An fp32 model's routed calls fall back to SDPA. Inside a graph that may not break, a
    count kept in Python is replayed on every run, each value a new guard: counted per call,
    the graph recompiled every step. What the graph runs is noted when traced instead:
    attn_kernel_stabilized reads 0, the layer is named once, the fallback counts once."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # (no activation probe: its hooks, there on its sampled steps only, recompile the graph)
    monitor = make_monitor(model, flush_every=1, activations__enabled=False).attach(opt)
    monitor.swap_attention()
    backend = _CountingBackend()
    run = torch.compile(model, backend=backend, fullgraph=True)
    before = flash_attention_fallbacks().get("dtype", 0)
    g = torch.Generator().manual_seed(1)
    with caplog.at_level("WARNING", logger="numwatch"):
        for step in range(4):
            x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
            _step_with_grads(run, model, opt, monitor, x, autocast=False)
            if step == 0:
                compiled = backend.graphs
            assert monitor.snapshot().value("attn_kernel_stabilized", layer="h.0.attn") == 0.0
    assert backend.graphs == compiled
    assert flash_attention_fallbacks().get("dtype", 0) - before == 1  # once, when traced
    said = [r.getMessage() for r in caplog.records if "fall back" in r.getMessage()]
    assert len(said) == 1 and "'h.0.attn'" in said[0] and "not bf16 or fp16" in said[0]
    monitor.detach()


class _Breaks(GPT):
    """A GPT whose forward has a graph break: fullgraph=True fails to compile it."""

    def forward(self, idx):
        torch._dynamo.graph_break()
        return super().forward(idx)


def test_a_fullgraph_compile_that_fails_leaves_no_routing_mode_after_the_step(make_monitor):
    """The root hooks of a model compiled whole run as frames of their own: where a route is
    set, the entry's frame pushes the routing mode and the exit's pops it. The exit hook of a
    forward that failed to compile ran outside Dynamo, where it does not pop it: the mode
    stayed, and intercepted every later call. The step's close drops it."""
    torch._dynamo.reset()
    model = _Breaks(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = make_monitor(model, flush_every=1).attach(opt)
    monitor.swap_attention()
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    monitor.step()
    assert torch.overrides._get_current_function_mode_stack() == []
    loss = train_step(model, opt, x, x.roll(-1, 1), monitor)  # eager: routed as before
    assert torch.isfinite(loss)
    assert monitor.snapshot().value("attn_kernel_stabilized", layer="h.0.attn") == 1.0
    assert torch.overrides._get_current_function_mode_stack() == []
    monitor.detach()


class _AttnS(torch.nn.Module):
    """An attention layer whose methods name their module ``s``, not ``self``."""

    def __init__(s) -> None:
        super().__init__()
        s.qkv = torch.nn.Linear(32, 96)

    def forward(s, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = s.qkv(x).view(B, T, 3, 2, 16).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(B, T, 32)


class _TwoAttnS(torch.nn.Module):
    """Two such layers, run through activation checkpointing where ``checkpointed``."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.h = torch.nn.ModuleList([_AttnS(), _AttnS()])
        self.o = torch.nn.Linear(32, 1)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.h:
            y = (
                torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
                if self.checkpointed
                else b(x)
            )
            x = x + y
        return self.o(x).sum()


def _two_attn_grads(
    make_monitor, route: bool, compile_kw: dict | None, checkpointed=False, activations=False
):
    """h.0's qkv gradient over 3 steps (bf16: the kernel runs), h.0 routed where ``route``;
    the activation probe on where ``activations`` (its hooks break a checkpointed graph)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TwoAttnS(checkpointed).to(torch.bfloat16)
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    monitor = make_monitor(
        model, flush_every=1, attention__every=2, activations__enabled=activations
    ).attach()
    if route:
        monitor.swap_attention("h.0")
    run = (
        torch.compile(model, backend="aot_eager", **compile_kw) if compile_kw is not None else model
    )
    grads, shares = [], []
    for _ in range(3):
        run(x).backward()
        grads.append(model.h[0].qkv.weight.grad.clone())
        model.zero_grad()
        monitor.step()
        shares.append(monitor.snapshot().get("attn_kernel_stabilized", layer="h.0"))
    monitor.detach()
    return grads, shares


def test_fullgraph_routes_a_layer_whose_forward_names_its_module_otherwise(make_monitor):
    """Under fullgraph=True the layer was looked up as the traced frames' local ``self``: a
    forward written ``def forward(s, x)`` located no layer, and the routed layer ran native
    SDPA, unsaid (eager finds it through nn.Module's call frame). The frame's first argument
    is taken now: gradients are eager's, bitwise, and differ from native SDPA's."""
    native, _ = _two_attn_grads(make_monitor, False, None)
    eager, eager_shares = _two_attn_grads(make_monitor, True, None)
    compiled, shares = _two_attn_grads(make_monitor, True, {"fullgraph": True})
    assert not torch.equal(eager[0], native[0])
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager, strict=True))
    assert shares == eager_shares == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_routed_block_checkpointed_under_compile_is_said_once(make_monitor, caplog, fullgraph):
    """Dynamo traces torch.utils.checkpoint's body with numwatch's mode popped: a routed
    layer in a checkpointed block ran native SDPA once compiled, unsaid. It still does (a
    mode pushed again there is a side effect the checkpoint refuses), but the block is named
    once, and training is native SDPA's, bitwise."""
    native, _ = _two_attn_grads(make_monitor, False, None, checkpointed=True)
    with caplog.at_level("WARNING", logger="numwatch"):
        compiled, _ = _two_attn_grads(make_monitor, True, {"fullgraph": fullgraph}, True)
    said = [r.getMessage() for r in caplog.records if "activation checkpointing" in r.getMessage()]
    assert len(said) == 1 and "block 'h.0'" in said[0] and "native SDPA" in said[0]
    assert all(torch.equal(a, b) for a, b in zip(compiled, native, strict=True))


def test_a_checkpointed_block_whose_trace_falls_back_to_eager_is_routed_unsaid(
    make_monitor, caplog
):
    """The activation probe's hooks break the checkpointed body's graph, and Dynamo runs that
    frame eagerly, where the mode routes: the block is not said, and trains as in eager."""
    eager, _ = _two_attn_grads(make_monitor, True, None, True, activations=True)
    with caplog.at_level("WARNING", logger="numwatch"):
        compiled, shares = _two_attn_grads(make_monitor, True, {}, True, activations=True)
    assert not [r for r in caplog.records if "activation checkpointing" in r.getMessage()]
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager, strict=True))
    assert shares == [1.0, 1.0, 1.0]
