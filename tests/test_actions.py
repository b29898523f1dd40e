"""Actions: the closed loop from a planted precursor to a response, checked bitwise."""

from __future__ import annotations

import copy
import gc
import inspect
import json
import logging
import math
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import numwatch
from numwatch.actions.library import qk_clip
from numwatch.errors import NumwatchHalt
from numwatch.replay import replay
from numwatch.sinks.jsonl import read_jsonl


class Attn(nn.Module):
    def __init__(self, d=32, heads=2, plant=False):
        super().__init__()
        self.n_heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.plant = plant

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        if self.plant:  # two identical sink keys aligned with every query: repeated maxima
            sink = q.mean(2, keepdim=True)
            sink = sink / sink.norm(dim=-1, keepdim=True) * 50
            k = torch.cat([sink, sink, k[:, :, 2:]], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(B, T, C)


class Model(nn.Module):
    def __init__(self, plant=(False, False)):
        super().__init__()
        self.a = Attn(plant=plant[0])
        self.b = Attn(plant=plant[1])
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


def only(rule_type, name, metric=None, *actions, **params):
    """A rules config holding just this rule (no defaults)."""
    rule = {"type": rule_type, "name": name, "actions": list(actions), **params}
    if metric is not None:
        rule["metric"] = metric
    return {"defaults": False, "add": [rule]}


def monitor_for(model, **kw):
    kw.setdefault("sinks__console__enabled", False)
    kw.setdefault("sinks__jsonl__enabled", False)
    kw.setdefault("flush_every", 1)
    return numwatch.Monitor(model, **kw)


def test_nonfinite_gradient_skip_step_leaves_state_bitwise_unchanged():
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]}
    monitor = monitor_for(model, rules=rules).attach(opt)
    x = torch.randn(4, 6, 32)
    for step in range(6):
        model(x).square().mean().backward()
        if step == 3:
            model.b.qkv.weight.grad[0, 0] = float("nan")
            before_params = copy.deepcopy(model.state_dict())
            before_state = copy.deepcopy(opt.state_dict())
        opt.step()
        if step == 3:
            assert all(torch.equal(before_params[k], v) for k, v in model.state_dict().items())
            after = opt.state_dict()
            for pid, st in before_state["state"].items():
                for name, t in st.items():
                    assert torch.equal(after["state"][pid][name], t), (pid, name)
            assert all(p.grad is None for p in model.parameters())  # gradients cleared
        opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())  # training went on
    kinds = [(e.kind, e.step) for e in monitor.events]
    assert ("nonfinite", 3) in kinds and ("action", 3) in kinds
    nonfinite = next(e for e in monitor.events if e.kind == "nonfinite" and e.labels)
    assert nonfinite.labels == {"param": "b.qkv.weight"}  # named at the flush
    assert monitor.optimizer_control.skipped_steps == 1
    snap = monitor.snapshot()
    assert snap.value("mitigation_skipped_steps_total") == 1
    assert snap.value("events_total", kind="action", rule="nonfinite") == 1


@pytest.mark.parametrize("where", ["excluded", "outside the model"])
def test_skip_step_covers_the_gradients_the_probe_does_not_watch(where):
    """The skip decision read the gradient probe's norm only: a NaN gradient of a parameter
    the optimizer updates but the probe does not watch (gradients.exclude; a learned temperature
    outside the model, as CLIP's logit_scale) reached the weights, and every later step was
    skipped on the NaN weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    temperature = nn.Parameter(torch.ones(()))
    params = [*model.parameters(), temperature]
    opt = torch.optim.SGD(params, lr=0.1)
    if where == "excluded":
        monitor = monitor_for(model, rules=SKIP_NONFINITE, gradients__exclude=["0.*"])
        planted = model[0].weight
    else:
        monitor = monitor_for(model, rules=SKIP_NONFINITE)
        planted = temperature
    monitor.attach(opt)
    x = torch.randn(2, 4)
    updated = []
    for step in range(4):
        (model(x) * temperature).square().mean().backward()
        if step == 1:
            planted.grad.view(-1)[0] = float("nan")
        before = [p.detach().clone() for p in params]
        opt.step()
        opt.zero_grad()
        updated.append(not all(torch.equal(a, p) for a, p in zip(before, params, strict=True)))
    assert updated == [True, False, True, True]
    assert torch.isfinite(planted).all()
    assert monitor.optimizer_control.skipped_steps == 1
    assert [(e.kind, e.step) for e in monitor.events] == [("nonfinite", 1), ("action", 1)]
    monitor.detach()


def test_a_nan_that_skip_step_skips_counts_once_in_events_total():
    """A nonfinite rule with skip_step fires at the step, and takes the NaN's origin over at the
    flush without running its actions again: both counted, one NaN read as two in events_total
    (one without skip_step), and a rule on that count fired at the first NaN."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twice = {"type": "threshold", "name": "nan_twice", "metric": "events_total", "op": ">=",
             "threshold": 2, "labels": {"kind": "nonfinite"}}  # fmt: skip
    rules = {"defaults": False, "add": [*SKIP_NONFINITE["add"], twice]}
    monitor = monitor_for(model, rules=rules).attach(opt)
    model(torch.randn(2, 4)).sum().backward()
    model.weight.grad[0, 0] = float("nan")
    monitor.step()
    opt.step()
    assert [e.message.split(" ")[0] for e in monitor.events if e.kind == "nonfinite"] == [
        "[nonfinite]",  # the step's decision
        "NaN/Inf",  # its origin, named at the flush
    ]
    assert monitor.snapshot().value("events_total", kind="nonfinite", rule="nonfinite") == 1
    assert not [e for e in monitor.events if e.rule == "nan_twice"]
    monitor.detach()


def test_an_optimizer_that_leaves_parameters_to_another_is_named_at_attach(caplog):
    """skip_step withholds the attached optimizer's update only: with a second optimizer for
    some parameters (Muon + AdamW splits), a skipped step still applied the other's update, with
    no word."""
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10))
    matrices = torch.optim.SGD([model[1].weight, model[2].weight], lr=0.1)
    rules = only("nonfinite", "nonfinite", None, "skip_step")
    with caplog.at_level("WARNING", logger="numwatch"):
        monitor_for(model, rules=rules).attach(matrices).detach()
        monitor_for(model, rules=rules).attach(torch.optim.SGD(model.parameters())).detach()
        monitor_for(model).attach(matrices).detach()  # no optimizer action: nothing to say
    warned = [r.getMessage() for r in caplog.records if "does not update" in r.getMessage()]
    assert warned == [
        "numwatch: the attached optimizer does not update 3 trainable parameters (0.weight, "
        "1.bias, 2.bias); skip_step, lr_backoff and qk_clip act through it alone, so another "
        "optimizer still applies its updates to those"
    ]


def test_optimizer_actions_with_no_optimizer_attached_are_named_at_the_first_step(caplog):
    """skip_step and lr_backoff act through the attached optimizer: with attach() alone (as in
    `with Monitor(model) as m:`) nothing was said until the NaN, whose update then reached the
    weights. qk_clip needs none; attach() then attach(optimizer) is fine."""
    model = nn.Linear(4, 1)
    threshold = dict(type="threshold", threshold=5.0)
    add = [
        dict(type="nonfinite", name="nan_guard", actions=["skip_step"]),
        dict(threshold, name="hi", metric="loss", actions=["lr_backoff"]),
        dict(threshold, name="qk", metric="attn_max_logit", actions=["qk_clip"]),
    ]
    rules = {"defaults": False, "add": add}
    with caplog.at_level("WARNING", logger="numwatch"):
        with monitor_for(model, rules=rules) as monitor:
            for _ in range(2):
                monitor.step(torch.tensor(1.0))
        monitor = monitor_for(model, rules=rules).attach()
        monitor.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        monitor.step(torch.tensor(1.0))
        monitor.detach()
    warned = [r.getMessage() for r in caplog.records if "none is attached" in r.getMessage()]
    assert warned == [
        "numwatch: rules hi (lr_backoff), nan_guard (skip_step) act through the optimizer, and "
        "none is attached: their actions would fail and the updates they should withhold or "
        "slow would reach the weights; call monitor.attach(optimizer) before training"
    ]


def test_planted_ties_swap_exactly_the_affected_layer():
    torch.manual_seed(0)
    # only layer b has repeated maxima; bf16, which the kernel runs (fp32 calls fall back)
    model = Model(plant=(False, True)).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = monitor_for(model, attention__every=1).attach(opt)
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16)
    for _ in range(4):  # the default rule wants 3 flushes in a row
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    fired = [e for e in monitor.events if e.rule == "attn_repeated_max"]
    assert {e.labels["layer"] for e in fired if e.kind == "precursor"} == {"b"}
    actions = [e for e in fired if e.kind == "action"]
    assert len(actions) == 1  # debounced: one swap, not one per head and flush
    assert monitor.attention_kernel("b").stabilized
    assert monitor.attention_kernel("a") is None
    assert monitor.snapshot().value("attn_kernel_stabilized", layer="b") == 1


def test_lr_backoff_composes_with_a_scheduler_and_restores():
    model = nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    backoff = {"type": "lr_backoff", "factor": 0.1, "steps": 3}
    rules = only("threshold", "big_loss", "loss", backoff, threshold=100)
    monitor = monitor_for(model, rules=rules).attach(opt)
    used = []
    for step in range(8):
        before = model.weight.item()
        model(torch.ones(1, 1)).sum().backward()  # d/dw = 1: the update is -lr exactly
        monitor.step(1000.0 if step == 1 else 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        used.append(before - model.weight.item())
    # schedule 1, 1, .5, .5, .25, .25, .125, .125; x0.1 for the 3 updates from step 1 on
    assert used == pytest.approx([1.0, 0.1, 0.05, 0.05, 0.25, 0.25, 0.125, 0.125])
    assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0] == 0.0625
    assert monitor.snapshot().value("mitigation_lr_factor") == 1.0


def test_an_lr_set_inside_the_step_by_a_post_hook_scheduler_is_kept():
    """The wrapper put back every group's LR from before the step, also with no back-off
    running: a scheduler stepped from a step post-hook was frozen at its first LR. It now undoes
    its own scaling only."""

    def run(rules, lr_lambda):
        model = nn.Linear(1, 1, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        opt.register_step_post_hook(lambda *_: sched.step())
        monitor = monitor_for(model, rules=rules).attach(opt)
        used, lrs = [], []
        for step in range(4):
            before = model.weight.item()
            model(torch.ones(1, 1)).sum().backward()  # d/dw = 1: the update is -lr exactly
            monitor.step(1000.0 if step == 1 else 1.0)
            opt.step()
            opt.zero_grad()
            used.append(before - model.weight.item())
            lrs.append(opt.param_groups[0]["lr"])
        monitor.detach()
        return used, lrs

    halving = [0.5, 0.25, 0.125, 0.0625]
    assert run(SKIP_NONFINITE, lambda e: 0.5**e) == (pytest.approx([1.0, *halving[:3]]), halving)
    backoff = {"type": "lr_backoff", "factor": 0.1, "steps": 2}
    rules = only("threshold", "big_loss", "loss", backoff, threshold=100)
    # x0.1 for the updates of steps 1 and 2; the schedule goes on as without
    used, lrs = run(rules, lambda e: 0.5**e)
    assert used == pytest.approx([1.0, 0.05, 0.025, 0.125])
    assert lrs == halving


def test_a_skipped_update_does_not_use_up_an_lr_backoff_step():
    model = nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    backoff = {"type": "lr_backoff", "factor": 0.5, "steps": 2}
    rules = only("threshold", "big_loss", "loss", "skip_step", backoff, threshold=100)
    monitor = monitor_for(model, rules=rules).attach(opt)
    used = []
    for step in range(6):
        before = model.weight.item()
        model(torch.ones(1, 1)).sum().backward()  # d/dw = 1: the update is -lr exactly
        monitor.step(1000.0 if step == 2 else 1.0)
        opt.step()
        opt.zero_grad()
        used.append(before - model.weight.item())
    # step 2 skipped; the next 2 updates that run do so at half the LR
    assert used == pytest.approx([1.0, 1.0, 0.0, 0.5, 0.5, 1.0])


@pytest.mark.parametrize("fused", [False, True])
def test_a_grad_scaler_overflow_does_not_use_up_an_lr_backoff_step(fused):
    """GradScaler calls a fused optimizer's step() on an overflow step too (found_inf tells the
    kernel to skip the update): that step used up one of the back-off's steps."""
    model = nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=10**6)
    backoff = {"type": "lr_backoff", "factor": 0.5, "steps": 2}
    rules = only("threshold", "big_loss", "loss", backoff, threshold=100)
    monitor = monitor_for(model, rules=rules).attach(opt, scaler=scaler)
    used = []
    for step in range(5):
        before = model.weight.item()
        scaler.scale(model(torch.ones(1, 1)).sum()).backward()  # d/dw = 1: the update is -lr
        if step == 2:
            model.weight.grad.fill_(math.inf)  # overflow: no update
        monitor.step(1000.0 if step == 1 else 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        used.append(before - model.weight.item())
    # the back-off fires at step 1; its 2 updates are those of steps 1 and 3
    assert used == pytest.approx([1.0, 0.5, 0.0, 0.5, 1.0])


class ScalingSGD(torch.optim.Optimizer):
    """GradScaler's legacy contract: it passes itself to a step whose signature takes
    ``grad_scaler``, and that step unscales the gradients itself."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        if grad_scaler is not None:
            grad_scaler.unscale_(self)
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")
def test_the_step_wrapper_keeps_the_grad_scaler_keyword_contract():
    """The wrapper's signature was (*args, **kwargs): GradScaler stopped passing itself, and the
    still-scaled gradients were applied (an update of 102.4 for 0.1). A skipped step unscales
    too: GradScaler.update() needs the inf check that records."""
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    opt = ScalingSGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    rules = only("threshold", "big_loss", "loss", "skip_step", threshold=5)
    monitor = monitor_for(model, rules=rules).attach(opt, scaler=scaler)
    assert "grad_scaler" in inspect.signature(opt.step).parameters
    weights = []
    for step in range(3):
        loss = model(torch.ones(1, 1)).sum() + (10.0 if step == 1 else 0.0)  # d/dw = 1
        scaler.scale(loss).backward()
        monitor.step(loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        weights.append(model.weight.item())
    assert weights == pytest.approx([-0.1, -0.1, -0.2])  # step 1 skipped
    assert monitor.optimizer_control.skipped_steps == 1
    assert not monitor.errors
    monitor.detach()


class UnscaledOnceSGD(ScalingSGD):
    """The legacy contract as optimizers keep it: unscale unless the user already did (to clip)
    for this step."""

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        state = grad_scaler._per_optimizer_states[id(self)] if grad_scaler is not None else None
        super().step(closure, grad_scaler if state and state["stage"].name == "READY" else None)


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")
def test_a_skip_after_the_user_unscaled_to_clip_does_not_unscale_again():
    """The documented clipping pattern, scaler.unscale_(opt), clip_grad_norm_, scaler.step(opt):
    a skipped step unscaled again, and unscale_() raised "has already been called on this
    optimizer" out of scaler.step(). Now the user's unscale_ (its inf check) stands: the step
    is withheld, update() backs off the scale for the planted Inf, the next step trains."""
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    opt = UnscaledOnceSGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**6)
    monitor = monitor_for(model, rules=SKIP_NONFINITE).attach(opt, scaler=scaler)
    weights, scales = [], []
    for step in range(3):
        scaler.scale(model(torch.ones(1, 1)).sum()).backward()  # d/dw = 1
        if step == 1:
            model.weight.grad.fill_(math.inf)
        monitor.step()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        weights.append(model.weight.item())
        scales.append(scaler.get_scale())
    assert weights == pytest.approx([-0.1, -0.1, -0.2])  # step 1 withheld
    assert scales == [1.0, 0.5, 0.5]  # the user's unscale_ found the Inf
    assert monitor.optimizer_control.skipped_steps == 1
    assert [e.step for e in monitor.events if e.kind == "action"] == [1]
    assert not monitor.errors
    monitor.detach()


def test_skip_step_clears_the_gradients_whatever_the_signature_of_zero_grad():
    """The skip called zero_grad(set_to_none=True): an optimizer overriding zero_grad(self)
    (an older or third-party signature) raised a TypeError out of optimizer.step()."""

    class OwnZeroGrad(torch.optim.SGD):
        def zero_grad(self):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.zero_()

    model = nn.Linear(2, 1)
    nn.init.ones_(model.weight)
    opt = OwnZeroGrad(model.parameters(), lr=0.1)
    monitor = monitor_for(model, rules=SKIP_NONFINITE).attach(opt)
    for step in range(3):
        model(torch.ones(1, 2)).sum().backward()  # d/dw = 1
        if step == 1:
            model.weight.grad[0, 0] = float("nan")
        opt.step()
        if step == 1:
            assert all(p.grad is None for p in model.parameters())
        opt.zero_grad()
    assert model.weight.flatten().tolist() == pytest.approx([0.8, 0.8])  # steps 0, 2 applied
    assert monitor.optimizer_control.skipped_steps == 1
    assert not monitor.errors
    monitor.detach()


@pytest.mark.parametrize("before", ["scheduler", "user wrapper", "none"])
def test_detach_restores_the_step_that_was_installed_before(before):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    if before == "scheduler":
        torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps opt.step on the instance
    elif before == "user wrapper":
        inner = opt.step
        opt.step = lambda *a, **k: (calls.append(1), inner(*a, **k))[1]
    installed = opt.__dict__.get("step")
    assert (installed is None) == (before == "none")
    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]}
    monitor = monitor_for(model, rules=rules).attach(opt)
    assert opt.__dict__["step"] is not installed  # ours, over what was there
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    monitor.detach()
    assert opt.__dict__.get("step") is installed
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert len(calls) == (2 if before == "user wrapper" else 0)


def test_updates_run_through_a_step_method_taken_before_attach_are_named_once(caplog):
    """A step method taken from the optimizer before attach() runs its updates without the step
    wrapper, so skip_step, lr_backoff and qk_clip cannot act on them: nothing said so."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = opt.step
    monitor = monitor_for(model, rules=SKIP_NONFINITE).attach(opt)
    with caplog.at_level(logging.WARNING, logger="numwatch"):
        for run in (step, step, opt.step):
            model(torch.ones(1, 2)).sum().backward()
            run()
            opt.zero_grad()
    monitor.detach()
    assert caplog.text.count("SGD.step() ran without numwatch's step wrapper") == 1
    assert not opt._optimizer_step_pre_hooks


@pytest.mark.parametrize("first", ["a", "b"])
def test_two_monitors_on_one_optimizer_restore_its_step_in_either_detach_order(first):
    """Detached in attach order, the first monitor's wrapper, wrapped by the second's, stayed
    as a pass-through, and the second's restored it: optimizer.step stayed an instance
    attribute for good."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = monitor_for(model, rules=SKIP_NONFINITE).attach(opt)
    b = monitor_for(model, rules=SKIP_NONFINITE).attach(opt)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    before = model.weight.detach().clone()
    (a if first == "a" else b).detach()
    (b if first == "a" else a).detach()
    assert "step" not in opt.__dict__
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert not torch.equal(model.weight, before)  # the class's own step, updating


def test_qk_clip_brings_max_logit_under_tau():
    torch.manual_seed(0)
    attn = Attn(d=16, heads=2)
    with torch.no_grad():
        attn.qkv.weight[:32] *= 30  # large queries and keys: logits in the hundreds
    model = nn.Sequential()
    model.add_module("attn", attn)
    tau = 20.0
    clip = {"type": "qk_clip", "tau": tau}
    rules = only("threshold", "logit", "attn_max_logit", clip, threshold=tau)
    monitor = monitor_for(model, rules=rules, attention__every=1).attach()
    x = torch.randn(2, 6, 16)
    model(x)
    monitor.step()
    before = monitor.snapshot()
    logits = [before.value("attn_max_logit", layer="attn", head=str(h)) for h in (0, 1)]
    assert min(logits) > tau
    model(x)
    monitor.step()
    after = monitor.snapshot()
    for h in (0, 1):
        assert after.value("attn_max_logit", layer="attn", head=str(h)) <= tau * (1 + 1e-4)


class HiddenHeads(Attn):
    """Its head count under a name numwatch does not know: no Q/K layout to clip."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.nh = self.__dict__.pop("n_heads")

    def forward(self, x):
        self.__dict__["n_heads"] = self.nh
        try:
            return super().forward(x)
        finally:
            del self.__dict__["n_heads"]


def clipped_model(hidden_heads=False):
    torch.manual_seed(0)
    attn = HiddenHeads(d=16, heads=2) if hidden_heads else Attn(d=16, heads=2)
    with torch.no_grad():
        attn.qkv.weight[:32] *= 30  # large queries and keys: logits in the hundreds
    model = nn.Sequential()
    model.add_module("attn", attn)
    return model


def test_a_qk_clip_queued_by_the_final_flush_of_detach_is_applied():
    """With an optimizer, a clip waits for the next update; the final flush of detach() queued
    one (its action event logged) and detach dropped it with the optimizer's wrapper: the
    announced rescale never happened. It runs at the detach now."""
    model = clipped_model()
    rules = only("threshold", "logit", "attn_max_logit", {"type": "qk_clip", "tau": 20.0},
                 threshold=20.0)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # only a clip can move the weights
    monitor = monitor_for(model, rules=rules, attention__every=1, flush_every=10).attach(opt)
    x = torch.randn(2, 6, 16)
    model(x).square().mean().backward()
    opt.step()  # step 0: no flush yet
    opt.zero_grad()
    before = model.attn.qkv.weight.detach().clone()
    monitor.detach()  # its flush fires the rule
    assert [e.evidence["action"] for e in monitor.events if e.kind == "action"] == ["qk_clip"] * 2
    assert not torch.equal(model.attn.qkv.weight, before)
    assert torch.equal(model.attn.qkv.weight[64:], before[64:])  # V untouched


def test_a_qk_clip_of_a_skipped_step_whose_callback_detaches_is_applied():
    """skip_step and qk_clip fire in one step close, and a callback detaches then: the skipped
    update never ran the clip, and the wrapper that would run it at the next update went."""
    model = clipped_model()
    rules = {"defaults": False, "add": [
        {"type": "threshold", "name": "logit", "metric": "attn_max_logit", "threshold": 20.0,
         "actions": [{"type": "qk_clip", "tau": 20.0}]},
        {"type": "threshold", "name": "gn", "metric": "grad_norm", "threshold": 0.0,
         "actions": ["skip_step"]},
    ]}  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = monitor_for(model, rules=rules, attention__every=1, flush_every=1).attach(opt)
    monitor.on("action", lambda _event: monitor.detach())
    model(torch.randn(2, 6, 16)).square().mean().backward()
    before = model.attn.qkv.weight.detach().clone()
    opt.step()
    assert not monitor.attached
    assert sorted(e.evidence["action"] for e in monitor.events if e.kind == "action") == [
        "qk_clip", "qk_clip", "skip_step"
    ]  # fmt: skip
    assert not torch.equal(model.attn.qkv.weight, before)


def test_qk_clip_after_withheld_updates_clips_once():
    """Clips queued while updates are withheld (skip_step here; a GradScaler's overflow steps
    alike) run once after the next update that happens: queued twice, the logits fell to
    tau**2 / max_logit instead of tau."""
    model = clipped_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # only the clip moves the weights
    tau = 20.0
    rules = {
        "defaults": False,
        "add": [
            {"type": "threshold", "name": "logit", "metric": "attn_max_logit",
             "threshold": tau, "actions": [{"type": "qk_clip", "tau": tau}]},
            {"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]},
        ],
    }  # fmt: skip
    monitor = monitor_for(model, rules=rules, attention__every=1).attach(opt)
    x = torch.randn(2, 6, 16)
    for step in range(4):
        model(x).square().mean().backward()
        if step < 2:  # two withheld updates, each after a flush that queues the clip
            model.attn.qkv.bias.grad[0] = float("nan")
        opt.step()
        opt.zero_grad()
    after = monitor.snapshot()
    for h in (0, 1):
        assert after.value("attn_max_logit", layer="attn", head=str(h)) == pytest.approx(
            tau, rel=1e-4
        )


def test_a_qk_clip_that_cannot_run_is_counted_not_raised_from_the_optimizer():
    model = clipped_model(hidden_heads=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rules = only("threshold", "logit", "attn_max_logit", {"type": "qk_clip", "tau": 1.0},
                 threshold=1.0)  # fmt: skip
    monitor = monitor_for(model, rules=rules, attention__every=1).attach(opt)
    x = torch.randn(2, 6, 16)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()  # raised NumwatchError from the queued clip
        opt.zero_grad()
    assert monitor.errors["actions"] >= 1
    actions = [e for e in monitor.events if e.kind == "action"]
    assert actions and all(e.evidence["failed"] and "NumwatchError" in e.message for e in actions)


def test_qk_clip_layouts():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2)
    w = mha.in_proj_weight.detach().clone()
    ratio = qk_clip(nn.Sequential(mha), "0", 1, 400.0, 100.0)
    assert ratio == 0.25
    assert torch.equal(mha.in_proj_weight[4:8], w[4:8] * 0.5)  # q rows of head 1
    assert torch.equal(mha.in_proj_weight[12:16], w[12:16] * 0.5)  # k rows of head 1
    assert torch.equal(mha.in_proj_weight[:4], w[:4])
    with pytest.raises(numwatch.NumwatchError, match="layout"):
        qk_clip(nn.Sequential(nn.Linear(2, 2)), "0", 0, 10.0, 1.0)


def test_halt_raises_with_a_report(tmp_path):
    model = nn.Linear(4, 1)
    rules = only("threshold", "loss_high", "loss", "halt", threshold=10)
    monitor = monitor_for(
        model, rules=rules, sinks__jsonl__enabled=True, sinks__jsonl__path=str(tmp_path / "r.jsonl")
    ).attach()
    monitor.step(1.0)
    with pytest.raises(NumwatchHalt) as err:
        monitor.step(50.0)
    report = err.value.report
    assert (report["rule"], report["step"], report["value"]) == ("loss_high", 1, 50.0)
    assert [r["loss"] for r in report["recent"]] == [1.0, 50.0]
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["events"][0]["rule"] == "loss_high"  # logged before halting


def test_an_action_before_a_halt_in_the_same_flush_is_on_record(tmp_path):
    """Two rules fire at one flush: a back-off, then a halt. The back-off happened; its event
    was lost with the halt (neither in monitor.events nor in the log)."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backoff = {"type": "lr_backoff", "factor": 0.5, "steps": 2}
    rules = {
        "defaults": False,
        "add": [
            {"type": "threshold", "name": "a_backoff", "metric": "loss", "threshold": 10,
             "actions": [backoff]},
            {"type": "threshold", "name": "b_halt", "metric": "loss", "threshold": 10,
             "actions": ["halt"]},
        ],
    }  # fmt: skip
    path = tmp_path / "r.jsonl"
    monitor = monitor_for(
        model, rules=rules, sinks__jsonl__enabled=True, sinks__jsonl__path=str(path)
    ).attach(opt)
    with pytest.raises(NumwatchHalt):
        monitor.step(50.0)
    monitor.detach()
    assert [e.rule for e in monitor.events if e.kind == "action"] == ["a_backoff", "b_halt"]
    logged = [e for r in read_jsonl(path) for e in r["events"] if e["kind"] == "action"]
    assert [e["rule"] for e in logged] == ["a_backoff", "b_halt"]


def test_an_action_after_a_halt_in_the_same_flush_still_runs(tmp_path):
    """A halt stopped the flush's other actions: the snapshot of a rule after the halting one
    (the forensics of the NaN that stopped the run) was never written."""
    forensics = tmp_path / "forensics"
    rules = {"defaults": False, "add": [
        {"type": "nonfinite", "name": "nonfinite", "actions": ["halt"]},
        {"type": "threshold", "name": "nan_grads", "metric": "grad_nonfinite", "threshold": 0,
         "actions": [{"type": "snapshot", "directory": str(forensics)}]},
    ]}  # fmt: skip
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    monitor = monitor_for(model, rules=rules).attach()
    model(torch.randn(2, 4)).sum().backward()
    model[0].weight.grad[0, 0] = float("nan")
    with pytest.raises(NumwatchHalt) as err:
        monitor.step()
    assert err.value.report["rule"] == "nonfinite"
    assert [(e.rule, e.message.split(":")[0]) for e in monitor.events if e.kind == "action"] == [
        ("nonfinite", "halt"),
        ("nan_grads", "snapshot"),
    ]
    assert set(torch.load(next(forensics.glob("*.pt")))) == {"0.weight", "0.weight.grad"}
    monitor.detach()


def test_a_halted_loop_that_never_detaches_has_the_halting_flushs_actions_in_its_log(tmp_path):
    """The actions of the halting flush waited for detach() to reach the log: a script that
    dies of the halt never calls it, and the log lacked where the snapshot went, and the halt."""
    rules = {"add": [
        {"type": "nonfinite", "name": "nan", "metric": "loss",
         "actions": [{"type": "snapshot", "directory": str(tmp_path / "forensics")}, "halt"]},
    ]}  # fmt: skip
    monitor = _halting_run(tmp_path, rules, flush_every=1, nan_at=1)
    assert monitor.attached  # halted, never detached
    logged = [
        (e["kind"], e["rule"], e["message"].split(":")[0])
        for r in read_jsonl(tmp_path / "run.jsonl")
        for e in r["events"]
        if e["kind"] == "action"
    ]
    assert logged == [("action", "nan", "snapshot"), ("action", "nan", "halt")]
    monitor.detach()  # nothing logged twice
    assert sum(e["kind"] == "action" for r in read_jsonl(tmp_path / "run.jsonl")
               for e in r["events"]) == 2  # fmt: skip


def test_snapshot_action_saves_bounded_forensics(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    save = {"type": "snapshot", "directory": str(tmp_path), "max_bytes": 100}
    rules = only("nonfinite", "nonfinite", None, save)
    monitor = monitor_for(model, rules=rules).attach()
    model(torch.randn(2, 4)).sum().backward()
    model[1].weight.grad[0, 0] = float("inf")
    monitor.step()
    saved = torch.load(next(tmp_path.glob("*.pt")))
    assert set(saved) == {"1.weight", "1.weight.grad"}  # 16 + 16 bytes, under the cap
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert record["event"]["labels"] == {"param": "1.weight"}


def test_a_snapshots_json_is_strict_json_with_the_logs_nonfinite_strings(tmp_path):
    """The history of a snapshot taken at a NaN/Inf holds non-finite values: they were written
    as NaN/Infinity tokens, which strict parsers (JSON.parse, serde_json) refuse."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    rules = only("nonfinite", "nonfinite", None, {"type": "snapshot", "directory": str(tmp_path)})
    monitor = monitor_for(model, rules=rules).attach()
    model(torch.randn(2, 4)).sum().backward()
    model[1].weight.grad[0, 0] = float("inf")
    monitor.step()

    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")

    text = next(tmp_path.glob("*.json")).read_text()
    record = json.loads(text, parse_constant=refuse)
    (flush,) = record["history"]
    values = {m["name"]: m["value"] for m in flush["metrics"] if not m["labels"]}
    assert values["grad_norm"] == "nan"  # a non-finite gradient makes the norm NaN
    monitor.detach()


def test_a_skip_step_rules_snapshot_saves_the_nan_origin_before_the_skip_clears_it(tmp_path):
    """A nonfinite rule with skip_step decides from the step's global gradient norm, whose event
    names no parameter: its snapshot saved no tensor, and the flush that named the origin came
    after the skip had cleared the gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save = {"type": "snapshot", "directory": str(tmp_path)}
    rules = only("nonfinite", "nonfinite", None, "skip_step", save)
    monitor = monitor_for(model, rules=rules).attach(opt)
    model(torch.randn(2, 4)).sum().backward()
    model[0].weight.grad[0, 0] = float("nan")
    grad = model[0].weight.grad.clone()
    monitor.step()
    opt.step()
    assert model[0].weight.grad is None  # skipped: the gradients are cleared
    saved = torch.load(next(tmp_path.glob("*.pt")))
    assert set(saved) == {"0.weight", "0.weight.grad"}
    torch.testing.assert_close(saved["0.weight.grad"], grad, rtol=0, atol=0, equal_nan=True)
    monitor.detach()


def test_callback_action_and_bad_action_names():
    got = []
    model = nn.Linear(2, 1)
    call = {"type": "callback", "target": lambda e, m: got.append(e)}
    rules = only("threshold", "l", "loss", call, threshold=1)
    monitor = monitor_for(model, rules=rules).attach()
    monitor.step(5.0)
    assert got[0].rule == "l" and got[0].value == 5.0
    bad = only("threshold", "x", "loss", "reboot", threshold=1)
    with pytest.raises(numwatch.NumwatchConfigError, match="unknown action 'reboot'"):
        monitor_for(model, rules=bad)


@pytest.mark.parametrize("every", [1, 4])
def test_what_the_last_flush_did_reaches_the_log_at_detach(tmp_path, every):
    """Actions run after the sinks (a halt leaves the log complete), so the events of the last
    flush's actions have no flush to ride on: detach writes them, once."""
    path = tmp_path / "run.jsonl"
    model = nn.Linear(2, 1)
    call = {"type": "callback", "target": lambda e, m: None}
    rules = only("threshold", "l", "loss", call, threshold=1)
    monitor = monitor_for(
        model, rules=rules, sinks__jsonl__enabled=True, sinks__jsonl__path=str(path),
        sinks__jsonl__every=every,
    ).attach()  # fmt: skip
    for loss in (0.5, 0.5, 5.0):  # the last step's flush fires the rule and its action
        monitor.step(loss)
    monitor.detach()
    records = read_jsonl(path)
    events = [(r["step"], e["kind"], e["step"]) for r in records for e in r["events"]]
    assert events == [(2, "precursor", 2), (2, "action", 2)]
    assert records[-1]["events"][0]["message"].startswith("callback: called")
    # every 4th flush is written, and any with events: steps 0 and 1 are not (nothing held)
    written = [0, 1, 2] if every == 1 else [2]
    assert [(r["step"], bool(r["metrics"])) for r in records] == [
        *((s, True) for s in written),
        (2, False),
    ]
    replayed = replay(records, monitor.config.rules)  # the record of late events is skipped
    assert [(e.kind, e.step) for e in replayed] == [("precursor", 2)]


SKIP_NONFINITE = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]}


def _updated(model, before):
    return not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_a_skip_for_a_step_the_grad_scaler_skipped_does_not_skip_the_next_step():
    """On an overflow step the scaler never calls optimizer.step(): the skip decided for that
    step expires at the next step close instead of skipping the next, healthy update."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = monitor_for(model, rules=SKIP_NONFINITE, flush_every=100).attach(opt, scaler=scaler)
    updated = []
    for step in range(3):
        loss = model(torch.randn(8, 4)).square().mean()
        if step == 1:
            loss = loss * float("inf")  # overflow: the scaler skips this update itself
        scaler.scale(loss).backward()
        monitor.step(loss)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        updated.append(_updated(model, before))
    assert updated == [True, False, True]
    assert monitor.optimizer_control.skipped_steps == 0  # numwatch withheld no update
    assert [e.step for e in monitor.events if e.kind == "action"] == [1]


HALT_NONFINITE = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["halt"]}]}


@pytest.mark.parametrize("init_scale", [1024.0, 1.0])
@pytest.mark.parametrize("rules", [HALT_NONFINITE, SKIP_NONFINITE], ids=["halt", "skip_step"])
def test_a_grad_scaler_overflow_is_info_until_the_scale_is_down_to_one(init_scale, rules):
    """An fp16 run's GradScaler overflows by design (at the start, and whenever it tries a larger
    scale) and skips those updates itself: each was a critical nonfinite event, which a halt
    rule or stop_on=['nonfinite'] stopped a healthy run on. Now an info anomaly
    (scaler_overflow); at a scale of 1 the scale no longer explains it: nonfinite again."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    monitor = monitor_for(model, rules=rules, flush_every=2).attach(opt, scaler=scaler)
    seen = []
    monitor.on("nonfinite", seen.append)
    updated = []
    try:
        for step in range(4):
            loss = model(torch.randn(8, 4)).square().mean()
            scaler.scale(loss).backward()
            if step == 1:
                model.weight.grad[0, 0] = float("inf")  # the overflow of the scaled gradient
            monitor.step(loss)
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            updated.append(_updated(model, before))
    except NumwatchHalt:
        assert init_scale == 1.0 and rules is HALT_NONFINITE
        return
    kinds = [(e.kind, e.severity, e.rule) for e in monitor.events]
    if init_scale == 1.0:
        assert seen and ("nonfinite", "critical", "nonfinite") in kinds
        return
    assert updated == [True, False, True, True]  # the scaler skipped its overflow step
    assert seen == [] and kinds == [("anomaly", "info", "scaler_overflow")]
    (event,) = monitor.events
    assert event.step == 1 and event.labels == {"param": "weight"}
    assert event.evidence["loss_scale"] == 1024.0 and "GradScaler overflow" in event.message
    control = monitor.optimizer_control
    assert control is None or control.skipped_steps == 0  # numwatch withheld nothing


def test_a_loss_recorded_after_the_update_judges_no_step():
    """monitor.step(loss) after optimizer.step(): the step was judged (on its gradients) before
    its loss came, and the next step is judged without it; the NaN loss is still reported, at
    its own step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(model, rules=SKIP_NONFINITE, flush_every=100).attach(opt)
    updated = []
    for step in range(3):
        loss = model(torch.randn(8, 4)).square().mean()
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()  # closes and judges the step
        monitor.step(loss * float("nan") if step == 1 else loss)  # late: recorded only
        opt.zero_grad()
        updated.append(_updated(model, before))
    monitor.flush()
    assert updated == [True, True, True]
    assert monitor.optimizer_control.skipped_steps == 0
    assert [(e.kind, e.metric, e.step) for e in monitor.events] == [("nonfinite", "loss", 1)]


@pytest.mark.parametrize("skip", [True, False])
def test_skip_step_reads_every_steps_gradients_whatever_gradients_every(skip):
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rules = only("nonfinite", "nonfinite", None, *(["skip_step"] if skip else []))
    cfg = {"flush_every": 4, "gradients__every": 4, "activations__enabled": False}
    monitor = monitor_for(model, rules=rules, **cfg).attach(opt)
    for step in range(4):
        model(torch.randn(8, 4)).square().mean().backward()
        if step == 1:  # a step gradients.every=4 does not sample
            model.weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
    snap = monitor.snapshot()
    if skip:
        assert monitor.optimizer_control.skipped_steps == 1
        assert torch.isfinite(model.weight).all()
        assert snap.value("grad_numel", param="weight") == 4 * 4  # every step measured
        named = [e for e in monitor.events if e.kind == "nonfinite" and e.labels]
        assert [(e.labels, e.step) for e in named] == [({"param": "weight"}, 1)]
    else:  # no step-level rule: unsampled steps stay free
        assert snap.value("grad_numel", param="weight") == 4  # step 0 only


@pytest.mark.parametrize("kind", ["lambda", "onecycle"])
def test_an_lr_scheduler_built_after_attach_wraps_the_step_wrapper(kind):
    """Torch's scheduler wraps ``optimizer.step.__func__``: ours must be a bound method. After
    detach the scheduler's wrapper stays (it wraps ours, which then passes through)."""
    model = nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    rules = only("threshold", "big_loss", "loss", "skip_step", threshold=100)
    monitor = monitor_for(model, rules=rules).attach(opt)
    if kind == "lambda":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    else:
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=1.0, total_steps=10, cycle_momentum=False
        )
    wanted, used = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            if step == 4:
                monitor.detach()
            wanted.append(0.0 if step == 1 else opt.param_groups[0]["lr"])
            before = model.weight.item()
            model(torch.ones(1, 1)).sum().backward()  # d/dw = 1: the update is -lr exactly
            if monitor.attached:
                monitor.step(1000.0 if step == 1 else 1.0)  # step 1 is skipped
            opt.step()
            opt.zero_grad()
            sched.step()
            used.append(before - model.weight.item())
    assert used == pytest.approx(wanted)
    assert [str(w.message) for w in caught] == []
    assert opt.__dict__["step"]._wrapped_by_lr_sched


@pytest.mark.parametrize("scheduler", [False, True])
def test_a_skip_dropped_by_detach_withholds_no_update_through_a_scheduler(scheduler):
    """detach() (not within the step) drops a skip decided for the step: with an LR scheduler
    built after attach, the pass-through left kept it and withheld the next update silently."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(model, rules=SKIP_NONFINITE).attach(opt)
    if scheduler:
        torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    model(torch.ones(1, 2)).sum().backward()  # d/dw = 1: the update is -lr exactly
    monitor.step(torch.tensor(float("nan")))  # a skip decided for this step
    monitor.detach()
    before = model.weight.detach().clone()
    opt.step()
    assert torch.equal(model.weight.detach(), before - 0.1)


@pytest.mark.parametrize("within_step", [False, True])
def test_a_detached_monitor_is_freed_though_a_scheduler_wrapped_its_step_wrapper(within_step):
    """The scheduler's wrapper keeps ours as a pass-through for as long as the optimizer lives:
    through its closure it kept the whole detached monitor alive."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(model, rules=SKIP_NONFINITE).attach(opt)
    torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    model(torch.ones(1, 2)).sum().backward()
    monitor.step(torch.tensor(float("nan")) if within_step else 1.0)
    monitor.detach(within_step=within_step)  # a skip decided: kept for its optimizer.step()
    before = model.weight.detach().clone()
    opt.step()
    assert torch.equal(model.weight, before) == within_step
    gone = weakref.ref(monitor)
    del monitor
    gc.collect()
    assert gone() is None


def test_lbfgs_with_an_optimizer_action_evaluates_its_closure_as_without_one():
    """The optimizer's first closure call gets the evaluation numwatch judged the step on;
    LBFGS's later calls evaluate the real closure again."""

    def run(rules):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        x = torch.randn(64, 4)
        y = x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]]) + 0.3
        opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=20)
        if rules is not None:
            monitor_for(model, rules=rules, flush_every=100).attach(opt)
        calls = []

        def closure():
            calls.append(1)
            opt.zero_grad()
            loss = (model(x) - y).square().mean()
            loss.backward()
            return loss

        for _ in range(3):
            opt.step(closure)
        return [p.detach().clone() for p in model.parameters()], len(calls)

    plain, plain_calls = run(None)
    watched, watched_calls = run(SKIP_NONFINITE)
    assert watched_calls == plain_calls > 3
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization as github.com/davda54/sam writes it: an ascent step to the
    perturbed weights, its closure's gradient there, back to the weights, the base update.
    ``through_data``: the ascent written through ``p.data``, as many SAM ports do (it leaves
    the parameter's version as it was)."""

    through_data = False

    def __init__(self, params, rho=0.05, **kw):
        super().__init__(params, dict(rho=rho, **kw))
        self.base_optimizer = torch.optim.SGD(self.param_groups, **kw)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def step(self, closure):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.stack([g.norm() for g in grads]).norm()
        scale = self.param_groups[0]["rho"] / (norm + 1e-12)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.data.clone()
                    (p.data if self.through_data else p).add_(p.grad * scale)
        self.zero_grad()
        torch.enable_grad()(closure)()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()


def _sam_run(rules, nan_at=None):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    opt = SAM(model.parameters(), lr=0.1)
    monitor = monitor_for(model, rules=rules).attach(opt) if rules is not None else None
    calls = []

    def closure():
        calls.append(1)
        loss = (model(x) - y).square().mean()
        loss.backward()
        if len(calls) == nan_at:
            model.bias.grad.fill_(float("nan"))
        return loss

    for _ in range(5):
        (model(x) - y).square().mean().backward()  # SAM's first gradient
        opt.step(closure)
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], len(calls), monitor


def test_sam_trains_with_an_optimizer_action_as_without_one():
    """The wrapper ran the closure before SAM's step and handed SAM's own closure call that
    cached loss: SAM's gradient at the perturbed weights was never made, its second step did not
    restore the weights, and the training ascended (final loss 1.62 against 0.84)."""
    plain, plain_calls, _ = _sam_run(None)
    watched, watched_calls, monitor = _sam_run(SKIP_NONFINITE)
    assert watched_calls == plain_calls == 5
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))
    assert not [e for e in monitor.events if e.kind == "action"]


class SAMFirstAtW(SAM):
    """SAM that makes its first gradient itself: closure calls at the weights, then at the
    perturbed weights (the gradients its update uses)."""

    @torch.no_grad()
    def step(self, closure):
        loss = torch.enable_grad()(closure)()
        super().step(closure)
        return loss


class DataSAM(SAM):
    through_data = True


def _same(a, b):
    """Bitwise equal, through the dicts and lists of an optimizer's state."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _state(opt):
    return copy.deepcopy({id(p): s for p, s in opt.state.items()})


@pytest.mark.parametrize("optimizer", [SAM, SAMFirstAtW, DataSAM])
@pytest.mark.parametrize("nan_step", [0, 3])
def test_a_nan_at_sams_perturbed_weights_withholds_its_update_bitwise(optimizer, nan_step):
    """SAM's update uses the gradients at its perturbed weights. A NaN there reached the weights:
    with one closure call (davda54's SAM) the skip decided there was refused, the ascent having
    moved the weights, and with two calls the second was never judged. Now the update is
    withheld, with the weights and both optimizers' state as the step began. An ascent written
    through ``p.data`` changes no version: taken for no ascent, its later steps were not
    copied, and a skip left the weights at the perturbed point, said to be withheld cleanly."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    opt = optimizer(model.parameters(), lr=0.1, momentum=0.9)
    monitor = monitor_for(model, rules=SKIP_NONFINITE).attach(opt)
    perturbed_call = 2 if optimizer is SAMFirstAtW else 1
    for step in range(5):
        calls = []

        def closure(step=step, calls=calls):
            calls.append(1)
            loss = (model(x) - y).square().mean()
            loss.backward()
            if step == nan_step and len(calls) == perturbed_call:
                model.bias.grad.fill_(float("nan"))
            return loss

        opt.zero_grad()
        if optimizer is not SAMFirstAtW:
            (model(x) - y).square().mean().backward()  # SAM's first gradient
        before = [p.detach().clone() for p in model.parameters()]
        state, base = _state(opt), _state(opt.base_optimizer)
        opt.step(closure)
        assert _updated(model, before) == (step != nan_step)
        if step == nan_step:
            assert _same(_state(opt), state) and _same(_state(opt.base_optimizer), base)
            assert all(p.grad is None for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert monitor.optimizer_control.skipped_steps == 1
    assert [e.step for e in monitor.events if e.kind == "action"] == [nan_step]
    assert not monitor.errors
    monitor.detach()


@pytest.mark.parametrize("optimizer", [SAM, DataSAM])
@pytest.mark.parametrize("halt_step", [0, 3])
def test_a_halt_at_sams_perturbed_weights_leaves_the_weights_as_the_step_began(
    optimizer, halt_step
):
    """A halt decided in SAM's closure (after its ascent) raised out of SAM's step with the
    weights left at the perturbed point, w + rho*g/|g|, when training stopped. Now they and the
    optimizers' state are put back, as a skip puts them, before the halt goes on."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    opt = optimizer(model.parameters(), lr=0.1, momentum=0.9)
    halt = {"type": "threshold", "name": "big_loss", "metric": "loss", "threshold": 100,
            "actions": ["halt"]}  # fmt: skip
    rules = {"add": [*SKIP_NONFINITE["add"], halt]}
    monitor = monitor_for(model, rules=rules).attach(opt)
    for step in range(halt_step + 1):
        shift = 1000.0 if step == halt_step else 0.0

        def closure(shift=shift):
            loss = (model(x) - y + shift).square().mean()
            loss.backward()
            return loss

        opt.zero_grad()
        (model(x) - y).square().mean().backward()  # SAM's first gradient, at the weights
        before = [p.detach().clone() for p in model.parameters()]
        state, base = _state(opt), _state(opt.base_optimizer)
        if step < halt_step:
            opt.step(closure)
            continue
        with pytest.raises(NumwatchHalt) as err:
            opt.step(closure)
    assert err.value.report["rule"] == "big_loss"
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert _same(_state(opt), state) and _same(_state(opt.base_optimizer), base)
    assert not monitor.errors
    monitor.detach()


@pytest.mark.parametrize("optimizer", [SAM, DataSAM])
@pytest.mark.parametrize("nan_step", [0, 3])
def test_a_halt_only_monitor_puts_sams_ascent_back_before_it_stops_training(optimizer, nan_step):
    """With halt rules only (no skip_step), no step wrapper was installed: a halt decided in
    SAM's closure, on a NaN gradient at its perturbed weights, stopped training with the weights
    at w + rho*g/|g|. Now SAM's steps are wrapped and copied as for a skip: the weights and both
    optimizers' state are put back before the halt goes on. torch.optim's own optimizers,
    which change nothing before their closure, stay unwrapped."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    opt = optimizer(model.parameters(), lr=0.1, momentum=0.9)
    monitor = monitor_for(model, rules=HALT_NONFINITE).attach(opt)
    assert monitor.optimizer_control is not None
    for step in range(nan_step + 1):

        def closure(step=step):
            loss = (model(x) - y).square().mean()
            loss.backward()
            if step == nan_step:
                model.bias.grad.fill_(float("nan"))
            return loss

        opt.zero_grad()
        (model(x) - y).square().mean().backward()  # SAM's first gradient, at the weights
        before = [p.detach().clone() for p in model.parameters()]
        state, base = _state(opt), _state(opt.base_optimizer)
        if step < nan_step:
            opt.step(closure)
            assert _updated(model, before)
            continue
        with pytest.raises(NumwatchHalt) as err:
            opt.step(closure)
    assert err.value.report["rule"] == "nonfinite"
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert _same(_state(opt), state) and _same(_state(opt.base_optimizer), base)
    assert not monitor.errors
    monitor.detach()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = monitor_for(model, rules=HALT_NONFINITE).attach(sgd)
    assert plain.optimizer_control is None
    plain.detach()


def test_a_nan_in_lbfgs_line_search_withholds_its_update_bitwise():
    """LBFGS moves the weights and updates its state between closure calls: a NaN at its third
    call was never judged and reached the weights. Now the step is withheld with the weights
    and state it began with (its ``prev_flat_grad``, changed in place, copied from the step
    after one that changed it)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]]) + 0.3
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=3)
    monitor = monitor_for(model, rules=SKIP_NONFINITE).attach(opt)
    for step in range(4):
        calls = []

        def closure(step=step, calls=calls):
            calls.append(1)
            opt.zero_grad()
            loss = (model(x) - y).square().mean()
            loss.backward()
            if step == 2 and len(calls) == 3:
                model.weight.grad[0, 1] = float("inf")
            return loss

        before = [p.detach().clone() for p in model.parameters()]
        state = _state(opt)
        opt.step(closure)
        assert len(calls) == (3 if step == 2 else 4)
        assert _updated(model, before) == (step != 2)
        if step == 2:
            assert _same(_state(opt), state)
    assert monitor.optimizer_control.skipped_steps == 1
    assert [e.step for e in monitor.events if e.kind == "action"] == [2]
    assert not monitor.errors
    monitor.detach()


class SAMAfterFirstStep(SAM):
    """Calls its closure once, first, at its first step; SAM's ascent before it from then on."""

    def __init__(self, params, through_data=False, **kw):
        super().__init__(params, **kw)
        self.through_data = through_data

    @torch.no_grad()
    def step(self, closure):
        if self.base_optimizer.state:
            return super().step(closure)
        torch.enable_grad()(closure)()
        self.base_optimizer.step()


@pytest.mark.parametrize("through_data", [False, True])
def test_a_skip_after_an_unforeseen_ascent_withholds_the_update_and_says_so(through_data):
    """An optimizer whose first step called its closure once, first, is not copied; when a
    later step moves the weights before its call, a skip there leaves them as it moved them
    (finite: the NaN update stays out), counted as an error; its steps are copied from then.
    Also when the ascent is written through ``p.data`` (no version changes): that skip was
    said to be clean, and the later ones left the weights perturbed too."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    opt = SAMAfterFirstStep(model.parameters(), through_data, lr=0.1, momentum=0.9)
    monitor = monitor_for(model, rules=SKIP_NONFINITE).attach(opt)
    updated = []
    for step in range(4):

        def closure(step=step):
            loss = (model(x) - y).square().mean()
            loss.backward()
            if step >= 1:
                model.bias.grad.fill_(float("nan"))
            return loss

        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step(closure)
        updated.append(_updated(model, before))
    assert updated == [True, True, False, False]  # step 1: left at its ascent; then put back
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert monitor.optimizer_control.skipped_steps == 3
    assert monitor.errors == {"actions": 1}
    monitor.detach()


@pytest.mark.parametrize("as_keyword", [False, True])
def test_a_skip_decided_in_the_closure_withholds_the_update(as_keyword):
    """The step is judged after the optimizer's first closure call; a skip ends the step there,
    before the update: weights and optimizer state unchanged, gradients cleared, loss returned."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    monitor = monitor_for(model, rules=SKIP_NONFINITE).attach(opt)
    x = torch.randn(8, 4)
    losses = []
    for step in range(3):

        def closure(step=step):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            if step == 1:
                model.weight.grad[0, 0] = float("nan")
            return loss

        before = [p.detach().clone() for p in model.parameters()]
        state = copy.deepcopy(opt.state_dict())
        losses.append(opt.step(closure=closure) if as_keyword else opt.step(closure))
        assert _updated(model, before) == (step != 1)
        if step == 1:
            assert all(p.grad is None for p in model.parameters())
            assert opt.state_dict()["state"][0]["step"] == state["state"][0]["step"] == 1
    assert all(isinstance(loss, torch.Tensor) for loss in losses)
    assert monitor.optimizer_control.skipped_steps == 1
    assert [e.step for e in monitor.events if e.kind == "action"] == [1]
    assert not monitor.errors
    monitor.detach()


def test_detach_from_a_step_level_callback_waits_for_the_end_of_the_step():
    """The skip decided on a NaN gradient still happens; the detach follows the step close."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(model, rules=SKIP_NONFINITE, flush_every=2).attach(opt)
    monitor.on("nonfinite", lambda e: monitor.detach())
    updated = []
    for step in range(3):
        model(torch.randn(8, 4)).square().mean().backward()
        if step == 1:
            model.weight.grad[0, 0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        updated.append(_updated(model, before))
    assert updated == [True, False, True]
    assert not monitor.attached and "step" not in opt.__dict__
    assert torch.isfinite(model.weight).all()
    assert not any(monitor.errors.values()), monitor.errors


def test_flush_from_a_step_level_callback_runs_when_the_step_is_closed():
    """It ran inside the step close, before the step counted: a record labelled with the
    previous step held this step's NaN gradient norm."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # every step has the same gradients
    monitor = monitor_for(model, rules=SKIP_NONFINITE, flush_every=100).attach(opt)
    returned = []
    monitor.on("nonfinite", lambda e: returned.append(monitor.flush()))
    x = torch.randn(3, 4)
    for step in range(8):
        model(x).sum().backward()
        if step == 5:
            model.weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
    assert returned[0] is None  # no flush had run yet
    flushed = [(s.step, math.isnan(s.value("grad_norm"))) for s in monitor.history]
    assert flushed == [(5, True)]
    monitor.detach()
    assert [(s.step, math.isnan(s.value("grad_norm"))) for s in monitor.history][-1] == (7, False)


def test_the_skipped_steps_counter_never_goes_back_across_a_reattach():
    """It is exported as a Prometheus counter; a new attach restarted it at 0."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(model, rules=SKIP_NONFINITE)
    seen = []
    for steps in (3, 2):
        monitor.attach(opt)
        for _ in range(steps):
            model(torch.randn(8, 4)).square().mean().backward()
            model.weight.grad[0, 0] = float("nan")
            opt.step()
            opt.zero_grad()
            seen.append(monitor.snapshot().value("mitigation_skipped_steps_total"))
        monitor.detach()
    assert seen == sorted(seen) and seen[-1] >= 4


def _halting_run(tmp_path, rules, flush_every=50, steps=3, nan_at=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(
        model, flush_every=flush_every, rules=rules, sinks__jsonl__enabled=True,
        sinks__jsonl__path=str(tmp_path / "run.jsonl"),
    ).attach(opt)  # fmt: skip
    for step in range(steps):
        x = torch.randn(16, 4)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        if step == nan_at:
            loss = loss * float("nan")
        loss.backward()
        try:
            monitor.step(loss)
        except NumwatchHalt:
            break
        opt.step()
        opt.zero_grad()
    return monitor


def test_a_halt_in_the_final_flush_leaves_its_actions_in_the_log(tmp_path):
    """detach()'s flush fired a snapshot action and then a halt: the action's event was in
    .events but never reached the log."""
    rules = {"add": [
        {"type": "threshold", "name": "keep", "metric": "loss", "threshold": -1,
         "actions": [{"type": "snapshot", "directory": str(tmp_path / "forensics")}]},
        {"type": "threshold", "name": "stop", "metric": "loss", "threshold": -1,
         "actions": ["halt"]},
    ]}  # fmt: skip
    monitor = _halting_run(tmp_path, rules)
    with pytest.raises(NumwatchHalt):
        monitor.detach()
    logged = [
        (e["kind"], e["rule"]) for r in read_jsonl(tmp_path / "run.jsonl") for e in r["events"]
    ]
    assert ("action", "keep") in logged


def test_an_exception_in_the_with_block_is_not_replaced_by_a_halt(tmp_path):
    rules = {"add": [{"type": "threshold", "name": "stop", "metric": "loss", "threshold": -1,
                      "actions": ["halt"]}]}  # fmt: skip
    model = nn.Linear(4, 1)
    monitor = monitor_for(model, flush_every=50, rules=rules)
    with pytest.raises(KeyError, match="user"), monitor:
        monitor.attach()
        model(torch.randn(2, 4)).sum().backward()
        monitor.step(torch.tensor(1.0))
        raise KeyError("user")
    assert not monitor.attached


def test_a_step_level_halt_labels_its_step(tmp_path):
    """A halt from a step-level rule skipped the rest of the step close: the halted step's NaN
    loss was logged under the previous step."""
    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step", "halt"]}]}
    monitor = _halting_run(tmp_path, rules, flush_every=10, nan_at=2)
    monitor.detach()
    (record,) = [r for r in read_jsonl(tmp_path / "run.jsonl") if r["metrics"]]
    values = {m["name"]: m["value"] for m in record["metrics"]}
    assert record["step"] == 2 and math.isnan(values["loss"])


def test_a_detach_asked_by_a_step_level_callback_keeps_the_skip_it_decided():
    """detach(within_step=True) from an event callback was deferred without its argument: the
    optimizer wrapper went, and the NaN update the step had decided to skip was applied."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(model, rules=SKIP_NONFINITE).attach(opt)
    monitor.on("nonfinite", lambda e: monitor.detach(within_step=True))
    before = model.weight.detach().clone()
    loss = model(torch.randn(2, 4)).sum() * float("nan")
    loss.backward()
    monitor.step(loss)
    assert not monitor.attached
    opt.step()
    assert torch.equal(model.weight, before)
    assert "step" not in opt.__dict__  # the wrapper went with that step


def test_a_second_detach_request_in_the_same_step_close_keeps_the_skip():
    """The nonfinite event fires in the step-level check and again in that step's flush: the
    second request (outside the step check) reset the deferred detach to drop the skip."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(model, rules=SKIP_NONFINITE, flush_every=1).attach(opt)
    monitor.on("nonfinite", lambda e: monitor.detach())
    before = model.weight.detach().clone()
    loss = model(torch.randn(2, 4)).sum() * float("nan")
    loss.backward()
    monitor.step(loss)
    opt.step()
    assert not monitor.attached and torch.equal(model.weight, before)


def test_replay_gives_the_grad_scaler_overflow_as_logged(tmp_path):
    from numwatch.replay import replay
    from numwatch.sinks.jsonl import read_jsonl

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    log = tmp_path / "run.jsonl"
    monitor = monitor_for(model, sinks__jsonl__enabled=True, sinks__jsonl__path=str(log))
    monitor.attach(opt, scaler=scaler)
    for step in range(3):
        loss = model(torch.randn(8, 4)).square().mean()
        scaler.scale(loss).backward()
        if step == 1:
            model.weight.grad[0, 0] = float("inf")
        monitor.step(loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    monitor.detach()
    events = replay(read_jsonl(log))
    assert [(e.kind, e.rule, e.step) for e in events] == [("anomaly", "scaler_overflow", 1)]


def test_the_scale_decides_without_the_optimizer_probe():
    """With optimizer.enabled=False the flush had no loss scale, and a NaN gradient at a scale
    of 1 or below read as the scaler's info overflow instead of a critical nonfinite."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for probe in (True, False):
        scaler = torch.amp.GradScaler("cpu", init_scale=0.5, growth_interval=10**6)
        monitor = monitor_for(model, optimizer__enabled=probe).attach(opt, scaler=scaler)
        y = model(torch.randn(8, 4))
        loss = (y - y.detach()).abs().sqrt().sum()  # forward and loss finite, gradient NaN
        scaler.scale(loss).backward()
        monitor.step(loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert [(e.kind, e.severity) for e in monitor.events] == [("nonfinite", "critical")]
        monitor.detach()


def test_replay_keeps_a_users_rule_named_scaler_overflow_once(tmp_path):
    from numwatch.replay import replay
    from numwatch.sinks.jsonl import read_jsonl

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    log = tmp_path / "run.jsonl"
    rule = {"type": "threshold", "name": "scaler_overflow", "metric": "loss", "threshold": 100.0}
    rules = {"defaults": False, "add": [rule]}
    monitor = monitor_for(
        model, rules=rules, sinks__jsonl__enabled=True, sinks__jsonl__path=str(log)
    ).attach()
    for value in (1.0, 500.0, 1.0):
        loss = model(torch.randn(8, 4)).mean() * 0 + value
        loss.backward()
        monitor.step(loss)
        model.zero_grad()
    monitor.detach()
    assert [(e.rule, e.step) for e in replay(read_jsonl(log), monitor.config.rules)] == [
        ("scaler_overflow", 1)
    ]


class _CountedParameter(nn.Parameter):
    """Counts the reads of its ``_version`` from Python."""

    reads = 0

    @property
    def _version(self):
        _CountedParameter.reads += 1
        return super()._version


class _OwnStep(torch.optim.SGD):
    """An optimizer of the user's own: numwatch cannot know when it calls its closure."""

    def step(self, closure=None):
        return super().step(closure)


@pytest.mark.parametrize(
    ("optimizer", "rules", "reads"),
    [(_OwnStep, SKIP_NONFINITE, 8), (torch.optim.SGD, SKIP_NONFINITE, 0), (_OwnStep, None, 0)],
)
def test_a_closure_step_reads_a_few_parameter_versions_at_most(optimizer, rules, reads):
    """Each optimizer.step(closure) read the version of every parameter twice (0.1-0.2 ms with
    1000 parameters), also where no skip_step could withhold the update or the optimizer is one
    of torch's, which call the closure before they change anything."""
    params = nn.ParameterList([_CountedParameter(torch.ones(2)) for _ in range(40)])
    model = nn.Module()
    model.params = params
    opt = optimizer(model.parameters(), lr=0.1)
    backoff = {"add": [{"type": "threshold", "name": "big", "metric": "loss", "threshold": 1e9,
                        "actions": [{"type": "lr_backoff"}]}]}  # fmt: skip
    monitor = monitor_for(model, rules=rules or backoff).attach(opt)

    def closure():
        opt.zero_grad()
        loss = sum(p.sum() for p in params)
        loss.backward()
        return loss

    opt.step(closure)
    _CountedParameter.reads = 0
    opt.step(closure)
    assert _CountedParameter.reads == reads
    assert monitor.optimizer_control is not None
    monitor.detach()
