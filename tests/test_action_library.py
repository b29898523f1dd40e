"""The action library's own contracts: what one firing does, however many series fire."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import OwnStepSize
from torch import nn

import numwatch
from numwatch.actions.library import ForensicSnapshot, LrBackoff, QKClip, qk_clip
from numwatch.actions.optimizer_control import OptimizerControl
from numwatch.errors import NumwatchError
from numwatch.events import Event


def monitor_for(model, action, metric, **rule):
    rule = {"type": "threshold", "name": "r", "metric": metric, "actions": [action], **rule}
    return numwatch.Monitor(
        model,
        flush_every=1,
        rules={"defaults": False, "add": [rule]},
        sinks__console__enabled=False,
        sinks__jsonl__enabled=False,
    )


def lrs_seen(opt):
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))
    return seen


# ------------------------------------------------------------------------------ lr_backoff
def test_lr_backoff_is_one_factor_however_many_series_fire():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))  # 4 parameters: 4 grad_max series
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backoff = {"type": "lr_backoff", "factor": 0.5, "steps": 10}
    monitor = monitor_for(model, backoff, "grad_max", op="abs>", threshold=0.0).attach(opt)
    seen = lrs_seen(opt)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert seen == [0.05]  # not 0.1 * 0.5**4
    assert sum(e.kind == "action" for e in monitor.events) == 1
    monitor.detach()


def test_lr_backoff_refiring_inside_its_window_restarts_it_without_compounding():
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backoff = {"type": "lr_backoff", "factor": 0.5, "steps": 3, "min_interval_steps": 0}
    monitor = monitor_for(model, backoff, "loss", threshold=10.0).attach(opt)
    seen = lrs_seen(opt)
    for step in range(8):  # fires at steps 0 and 2: the window of 3 restarts at step 2
        model(torch.ones(1, 1)).sum().backward()
        monitor.step(100.0 if step in (0, 2) else 1.0)
        opt.step()
        opt.zero_grad()
    assert seen == [0.05] * 5 + [0.1] * 3  # never 0.025; back at step 5, not 3
    assert [e.step for e in monitor.events if e.kind == "action"] == [0, 2]
    monitor.detach()


def test_lr_backoff_windows_are_per_rule():
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0)
    control = OptimizerControl(opt, lambda *_: None)
    ctx = SimpleNamespace(optimizer_control=control)
    action = LrBackoff(factor=0.5, steps=10, min_interval_steps=0)
    for rule in ("a", "b", "a"):
        action.maybe_run(ctx, Event(kind="precursor", step=0, message="", rule=rule))
    assert control.lr_factor == 0.25  # one back-off for each rule


def test_lr_backoff_scales_the_numeric_lrs_only():
    """A group whose lr is None made the wrapped step raise TypeError (None * factor) into the
    training loop once a back-off fired."""
    model = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False))
    opt = OwnStepSize(model[0].parameters(), size=1.0)
    opt.add_param_group({"params": list(model[1].parameters()), "lr": 1.0})
    backoff = {"type": "lr_backoff", "factor": 0.5, "steps": 10}
    monitor = monitor_for(model, backoff, "loss", threshold=10.0).attach(opt)
    before = [p.item() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    monitor.step(100.0)
    opt.step()
    assert [b - p.item() for b, p in zip(before, model.parameters(), strict=True)] == [1.0, 0.5]
    assert [group["lr"] for group in opt.param_groups] == [None, 1.0]
    monitor.detach()


def test_lr_backoff_is_refused_when_no_group_has_a_numeric_lr():
    model = nn.Linear(1, 1, bias=False)
    opt = OwnStepSize(model.parameters(), size=1.0)
    backoff = {"type": "lr_backoff", "factor": 0.5, "steps": 10}
    monitor = monitor_for(model, backoff, "loss", threshold=10.0).attach(opt)
    before = model.weight.item()
    model.weight.grad = torch.ones_like(model.weight)
    monitor.step(100.0)
    opt.step()
    assert before - model.weight.item() == 1.0
    assert monitor.optimizer_control.lr_factor == 1.0
    assert monitor.errors["actions"] == 1
    [action] = [e for e in monitor.events if e.kind == "action"]
    assert action.evidence["failed"] and "no param group of the optimizer has a numeric lr" in (
        action.message
    )
    monitor.detach()


# ------------------------------------------------------------------------------ qk_clip
class TiedAttn(nn.Module):
    """q_proj and k_proj over one storage: the same Parameter, or rows shifted by ``shift``."""

    def __init__(self, d=8, heads=2, shift=None):
        super().__init__()
        self.num_heads = heads
        self.q_proj = nn.Linear(d, d, bias=False, dtype=torch.float64)
        self.k_proj = nn.Linear(d, d, bias=False, dtype=torch.float64)
        if shift is None:
            self.k_proj.weight = self.q_proj.weight
        else:  # overlapping views of one buffer: k's rows are q's, moved down by `shift`
            rows = torch.randn(d + shift, d, dtype=torch.float64)
            self.q_proj.weight = nn.Parameter(rows[:d])
            self.k_proj.weight = nn.Parameter(rows[shift:])

    def logits(self, x, head):
        hd = self.q_proj.out_features // self.num_heads
        q = self.q_proj(x)[:, head * hd : (head + 1) * hd]
        k = self.k_proj(x)[:, head * hd : (head + 1) * hd]
        return q @ k.T


@pytest.mark.parametrize("shift", [None, 2], ids=["same parameter", "overlapping views"])
def test_qk_clip_scales_tied_projections_exactly_once(shift):
    torch.manual_seed(0)
    model = nn.Sequential(TiedAttn(shift=shift))
    x = torch.randn(5, 8, dtype=torch.float64)
    before = model[0].logits(x, head=1)
    if shift is not None:  # the head's q and k rows do share memory
        assert model[0].q_proj.weight.untyped_storage().data_ptr() == (
            model[0].k_proj.weight.untyped_storage().data_ptr()
        )
    ratio = qk_clip(model, "0", 1, 400.0, 100.0)
    torch.testing.assert_close(model[0].logits(x, head=1), before * ratio)


@pytest.mark.parametrize("logit", [math.inf, math.nan])
def test_qk_clip_refuses_a_logit_that_overflowed(logit):
    """tau / inf is 0: it zeroed the head's W_q and W_k for good (NaN made them NaN)."""
    torch.manual_seed(0)
    model = nn.Sequential(TiedAttn(shift=2))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NumwatchError, match="overflowed"):
        qk_clip(model, "0", 1, logit, 100.0)
    action = QKClip(tau=100.0)
    ctx = SimpleNamespace(model=model, optimizer_control=None)
    event = Event(kind="precursor", step=0, message="", rule="r", value=logit,
                  labels={"layer": "0", "head": "1"})  # fmt: skip
    with pytest.raises(NumwatchError, match="overflowed"):
        action.run(ctx, event)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# ------------------------------------------------------------------------------ snapshot
def test_snapshot_writes_one_pair_per_series_fired_in_one_flush(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    save = {"type": "snapshot", "directory": str(tmp_path)}
    monitor = monitor_for(model, save, "grad_max", op="abs>", threshold=0.0).attach()
    model(torch.randn(2, 4)).sum().backward()
    monitor.step()
    messages = [e.message for e in monitor.events if e.kind == "action"]
    assert len(messages) == 4
    params = set()
    for message in messages:  # each names its own file, which holds its own series
        stem = message.split(" to ")[1].removesuffix(".pt/.json (rule r)")
        param = json.loads(Path(f"{stem}.json").read_text())["event"]["labels"]["param"]
        assert set(torch.load(f"{stem}.pt")) == {param, param + ".grad"}
        params.add(param)
    assert params == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert len(list(tmp_path.glob("*.pt"))) == len(list(tmp_path.glob("*.json"))) == 4
    monitor.detach()


def test_snapshot_of_an_update_of_a_parameter_outside_the_model(tmp_path):
    """A learned temperature trained outside the model: the event's param label is the name
    given to the optimizer, which model.get_parameter raised on (the snapshot was lost, counted
    as an action error)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    temperature = nn.Parameter(torch.ones(()))
    opt = torch.optim.AdamW([*model.named_parameters(), ("temperature", temperature)], lr=0.1)
    snap = {"type": "snapshot", "directory": str(tmp_path)}
    rule = {"type": "threshold", "name": "r", "metric": "optimizer_update_ratio",
            "threshold": 0.0, "cooldown": 10, "actions": [snap]}  # fmt: skip
    monitor = numwatch.Monitor(
        model, flush_every=1, optimizer__every=1, rules={"defaults": False, "add": [rule]},
        sinks__console__enabled=False, sinks__jsonl__enabled=False,
    ).attach(opt)  # fmt: skip
    for _ in range(2):
        opt.zero_grad()
        (model(torch.ones(2, 4)).sum() * temperature).backward()
        opt.step()
    monitor.detach()
    assert monitor.errors.get("actions", 0) == 0
    saved = {p.name.split("param=")[1].removesuffix(".pt"): set(torch.load(p))
             for p in tmp_path.glob("*.pt")}  # fmt: skip
    assert saved == {
        "weight": {"weight", "weight.grad"}, "bias": {"bias", "bias.grad"},
        "temperature": {"temperature", "temperature.grad"},
    }  # fmt: skip


def test_snapshot_never_overwrites_and_keeps_names_filesystem_safe(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2))
    ctx = SimpleNamespace(model=model, history=[])
    action = ForensicSnapshot(directory=str(tmp_path))
    event = Event(kind="anomaly", step=3, message="", rule="a/b", labels={"module": "0"})
    first, second = (action.run(ctx, event) for _ in range(2))
    assert first != second
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "step00000003-a_b-module=0-1.json",
        "step00000003-a_b-module=0-1.pt",
        "step00000003-a_b-module=0.json",
        "step00000003-a_b-module=0.pt",
    ]


# ------------------------------------------------------------------------------ callback
@pytest.mark.parametrize(
    ("target", "problem"),
    [
        ("os.path:joinn", " does not resolve: module 'posixpath' has no attribute 'joinn'"),
        ("no_such_module_nw:f", " does not resolve: No module named 'no_such_module_nw'"),
        ("os.path.join", ": expected 'package.module:function'"),
        ("os:sep", " is a str, not a callable"),
    ],
)
def test_callback_target_is_resolved_at_config_time(target, problem):
    call = {"type": "callback", "target": target}
    with pytest.raises(numwatch.NumwatchConfigError) as err:
        monitor_for(nn.Linear(2, 1), call, "loss", threshold=1.0)
    assert str(err.value).endswith(f"rules[r].actions: callback: target {target!r}{problem}")


def test_callback_string_target_is_called_when_the_rule_fires(monkeypatch):
    got = []
    hooks = types.ModuleType("nw_test_hooks")
    hooks.ns = SimpleNamespace(on_event=lambda event, monitor: got.append(event.value))
    monkeypatch.setitem(sys.modules, "nw_test_hooks", hooks)
    call = {"type": "callback", "target": "nw_test_hooks:ns.on_event"}
    monitor = monitor_for(nn.Linear(2, 1), call, "loss", threshold=1.0).attach()
    monitor.step(5.0)
    assert got == [5.0]
    monitor.detach()
