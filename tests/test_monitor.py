"""Monitor core: planted statistics, first non-finite origin, step closing, detach, robustness."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import math
import time

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import numwatch
from numwatch.errors import NumwatchConfigError, NumwatchHalt
from numwatch.sinks.console import ConsoleSink
from numwatch.sinks.jsonl import read_jsonl
from numwatch.testing import hook_state, host_never_waits, planted_tensor, requires_gpu


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    extra: tuple


class Emit(nn.Module):
    """Returns whatever it was told to, ignoring its input: planted forward outputs."""

    def __init__(self, output=None):
        super().__init__()
        self.output = output
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.output


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 1)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def train_steps(model, monitor, n, *, opt=None, plant=None):
    """n steps; without ``opt`` the weights stay put (so a planted NaN does not spread)."""
    for step in range(n):
        loss = model(torch.randn(5, 4)).square().mean()
        loss.backward()
        if plant is not None:
            plant(step)
        monitor.step(loss)
        if opt is not None:
            opt.step()
        model.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_planted_gradient_statistics_exact(make_monitor, dtype):
    grad, _ = planted_tensor(dtype, nan=2, posinf=3, neginf=1, zeros=4, subnormal=5, normal=11)
    model = nn.Linear(26, 1, bias=False).to(dtype)
    monitor = make_monitor(model, flush_every=1, activations__enabled=False).attach()
    model.weight.grad = grad.reshape(1, 26).clone()
    monitor.step()
    snap = monitor.snapshot()
    p = {"param": "weight"}
    assert snap.step == 0
    assert snap.value("grad_numel", **p) == 26
    assert snap.value("grad_nan", **p) == 2
    assert snap.value("grad_posinf", **p) == 3
    assert snap.value("grad_neginf", **p) == 1
    assert snap.value("grad_nonfinite", **p) == 6
    assert snap.value("grad_zeros", **p) == 4
    assert snap.value("grad_subnormal", **p) == 5
    assert snap.value("grad_underflow_fraction", **p) == pytest.approx(5 / 16)
    assert snap.value("grad_absmax", **p) == 8.0
    assert snap.value("grad_min", **p) == -8.0
    assert snap.value("grad_headroom", **p) == pytest.approx(8.0 / torch.finfo(dtype).max)
    finite = grad[torch.isfinite(grad)].double()
    assert snap.value("grad_mean", **p) == pytest.approx(finite.mean().item(), rel=1e-6)
    assert snap.value("grad_rms", **p) == pytest.approx(finite.square().mean().sqrt().item())
    assert math.isnan(snap.value("grad_norm"))  # non-finite gradients poison the global norm


def test_underflow_dtype_counts_values_an_fp16_cast_would_flush(make_monitor):
    model = nn.Linear(4, 1, bias=False)
    monitor = make_monitor(model, flush_every=1, underflow_dtype="float16").attach()
    model.weight.grad = torch.tensor([[1e-6, -3e-5, 1.0, 0.0]])  # two below fp16's 6.1e-5
    monitor.step()
    snap = monitor.snapshot()
    assert snap.value("grad_underflow_fraction", param="weight") == pytest.approx(2 / 3)
    assert snap.value("grad_subnormal", param="weight") == 0  # none subnormal in fp32


def test_gradient_statistics_under_a_grad_scaler_are_of_the_true_gradients(make_monitor):
    """README's GradScaler loop closes the step with monitor.step() before scaler.step(), while
    the gradients are still multiplied by the loss scale: grad_norm, grad_absmax... came out
    x1024 here (x65536 at the default scale) and moved with every change of the scale."""
    model = nn.Linear(4, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = make_monitor(model, flush_every=1).attach(opt, scaler=scaler)
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0]])  # the gradient of model(x).sum()
    seen = []
    for step, how in enumerate(["step", "overflow", "step", "unscale_ first", "optimizer hook"]):
        loss = model(x).sum()
        scaler.scale(loss).backward()
        if how == "overflow":
            model.weight.grad[0, 0] = math.inf  # the scaler skips it and halves its scale
        if how == "unscale_ first":
            scaler.unscale_(opt)  # the gradients are true ones already: divided once only
        if how != "optimizer hook":
            monitor.step(loss)
        scaler.step(opt)  # unscales, then optimizer.step(), whose pre-hook closes a step
        scaler.update()
        opt.zero_grad()
        snap = monitor.snapshot()
        assert snap.step == step
        p = {"param": "weight"}
        seen.append(
            [snap.value(f"grad_{k}", **p) for k in ("absmax", "min", "max", "mean", "rms")]
            + [snap.value("grad_norm"), snap.value("loss_scale")]
        )
    true = [4.0, -2.0, 4.0, 0.875, math.sqrt(21.25 / 4), math.sqrt(21.25)]
    assert seen[0] == [*true, 1024.0]
    assert seen[1][:3] == [4.0, -2.0, 4.0] and math.isnan(seen[1][5])  # the overflow step
    assert seen[2:] == [[*true, 512.0]] * 3  # the scale halved: divided by the new one


@requires_gpu
def test_unscaled_gradient_statistics_do_not_sync_on_gpu(make_monitor):
    """The statistics are divided by the loss scale on the device, with new factors each time
    the scale changes (here every step), and the host never waits for the GPU."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=1)
    monitor = make_monitor(model, flush_every=100).attach(opt, scaler=scaler)
    x = torch.randn(8, 64, device="cuda")

    def step(check: bool) -> None:
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        with host_never_waits() if check else contextlib.nullcontext():
            monitor.step(loss)
        scaler.step(opt)
        scaler.update()  # the scale doubles: new factors at the next step
        opt.zero_grad()

    step(False)  # warm: kernels loaded, plans made
    step(True)
    true = torch.autograd.grad(model(x).square().mean(), model.weight)[0]
    snap = monitor.flush()
    assert snap.value("grad_absmax", param="weight") == pytest.approx(true.abs().max().item())


def test_planted_activation_outputs_of_any_structure(make_monitor):
    a, want_a = planted_tensor(torch.bfloat16, nan=1, zeros=2, normal=5, absmax=4.0)
    b, _ = planted_tensor(torch.float32, posinf=1, normal=3, absmax=2.0, seed=1)
    model = nn.ModuleDict(
        {
            "tup": Emit((a, torch.arange(3), None)),  # ints and None are not statistics
            "dct": Emit({"x": b, "mask": torch.ones(2, dtype=torch.bool)}),
            "none": Emit(None),
            "empty": Emit(torch.empty(0, 3)),
            "dataclass": Emit(Output(hidden=b, extra=(a,))),  # were left out, unmeasured
        }
    )
    monitor = make_monitor(model, flush_every=1, activations__every=1).attach()
    for m in model.values():
        m(None)
    monitor.step()
    snap = monitor.snapshot()
    assert snap.value("activation_numel", module="tup") == want_a.numel
    assert snap.value("activation_nan", module="tup") == 1
    assert snap.value("activation_zeros", module="tup") == 2
    assert snap.value("activation_absmax", module="tup") == 4.0
    assert snap.value("activation_headroom", module="tup") == pytest.approx(
        4.0 / torch.finfo(torch.bfloat16).max
    )
    assert snap.value("activation_posinf", module="dct") == 1
    assert snap.value("activation_absmax", module="dct") == 2.0
    assert snap.get("activation_numel", module="none") is None
    assert snap.get("activation_numel", module="empty") is None
    assert snap.value("activation_numel", module="dataclass") == b.numel() + a.numel()
    assert snap.value("activation_posinf", module="dataclass") == 1
    assert snap.value("activation_nan", module="dataclass") == 1


def test_fp8_activation_statistics(make_monitor):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8")
    out = torch.tensor([0.0, 1.0, -448.0, 2.0]).to(torch.float8_e4m3fn)
    model = nn.Sequential(Emit(out))
    monitor = make_monitor(model, flush_every=1, activations__every=1).attach()
    model(None)
    monitor.step()
    snap = monitor.snapshot()
    assert snap.value("activation_absmax", module="0") == 448.0
    assert snap.value("activation_headroom", module="0") == 1.0
    assert snap.value("activation_zeros", module="0") == 1


def test_activation_sampling_every_and_training_only(make_monitor):
    model = nn.Sequential(Emit(torch.ones(3)))
    monitor = make_monitor(model, flush_every=4, activations__every=2).attach()
    for _ in range(4):
        model(None)
        monitor.step()
    assert monitor.snapshot().value("activation_numel", module="0") == 6  # steps 0 and 2
    model.eval()
    for _ in range(4):
        model(None)
        monitor.step()
    assert monitor.snapshot().get("activation_numel", module="0") is None


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_forwards_that_close_no_step_hold_bounded_memory_and_name_a_late_nan(make_monitor, context):
    """With training_only off, forwards that close no step (validation, generate(), an
    inference loop) held one stats row and one origin entry per forward until the next flush:
    +155 MB over 40k forwards of 25 modules. Under inference_mode, where each output is
    measured in its module's hook, one origin entry per module per forward. A NaN in the last
    of many still names its module."""
    from numwatch.probes.tensors import ActivationProbe

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    monitor = make_monitor(model, activations__training_only=False).attach()
    probe = next(p for p in monitor._probes if isinstance(p, ActivationProbe))
    x = torch.randn(2, 4)
    with context():
        for _ in range(300):
            model(x)
        assert sum(map(len, probe._measured.values())) < 64
        assert len(monitor._ctx.tracker._batches) == 1
        model[1].weight[0, 0] = float("nan")
        model(x)
    snap = monitor.flush()
    assert snap.value("activation_numel", module="0") == 301 * 8
    (event,) = [e for e in monitor.events if e.kind == "nonfinite"]
    assert event.labels == {"module": "1"}
    monitor.detach()


def test_a_validation_after_the_last_step_reaches_the_log_at_detach(make_monitor):
    """With activations.training_only false, detach flushed only when a step had closed since
    the last flush: the final validation's statistics, and a NaN in it, were lost."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = make_monitor(
        model, flush_every=2, activations__every=1, activations__training_only=False
    ).attach(opt)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        x = torch.randn(4, 8)
        x[0, 0] = float("nan")
        model(x)
    monitor.detach()
    assert monitor.snapshot().value("activation_nan", module="0") == 8
    assert [e.labels for e in monitor.events if e.kind == "nonfinite"] == [{"module": "0"}]


def test_a_final_evaluation_keeps_the_last_training_record_of_a_thinned_log(tmp_path):
    """sinks.jsonl.every 2: the last training flush was held for the close, and detach's
    flush of the final evaluation (the same step) replaced it: the log ended without the last
    step's gradient and step-time statistics."""
    from numwatch.sinks.jsonl import read_jsonl

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "run.jsonl"
    monitor = numwatch.Monitor(
        model, flush_every=1, activations__every=1, activations__training_only=False,
        sinks__console__enabled=False, sinks__jsonl__path=str(log), sinks__jsonl__every=2,
    ).attach(opt)  # fmt: skip
    for _ in range(3):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        monitor.step(loss)
        opt.step()
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 8))
    monitor.detach()
    records = read_jsonl(log)
    assert [r["step"] for r in records] == [1, 2, 2]
    assert any(m["name"] == "grad_norm" for m in records[1]["metrics"])


def test_forwards_under_inference_mode_before_any_step_leave_the_monitor_working(make_monitor):
    """The activation probe merges every 64 forwards inside the forward hook: under the
    user's inference_mode() that made the first tables inference tensors, and every flush of
    the run failed ('Inplace update to inference tensor outside InferenceMode')."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    monitor = make_monitor(model, activations__training_only=False, strict=True).attach()
    for _ in range(2):
        with torch.inference_mode():
            for _ in range(100):
                model(torch.randn(3, 4))
        assert monitor.flush().value("activation_numel", module="0") == 100 * 3 * 8
    monitor.detach()


@pytest.mark.parametrize("flush_every", [1, 5])
def test_nan_gradient_named_at_its_step(make_monitor, flush_every):
    torch.manual_seed(0)
    model = Net()
    seen = []
    monitor = make_monitor(model, flush_every=flush_every).attach()
    monitor.on("nonfinite", seen.append)

    def plant(step):
        if step == 3:
            model.b.weight.grad[2, 1] = float("nan")

    train_steps(model, monitor, 5, plant=plant)
    monitor.detach()
    assert len(seen) == 1 and list(monitor.events) == seen
    event = seen[0]
    assert (event.kind, event.step, event.labels) == ("nonfinite", 3, {"param": "b.weight"})
    assert event.evidence["phase"] == "backward"
    records = read_jsonl(monitor.jsonl_path)
    nan_steps = [
        r["step"]
        for r in records
        for m in r["metrics"]
        if m["name"] == "grad_nonfinite" and m["labels"] == {"param": "b.weight"} and m["value"]
    ]
    assert nan_steps == ([3] if flush_every == 1 else [4])  # the window that holds step 3
    others = [
        m["value"]
        for r in records
        for m in r["metrics"]
        if m["name"] == "grad_nonfinite" and m["labels"] != {"param": "b.weight"}
    ]
    assert sum(others) == 0


class DeclaredBackwards(nn.Module):
    """Parameters registered in the reverse of their use: registration order is not the
    backward order, so only a learned order names the gradient closest to the loss."""

    def __init__(self):
        super().__init__()
        self.last = nn.Linear(8, 1)
        self.first = nn.Linear(4, 8)

    def forward(self, x):
        return self.last(torch.relu(self.first(x)))


def _grad_hooks(model):
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def test_backward_order_is_learned_on_few_steps_and_names_the_first_nonfinite(make_monitor):
    torch.manual_seed(0)
    model = DeclaredBackwards()
    seen = []
    monitor = make_monitor(model, flush_every=5).attach()
    monitor.on("nonfinite", seen.append)
    hooks = []

    def plant(step):
        hooks.append(_grad_hooks(model))
        if step == 7:  # hooks are off: the order learned at step 5 (after the flush) is used
            model.first.weight.grad[0, 0] = float("nan")
            model.last.weight.grad[0, 0] = float("nan")

    train_steps(model, monitor, 9, plant=plant)
    monitor.detach()  # flushes steps 5-8
    # armed on the first step and on the first step after each flush (steps 0 and 5) only
    assert hooks == [4, 0, 0, 0, 0, 4, 0, 0, 0]
    assert [(e.step, e.labels) for e in seen] == [(7, {"param": "last.weight"})]


class Reorderable(nn.Module):
    """Two layers whose order in the forward (and so in the backward) can be swapped."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.swapped = False

    def forward(self, x):
        first, second = (self.b, self.a) if self.swapped else (self.a, self.b)
        return second(torch.relu(first(x)))


def test_a_backward_order_that_changes_is_relearned_and_names_the_first_nonfinite(make_monitor):
    """The order is relearned on the first step after a flush: once the layers swap, the first
    non-finite gradient is the one closest to the loss in the new order."""
    torch.manual_seed(0)
    model = Reorderable()
    seen = []
    monitor = make_monitor(model, flush_every=5).attach()
    monitor.on("nonfinite", seen.append)

    def plant(step):
        if step in (2, 7):  # once in each order
            model.a.weight.grad[0, 0] = float("nan")
            model.b.weight.grad[0, 0] = float("nan")

    def forward_hook(module, args):
        module.swapped = monitor.steps >= 5

    model.register_forward_pre_hook(forward_hook)
    train_steps(model, monitor, 9, plant=plant)
    monitor.detach()
    assert [(e.step, e.labels) for e in seen] == [
        (2, {"param": "b.weight"}),  # b runs last: its gradient is computed first
        (7, {"param": "a.weight"}),
    ]


def test_gradient_norms_over_a_window_longer_than_the_settle_batch(make_monitor):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = make_monitor(model, flush_every=100).attach(opt)
    norms = []
    for _ in range(70):  # more steps than the probe keeps before settling (64)
        loss = model(torch.randn(5, 4)).square().mean()
        loss.backward()
        grads = [p.grad.double() for p in model.parameters()]
        norms.append(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item())
        monitor.step(loss)
        opt.step()
        opt.zero_grad()
    snap = monitor.flush()
    assert snap.value("grad_norm") == pytest.approx(norms[-1], rel=1e-6)
    assert snap.value("grad_norm_max") == pytest.approx(max(norms), rel=1e-6)
    assert max(norms) > 1.01 * norms[-1]  # the maximum is not simply the last step


def test_activation_hooks_exist_only_on_sampled_steps(make_monitor):
    model = nn.Sequential(Emit(torch.ones(3)))
    monitor = make_monitor(model, flush_every=10, activations__every=3).attach()
    armed = []
    for _ in range(7):
        armed.append(len(model[0]._forward_hooks))
        model(None)
        monitor.step()
    assert armed == [1, 0, 0, 1, 0, 0, 1]  # steps 0, 3, 6
    assert monitor.flush().value("activation_numel", module="0") == 9


def test_first_nonfinite_in_forward_order(make_monitor):
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.second = nn.Linear(4, 4)
            self.third = nn.Linear(4, 1)

        def forward(self, x):
            return self.third(self.second(self.first(x)))

    model = Chain()
    monitor = make_monitor(model, flush_every=2, activations__every=1).attach()
    with torch.no_grad():
        model.second.bias[0] = float("inf")  # second's output is the first non-finite tensor
    model(torch.randn(2, 4)).sum().backward()
    monitor.step()
    event = monitor.flush() and monitor.events[-1]
    assert event.labels == {"module": "second"}
    assert event.evidence["phase"] == "forward"
    assert event.step == 0


@pytest.mark.parametrize("close", ["step(loss)", "optimizer"])
def test_first_nonfinite_in_forward_order_outside_the_model_forward(make_monitor, close):
    """Training code that calls submodules (Lightning's training_step): their outputs were
    measured after the loss and the gradients had taken their order numbers, and the NaN
    made in 'second' was named as the loss's or a gradient's."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = make_monitor(model, flush_every=1, activations__every=1).attach(opt)
    with torch.no_grad():
        model[1].bias[0] = float("inf")
    loss = model[2](model[1](model[0](torch.randn(2, 4)))).sum()
    loss.backward()
    if close == "step(loss)":
        monitor.step(loss)
    opt.step()
    (event,) = [e for e in monitor.events if e.kind == "nonfinite"]
    assert (event.labels, event.evidence["phase"], event.step) == ({"module": "1"}, "forward", 0)
    monitor.detach()


def test_nonfinite_loss_event(make_monitor):
    model = nn.Linear(2, 1)
    monitor = make_monitor(model, flush_every=1, gradients__enabled=False).attach()
    monitor.step(torch.tensor(float("nan")))
    assert monitor.events[0].metric == "loss"
    assert math.isnan(monitor.snapshot().value("loss"))


@pytest.mark.parametrize("kind", ["tensor", "float", "mixed"])
def test_loss_max_and_mean_cover_every_step_of_the_window(make_monitor, kind):
    """A spike between two flushes shows in loss_max although the flush's loss (its last step)
    is back to normal; windows longer than a settle batch (64 steps) and the reset after each
    flush included. Exact values: the losses are small integers."""
    model = nn.Linear(2, 1)
    monitor = make_monitor(model, flush_every=100, gradients__enabled=False).attach()
    losses = [3.0] * 100
    losses[70] = 40.0  # after the first settle batch
    for i, value in enumerate(losses):
        as_tensor = kind == "tensor" or (kind == "mixed" and i % 2 == 0)
        monitor.step(torch.tensor(value) if as_tensor else value)
    snap = monitor.snapshot()
    assert snap.value("loss") == 3.0
    assert snap.value("loss_max") == 40.0
    assert snap.value("loss_mean") == (99 * 3.0 + 40.0) / 100
    for _ in range(100):  # the next window has no spike
        monitor.step(torch.tensor(2.0) if kind != "float" else 2.0)
    snap = monitor.snapshot()
    assert (snap.value("loss_max"), snap.value("loss_mean")) == (2.0, 2.0)


def test_loss_max_is_nan_when_a_step_was(make_monitor):
    model = nn.Linear(2, 1)
    monitor = make_monitor(model, flush_every=4, gradients__enabled=False).attach()
    for value in (1.0, float("nan"), 2.0, 1.0):
        monitor.step(torch.tensor(value))
    snap = monitor.snapshot()
    assert snap.value("loss") == 1.0 and math.isnan(snap.value("loss_max"))


def test_no_loss_no_loss_window_metrics(make_monitor):
    model = nn.Linear(2, 1)
    monitor = make_monitor(model, flush_every=1, gradients__enabled=False).attach()
    monitor.step()
    assert monitor.snapshot().get("loss_max") is None


def test_a_flush_whose_steps_recorded_no_loss_has_no_loss(make_monitor):
    """A flush's loss is its last step's: one whose steps recorded none (closed by the optimizer
    hook, or by step() without a loss) reported the loss of an earlier window."""
    model = nn.Linear(2, 1)
    monitor = make_monitor(model, flush_every=2, gradients__enabled=False).attach()
    monitor.step(torch.tensor(1000.0))
    monitor.step(5.0)
    assert monitor.snapshot().value("loss") == 5.0
    monitor.step()
    monitor.step()
    snap = monitor.snapshot()
    assert (snap.step, snap.get("loss"), snap.get("loss_max")) == (3, None, None)


def test_optimizer_pre_hook_closes_each_step_once(make_monitor):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = make_monitor(model, flush_every=100).attach(opt)
    for _ in range(3):  # no explicit step(): the pre-hook closes
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    assert monitor.steps == 3
    for _ in range(2):  # step(loss) before optimizer.step(): the pre-hook stays quiet
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        monitor.step(loss)
        opt.step()
    assert monitor.steps == 5
    for _ in range(2):  # step(loss) after optimizer.step(): only records the loss
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        opt.step()
        monitor.step(loss)
    assert monitor.steps == 7
    assert monitor.flush().value("loss") == pytest.approx(loss.item())


def test_gradient_accumulation_reads_the_accumulated_gradient(make_monitor):
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    monitor = make_monitor(model, flush_every=1).attach()
    for x in (2.0, 3.0):  # two micro-batches: grad = 2 + 3
        model(torch.tensor([[x]])).sum().backward()
    monitor.step()
    assert monitor.snapshot().value("grad_absmax", param="weight") == 5.0


def test_detach_restores_model_exactly(make_monitor):
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(3, 4)
    before_hooks = hook_state(model)
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_out = model(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with make_monitor(model, flush_every=2) as monitor:
        monitor.attach(opt)
        assert monitor.attach() is monitor  # idempotent
        train_steps(model, monitor, 3, opt=opt)
    assert not monitor.attached
    assert hook_state(model) == before_hooks
    assert all(torch.equal(before_state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model(x), before_out)
    assert not opt._optimizer_step_pre_hooks
    assert read_jsonl(monitor.jsonl_path)[-1]["step"] == 2  # the partial window was flushed


def test_detach_without_the_last_flush_writes_nothing_and_restores_the_model(make_monitor):
    """detach(flush=False): for a rank that stops alone in a distributed run, whose last flush
    would be a collective the others never join."""
    torch.manual_seed(0)
    model = Net()
    before_hooks = hook_state(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = make_monitor(model, flush_every=2).attach(opt)
    train_steps(model, monitor, 3, opt=opt)  # step 1 flushed, step 2 pending
    monitor.detach(flush=False)
    assert not monitor.attached
    assert hook_state(model) == before_hooks
    assert not opt._optimizer_step_pre_hooks
    assert [r["step"] for r in read_jsonl(monitor.jsonl_path)] == [1]


def test_an_attach_after_a_detach_without_flush_starts_a_clean_window(make_monitor):
    """The steps a detach(flush=False) dropped are not the next attach's: it carried them (a
    flush after 2 of its 5 steps, their NaN loss reported as its own, in its loss_max)."""
    model = nn.Linear(2, 1)
    monitor = make_monitor(model, flush_every=5, gradients__enabled=False).attach()
    for loss in (torch.tensor(1000.0), float("nan"), torch.tensor(float("nan"))):
        monitor.step(loss)
    monitor.detach(flush=False)
    monitor.attach()
    monitor.step(torch.tensor(1.0))
    monitor.step(torch.tensor(2.0))
    assert read_jsonl(monitor.jsonl_path) == []  # 2 steps of 5: no flush yet
    monitor.detach()
    (record,) = read_jsonl(monitor.jsonl_path)
    metrics = {m["name"]: m["value"] for m in record["metrics"]}
    assert (record["step"], metrics["loss_max"], metrics["loss_mean"]) == (4, 2.0, 1.5)
    assert record["events"] == []


def test_a_deferred_detach_without_flush_does_not_flush(make_monitor):
    """detach(flush=False) asked by a step-level callback waits for the step close, and then
    flushed the step anyway."""
    model = Net()
    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = make_monitor(model, flush_every=10, rules=rules).attach(opt)
    monitor.on("nonfinite", lambda e: monitor.detach(flush=False))
    loss = model(torch.randn(2, 4)).sum() * float("nan")
    loss.backward()
    monitor.step(loss)
    assert not monitor.attached
    records = read_jsonl(monitor.jsonl_path)  # the step's events, in a record of their own
    kinds = [(r["metrics"], [e["kind"] for e in r["events"]]) for r in records]
    assert kinds == [([], ["nonfinite", "action"])]  # no flush record


def test_probe_failure_is_counted_and_survived(make_monitor, monkeypatch, caplog):
    from numwatch.kernels import tensor_stats

    def boom(*a, **k):
        raise RuntimeError("planted probe failure")

    torch.manual_seed(0)
    model = Net()
    monitor = make_monitor(model, flush_every=2, activations__every=1).attach()
    monkeypatch.setattr(tensor_stats, "tensor_stats", boom)
    train_steps(model, monitor, 4)
    snap = monitor.snapshot()
    assert snap.step == 3
    assert snap.value("monitor_errors_total", component="gradients") == 4
    assert snap.value("monitor_errors_total", component="activations") == 4  # once a forward
    assert (
        sum(
            "planted probe failure" in r.getMessage() or r.exc_info is not None
            for r in caplog.records
        )
        == 2
    )  # one traceback per component, logged once


def test_strict_mode_reraises(make_monitor, monkeypatch):
    from numwatch.kernels import tensor_stats

    monkeypatch.setattr(tensor_stats, "tensor_stats", lambda *a, **k: 1 / 0)
    model = Net()
    monitor = make_monitor(model, strict=True, activations__enabled=False).attach()
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(ZeroDivisionError):
        monitor.step()


def test_failing_sink_and_callback_do_not_break_training(make_monitor):
    model = Net()
    monitor = make_monitor(model, flush_every=1).attach()

    class BadSink:
        name = "bad"

        def emit(self, snapshot, events):
            raise OSError("disk full")

        def close(self):
            pass

    monitor._sinks.append(BadSink())
    monitor.on("*", lambda e: 1 / 0)

    def plant(step):
        model.a.weight.grad[0, 0] = float("nan")

    train_steps(model, monitor, 2, plant=plant)
    assert monitor.errors["sinks"] == 2
    assert monitor.errors["callbacks"] == 2


def test_failures_after_the_last_flush_are_reported_at_detach(make_monitor, caplog):
    """A callback failing on the last flush's events was counted where no flush record went."""
    from numwatch.sinks.jsonl import read_jsonl

    model = Net()
    monitor = make_monitor(model, flush_every=1).attach()
    calls = []

    def fails_on_second(event):
        calls.append(event.step)
        if len(calls) > 1:
            raise RuntimeError("webhook down")

    monitor.on("nonfinite", fails_on_second)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        model.a.weight.grad[0, 0] = float("nan")
        monitor.step()
        model.zero_grad()
    monitor.detach()
    assert len(calls) == 2 and monitor.errors["callbacks"] == 1
    last = read_jsonl(monitor.config.sinks.jsonl.path)[-1]
    counted = {m["labels"]["component"]: m["value"] for m in last["metrics"]
               if m["name"] == "monitor_errors_total"}  # fmt: skip
    assert counted["callbacks"] == 0
    warned = [r.getMessage() for r in caplog.records if "reach no flush record" in r.getMessage()]
    assert warned == [
        "numwatch: 1 failure(s) after the last flush reach no flush record (Monitor.errors "
        "counts them): callbacks 1x, latest RuntimeError: webhook down"
    ]


def test_models_without_trainable_parameters_or_attention(make_monitor):
    frozen = Net().requires_grad_(False)
    monitor = make_monitor(frozen, flush_every=1, activations__every=1).attach()
    frozen(torch.randn(2, 4))
    monitor.step()
    snap = monitor.snapshot()
    assert snap.series("grad_absmax") == []
    assert len(snap.series("activation_absmax")) == 3

    partly = Net()
    partly.a.requires_grad_(False)
    monitor = make_monitor(partly, flush_every=1).attach()
    train_steps(partly, monitor, 1)
    params = {r.labels["param"] for r in monitor.snapshot().series("grad_absmax")}
    assert params == {"b.weight", "b.bias", "c.weight", "c.bias"}


def test_a_model_with_uninitialized_lazy_modules_is_refused_with_the_fix(make_monitor):
    """attach() read the shapes of nn.LazyLinear's uninitialized parameters: a torch ValueError
    from inside the weight probe. After one forward the same model attaches."""
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(2))
    hooks = dict(model._forward_pre_hooks)
    with pytest.raises(NumwatchConfigError, match=r"lazy parameters \(0.weight.*one forward"):
        make_monitor(model).attach()
    assert dict(model._forward_pre_hooks) == hooks
    model(torch.randn(3, 5))
    monitor = make_monitor(model).attach()
    model(torch.randn(3, 5)).sum().backward()
    monitor.step()
    assert monitor.flush().value("grad_numel", param="2.weight") == 16
    monitor.detach()


def test_meta_device_model_is_skipped_not_broken(make_monitor):
    with torch.device("meta"):
        model = Net()
    monitor = make_monitor(model, flush_every=1, activations__every=1).attach()
    model(torch.randn(2, 4, device="meta"))
    monitor.step()
    assert monitor.snapshot().series("activation_absmax") == []
    assert monitor.errors == {}


def test_bad_inputs_get_clear_errors(make_monitor):
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        numwatch.Monitor(object())
    monitor = make_monitor(Net())
    with pytest.raises(numwatch.NumwatchError, match="attach"):
        monitor.step()
    monitor.attach()
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        monitor.attach(optimizer="sgd")
    with pytest.raises(ValueError, match="unknown event kind"):
        monitor.on("nan", print)
    with pytest.raises(ValueError, match="scalar loss"):
        make_monitor(Net(), strict=True).attach().step(torch.ones(3))


def test_a_loss_that_is_not_a_scalar_is_refused_and_never_stops_the_probes(make_monitor):
    """Per-sample losses were caught by the step's guard: one logged error, then every step
    closed without its probes (no gradient statistics, no skip_step) for the whole run."""
    model = Net()
    monitor = make_monitor(model, flush_every=1).attach()
    model(torch.randn(5, 4)).sum().backward()
    with pytest.raises(ValueError, match=r"scalar loss, got shape \(5,\)"):
        monitor.step(torch.ones(5))
    with pytest.raises(TypeError, match="tensor or a number, got str"):
        monitor.step("0.5")
    monitor.step(torch.tensor([0.5]))  # one element: a loss
    assert monitor.snapshot().value("loss") == 0.5
    assert monitor.snapshot().get("grad_absmax", param="a.weight") is not None
    # an optimizer closure's loss is the closure's to return: counted, the step still measured
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor.attach(opt)

    def closure():
        out = model(torch.randn(5, 4))
        out.sum().backward()
        return out.squeeze(1)  # per-sample

    opt.step(closure)
    assert monitor.errors == {"step": 1}
    assert monitor.snapshot().step == 1
    assert monitor.snapshot().get("grad_absmax", param="a.weight") is not None
    monitor.detach()


def test_a_nan_made_by_the_loss_is_named_as_such_when_the_loss_comes_late(make_monitor):
    """With step(loss) after optimizer.step(), the step closed first and its gradients took
    the earlier order numbers: a NaN born in the loss function was blamed on a gradient."""
    torch.manual_seed(0)
    found = {}
    for late in (False, True):
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        monitor = make_monitor(model, flush_every=3).attach(opt)
        for i in range(3):
            out = model(torch.randn(3, 4))
            loss = out.sum() + (torch.sqrt(-out.abs().sum() - 1) if i == 2 else 0)
            loss.backward()
            if not late:
                monitor.step(loss)
            opt.step()
            if late:
                monitor.step(loss)
            opt.zero_grad()
        monitor.detach()
        found[late] = [e.message for e in monitor.events if e.kind == "nonfinite"]
    assert found[False] == found[True] == ["NaN/Inf first seen in the loss (loss) at step 2"]


@pytest.mark.parametrize("failure", ["optimizer", "unwritable path"])
def test_an_attach_that_fails_leaves_nothing_behind(make_monitor, failure):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = hook_state(model)
    kw, arg = {}, opt
    if failure == "optimizer":
        arg = object()  # e.g. a wrapper that is not a torch.optim.Optimizer
    else:
        kw["sinks__jsonl__path"] = "/proc/numwatch-nowhere/run.jsonl"
    monitor = make_monitor(model, **kw)
    error = TypeError if failure == "optimizer" else numwatch.NumwatchConfigError
    with pytest.raises(error, match=r"Optimizer|nowhere"):
        monitor.attach(arg)
    assert not monitor.attached
    assert hook_state(model) == before
    assert not opt._optimizer_step_pre_hooks and "step" not in opt.__dict__


def test_per_rank_logs_need_the_rank_in_their_path(make_monitor, monkeypatch, tmp_path):
    """Without {rank}, the ranks of a per-rank log appended to one file, interleaved."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    one_file = str(tmp_path / "run.jsonl")
    monitor = make_monitor(Net(), sinks__jsonl__path=one_file, distributed__jsonl="per_rank")
    with pytest.raises(numwatch.NumwatchConfigError, match=r"has no \{rank\}"):
        monitor.attach()
    assert not monitor.attached
    per_rank = str(tmp_path / "run.rank{rank}.jsonl")
    make_monitor(Net(), sinks__jsonl__path=per_rank, distributed__jsonl="per_rank").attach()
    make_monitor(Net(), sinks__jsonl__path=one_file).attach()  # rank 0 writes it alone


def test_one_optimizer_per_monitor(make_monitor):
    model = Net()
    opt, other = (torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(2))
    monitor = make_monitor(model).attach(opt)
    hooks = len(opt._optimizer_step_pre_hooks)
    assert hooks > 0
    assert monitor.attach(opt) is monitor  # the same one again: nothing to do
    with pytest.raises(numwatch.NumwatchError, match="another optimizer"):
        monitor.attach(other)
    assert len(opt._optimizer_step_pre_hooks) == hooks and not other._optimizer_step_pre_hooks
    monitor.detach()
    monitor.attach(other)  # after a detach, another optimizer is fine
    assert len(other._optimizer_step_pre_hooks) == hooks and not opt._optimizer_step_pre_hooks
    monitor.detach()


def test_a_halt_at_detach_still_detaches(make_monitor):
    model = Net()
    before = hook_state(model)
    halt = {"type": "threshold", "name": "big", "metric": "loss", "threshold": 10.0}
    rules = {"defaults": False, "add": [{**halt, "actions": ["halt"]}]}
    monitor = make_monitor(model, flush_every=50, rules=rules).attach()
    for loss in (1.0, 100.0):
        monitor.step(loss)
    with pytest.raises(NumwatchHalt):
        monitor.detach()  # its final flush sees loss 100 and halts
    assert not monitor.attached
    assert hook_state(model) == before


def test_a_first_step_closed_in_inference_mode_does_not_stop_monitoring(make_monitor):
    """An evaluation pass first: state the monitor makes lazily must not be inference tensors,
    which later in-place updates outside inference mode cannot touch."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = make_monitor(model, flush_every=2, activations__every=1).attach(opt)
    with torch.inference_mode():
        monitor.step(model(torch.randn(5, 4)).square().mean())
    train_steps(model, monitor, 5, opt=opt)
    assert not any(monitor.errors.values()), monitor.errors
    assert [s.step for s in monitor.history] == [1, 3, 5]
    assert monitor.snapshot().value("grad_numel", param="a.weight") == 2 * 32  # 2 steps


def test_a_nonfinite_float_loss_is_named_like_a_tensor_one(make_monitor):
    model = nn.Linear(2, 1)
    monitor = make_monitor(model, flush_every=1).attach()
    model(torch.ones(1, 2)).sum().mul(float("nan")).backward()  # NaN gradients too
    monitor.step(float("nan"))  # e.g. loss.item(): the loss came first, it is the origin
    nonfinite = [e for e in monitor.events if e.kind == "nonfinite"]
    assert [(e.metric, e.step) for e in nonfinite] == [("loss", 0)]
    assert "in the loss" in nonfinite[0].message


@pytest.mark.parametrize("action", [False, True])
@pytest.mark.parametrize("make_opt", ["sgd", "lbfgs"])
def test_step_with_a_closure_measures_the_gradients_the_closure_made(
    make_monitor, make_opt, action
):
    """Closed by the step pre-hook, or (an optimizer action) by numwatch's step wrapper."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    if make_opt == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.LBFGS(model.parameters(), max_iter=3)  # 3+ closure calls per step
    skip = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]}
    monitor = make_monitor(model, flush_every=1, rules=skip if action else {}).attach(opt)
    assert (monitor.optimizer_control is not None) == action
    first_grads, losses, calls = [], [], []

    def closure():
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        if not calls:  # the first call of this step
            first_grads.append(model.bias.grad.abs().max().item())
            losses.append(loss.item())
        calls.append(1)
        return loss

    for _ in range(3):
        calls.clear()
        opt.step(closure)
        assert len(calls) >= (1 if make_opt == "sgd" else 2)
    monitor.detach()
    assert [s.value("grad_absmax", param="bias") for s in monitor.history] == first_grads
    assert [s.value("loss") for s in monitor.history] == pytest.approx(losses)


def test_gradient_statistics_follow_parameters_unfrozen_and_frozen_after_attach(make_monitor):
    """Gradual unfreezing: a parameter unfrozen after attach never got gradient statistics (a
    warning told to attach again), and one frozen after it kept reporting its stale gradient.
    The selection follows, as the weight probe's does, from the first step of a flush window."""
    model = nn.ModuleDict({name: nn.Linear(4, 1) for name in "abc"})
    model["a"].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = make_monitor(model, flush_every=2).attach(opt)
    for step in range(6):
        if step == 3:  # in the window of steps 2-3: left out from step 4
            model["b"].requires_grad_(False)  # its gradient stays, zeroed, not cleared
        if step == 4:  # after step 3's flush: measured from this step on
            model["a"].requires_grad_(True)
        x = torch.full((2, 4), step + 1.0)
        sum(layer(x).sum() for layer in model.values()).backward()  # d/dW = 2 (step + 1)
        opt.step()
        opt.zero_grad(set_to_none=False)
    monitor.detach()
    absmax = [
        {
            r.labels["param"]: r.value
            for r in s.series("grad_absmax")
            if r.labels["param"] != "c.bias"
        }
        for s in monitor.history
    ]
    assert absmax == [
        {"b.weight": 4.0, "b.bias": 2.0, "c.weight": 4.0},
        {"b.weight": 6.0, "b.bias": 2.0, "c.weight": 8.0},  # b: step 3's stale zeros, here only
        {"a.weight": 12.0, "a.bias": 2.0, "c.weight": 12.0},
    ]


def test_parameters_frozen_after_attach_keep_the_monitor_running(make_monitor):
    """Gradual freezing: a watched parameter frozen mid-run refuses a gradient hook. Flushes
    went on failing from then on (no snapshots), and detach() left the hooks made before the
    failure on the model."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    before = hook_state(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = make_monitor(model, flush_every=2).attach(opt)
    for step in range(8):
        if step == 3:
            model[2].weight.requires_grad_(False)
        model(torch.randn(4, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert monitor.snapshot().step == 7 and not any(monitor.errors.values())
    assert [s.step for s in monitor.history] == [1, 3, 5, 7]
    monitor.detach()
    assert hook_state(model) == before


def test_disabled_monitor_adds_nothing(make_monitor):
    model = Net()
    before = hook_state(model)
    monitor = make_monitor(model, enabled=False).attach()
    assert hook_state(model) == before
    train_steps(model, monitor, 2)
    assert monitor.flush() is None


def test_jsonl_schema(make_monitor):
    torch.manual_seed(0)
    model = Net()
    monitor = make_monitor(model, flush_every=2, run_name="t").attach()

    def plant(step):
        if step == 1:
            model.c.bias.grad[0] = float("-inf")

    train_steps(model, monitor, 4, plant=plant)
    monitor.detach()
    with open(monitor.jsonl_path) as f:
        lines = f.read().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert set(first) == {"schema", "run", "step", "time", "rank", "monitor", "metrics", "events"}
    assert (first["schema"], first["run"], first["step"], first["rank"]) == (1, "t", 1, 0)
    assert first["monitor"] == monitor.monitor_id and len(monitor.monitor_id) == 8
    assert first["events"][0]["kind"] == "nonfinite"
    assert first["events"][0]["labels"] == {"param": "c.bias"}
    norm = [m for m in first["metrics"] if m["name"] == "grad_norm"]
    assert norm == [{"name": "grad_norm", "labels": {}, "value": "nan"}]  # JSON has no NaN
    assert all(set(m) == {"name", "labels", "value"} for m in first["metrics"])


def test_console_plain_lines_when_not_a_terminal():
    from rich.console import Console

    buf = io.StringIO()
    sink = ConsoleSink(every=2, console=Console(file=buf, force_terminal=False, width=300))
    snap = numwatch.Snapshot(
        7,
        [numwatch.MetricRecord("loss", {}, 1.5), numwatch.MetricRecord("grad_norm", {}, 0.25)],
        time=0.0,
    )
    sink.emit(snap, [])
    assert buf.getvalue() == ""  # every=2: the first flush prints nothing
    sink.emit(snap, [])
    line = buf.getvalue()
    assert line.startswith("numwatch step 7 | loss 1.5 | grad_norm 0.25")
    assert "\x1b[" not in line and "[bold" not in line


def test_console_shows_module_names_as_they_are():
    """A name ending in a backslash (an nn.ModuleDict key) printed with it doubled; one holding
    brackets must not be read as markup."""
    from rich.console import Console

    buf = io.StringIO()
    sink = ConsoleSink(console=Console(file=buf, force_terminal=False, width=300))
    R = numwatch.MetricRecord
    snap = numwatch.Snapshot(
        1,
        [R("activation_absmax", {"module": "d.C:\\"}, 3.0),
         R("grad_absmax", {"param": "d.[x].weight"}, 2.0)],
        time=0.0,
    )  # fmt: skip
    sink.emit(snap, [])
    line = buf.getvalue()
    assert "(d.C:\\)" in line and "(d.C:\\\\)" not in line
    assert "(d.[x].weight)" in line


def test_snapshot_lookups_by_metric_name():
    R = numwatch.MetricRecord
    records = [
        R("grad_absmax", {"param": "a"}, 1.0),
        R("grad_min", {"param": "a"}, -1.0),
        R("grad_absmax", {"param": "b"}, 2.0),
        R("loss", {}, 0.5),
        R("grad_min", {"param": "b"}, -3.0),
        R("attn_max_logit", {"layer": "h.0", "head": "1"}, 7.0),
    ]
    snap = numwatch.Snapshot(3, records, time=0.0)
    assert snap.series("grad_min") == [records[1], records[4]]  # in record order
    assert snap.series("nothing") == []
    assert snap.names() == ["attn_max_logit", "grad_absmax", "grad_min", "loss"]
    assert snap.value("grad_absmax", param="b") == 2.0
    assert snap.value("attn_max_logit", head="1", layer="h.0") == 7.0  # label order is free
    assert snap.get("loss") == 0.5 and snap.get("grad_absmax", param="c") is None
    assert snap.get("grad_absmax", -1.0) == -1.0  # no label-less series of that name
    with pytest.raises(KeyError, match="series of 'grad_min' include"):
        snap.value("grad_min", param="z")
    with pytest.raises(KeyError, match="no metric named 'gard_min'"):
        snap.value("gard_min")


SYNC_CALLS = {
    "item",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "tolist",
    "cpu",
    "numpy",
    "nonzero",
    "masked_select",
    "unique",
    "__array__",
}


class SyncCounter(TorchFunctionMode):
    """Counts tensor calls that would wait for a GPU, on any device.

    The result of ``.cpu()`` is host data; everything computed from host data alone is host
    data too (tracked by taint), and reading it later is no sync.
    """

    def __init__(self):
        super().__init__()
        self.calls = []
        # ids of host tensors, which are kept alive so that an id is never reused (a WeakSet
        # would compare tensors with == on a hash collision)
        self.host: set[int] = set()
        self._alive: list[torch.Tensor] = []

    def _tensors(self, obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                yield from self._tensors(o)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = list(self._tensors(list(args) + list(kwargs.values())))
        from_host = bool(inputs) and all(id(t) in self.host for t in inputs)
        to_cpu = name == "to" and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device")))
        if (name in SYNC_CALLS or to_cpu) and not from_host:
            self.calls.append(name)
        out = func(*args, **kwargs)
        if name == "cpu" or from_host:
            for t in self._tensors(out if isinstance(out, (list, tuple)) else [out]):
                self.host.add(id(t))
                self._alive.append(t)
        return out


@pytest.mark.parametrize("set_to_none", [True, False])
def test_an_evaluation_forward_before_a_late_step_call_opens_no_step(make_monitor, set_to_none):
    """optimizer.step(), then a no_grad forward (validation, logging), then step(loss): the call
    only records the loss, as without the forward. It closed an extra, empty step."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = make_monitor(model, flush_every=100).attach(opt)
    for _ in range(4):
        loss = model(torch.randn(5, 4)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        with torch.no_grad():
            model(torch.randn(5, 4))
        monitor.step(loss)
    assert monitor.steps == 4
    snap = monitor.flush()
    assert snap.value("grad_numel", param="a.weight") == 4 * 32  # 4 steps of the 4x8 weight
    assert snap.value("loss") == pytest.approx(loss.item())


@pytest.mark.parametrize("late", [False, True])
def test_a_model_trained_in_eval_mode_closes_every_step(make_monitor, late):
    """model.eval() for training (no dropout), with the optimizer attached and the loss given on
    some iterations, before or after optimizer.step(): every update is a step. A session 24
    change that took eval-mode forwards with grad on for validation left half of them unclosed
    (reverted; such a validation forward before a late step(loss) opens a step: README)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.ReLU(), nn.Linear(8, 1)).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = make_monitor(model, flush_every=1).attach(opt)
    for it in range(4):
        loss = model(torch.randn(8, 4)).square().mean()
        loss.backward()
        if it % 2 == 0 and not late:
            monitor.step(loss)
        opt.step()
        opt.zero_grad()
        if it % 2 == 0 and late:
            monitor.step(loss)
    assert monitor.steps == 4
    # (late: step 3's flush waits for a late loss that does not come; the next close runs it)
    assert [s.step for s in monitor.history] == ([0, 1, 2] if late else [0, 1, 2, 3])


def test_a_loss_recorded_after_the_update_is_in_its_own_steps_flush(make_monitor):
    """step(loss) after optimizer.step(): each flush held the previous step's loss, so a spike
    was judged (and labelled) one flush late."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rules = {"defaults": False, "add": [{"type": "threshold", "name": "big", "metric": "loss",
                                         "threshold": 100.0}]}  # fmt: skip
    monitor = make_monitor(model, flush_every=2, rules=rules).attach(opt)
    losses = []
    for step in range(8):
        loss = model(torch.randn(5, 4)).square().mean() * (1e4 if step == 5 else 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.step(loss)
        losses.append(loss.item())
    assert [s.step for s in monitor.history] == [1, 3, 5, 7]
    assert [s.value("loss") for s in monitor.history] == pytest.approx(losses[1::2])
    assert [(e.rule, e.step) for e in monitor.events] == [("big", 5)]
    # a loop that stops bringing the loss late: the waiting flush runs at the next close
    model(torch.randn(5, 4)).square().mean().backward()
    opt.step()  # closes step 8 (no flush due)
    model(torch.randn(5, 4)).square().mean().backward()
    opt.step()  # step 9: its flush waits for a late loss
    assert monitor.history[-1].step == 7
    model(torch.randn(5, 4)).square().mean().backward()
    opt.step()  # none came: it runs before step 10 closes
    assert monitor.history[-1].step == 9


def test_a_flush_between_the_update_and_a_late_loss_is_not_doubled(make_monitor, tmp_path):
    """flush() between optimizer.step() and a late step(loss): the late call flushed that step
    again (two records, the second one judged by replay only); a detach with a flush waiting
    left it armed, and the next attach wrote an empty record of the same step."""
    from numwatch.config import RulesConfig
    from numwatch.replay import replay

    rule = {"type": "threshold", "name": "big", "metric": "loss_max", "threshold": 100.0}
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    path = tmp_path / "run.jsonl"
    monitor = make_monitor(
        model, flush_every=1, rules={"add": [rule]}, sinks__jsonl__enabled=True,
        sinks__jsonl__path=str(path),
    ).attach(opt)  # fmt: skip

    def iteration(i, late=True):
        loss = model(torch.randn(2, 4)).square().mean() * 0 + (1000.0 if i == 3 else 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i == 3:
            monitor.flush()
        if late:
            monitor.step(loss)

    for i in range(5):
        iteration(i)
    iteration(5, late=False)  # its flush waits for a loss that does not come
    monitor.detach()
    monitor.attach(opt)
    iteration(6)
    monitor.detach()
    records = read_jsonl(path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]
    live = [(e.rule, e.step) for e in monitor.events]
    assert live == [("big", 4)]  # the spike, in loss_max of the next flush
    assert [(e.rule, e.step) for e in replay(records, RulesConfig(add=[rule]))] == live


def test_a_missed_late_loss_flushes_before_the_next_forward_records(make_monitor):
    """A flush waiting for a late loss that did not come ran at the next optimizer.step(), after
    the next step's forward: it reported that step's sampled activations as its own."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = make_monitor(model, flush_every=1, activations__every=3).attach(opt)
    for i in range(8):
        loss = model(torch.randn(2, 4)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i % 2 == 0:
            monitor.step(loss)
    monitor.detach()
    sampled = [s.step for s in monitor.history if s.get("activation_numel", module="a")]
    assert sampled == [0, 3, 6]


def test_the_attention_of_a_forward_opened_by_hand_is_kept_across_the_step_close(make_monitor):
    """begin_forward() ... optimizer.step() ... end_forward(): the step close dropped the
    forward's sampled attention calls."""
    import torch.nn.functional as F

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            q = self.proj(x).view(1, 2, -1, 4)
            return F.scaled_dot_product_attention(q, q, q)

    model = nn.Sequential(Attn())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = make_monitor(model, flush_every=1, attention__every=1).attach(opt)
    for _ in range(2):
        monitor.begin_forward()
        model[0](torch.randn(6, 8)).sum().backward()  # a submodule, not model.forward
        opt.step()
        monitor.end_forward()
        assert monitor.snapshot().value("attn_calls", layer="0") == 1
    monitor.detach()


def test_a_monitored_model_copies_and_pickles_as_an_unmonitored_one(make_monitor):
    """An EMA copy (deepcopy) or torch.save(model) while attached: the hooks' copies are inert,
    where bound methods dragged the monitor along (its open JSONL file failed to pickle)."""
    from numwatch.hooks import InertHook

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = make_monitor(model, flush_every=2, activations__every=1).attach(opt)
    train_steps(model, monitor, 1, opt=opt)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies = [copy.deepcopy(model), torch.load(buf, weights_only=False)]
    x = torch.randn(3, 4)
    for other in copies:
        hooks = [
            h
            for m in other.modules()
            for d in (m._forward_pre_hooks, m._forward_hooks)
            for h in d.values()
        ]
        assert hooks and all(isinstance(h, InertHook) for h in hooks)
        assert torch.equal(other(x), model(x))
    monitor.detach()
    assert all(torch.equal(other(x), model(x)) for other in copies)


def test_hooks_and_steps_do_no_host_sync(make_monitor):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # The device-agnostic torch path: the CPU path of tensor_stats reads values back on purpose
    # (on a CPU that waits for nothing); GPUs run the Triton kernel (test below).
    monitor = make_monitor(
        model, flush_every=4, activations__every=1, kernel_backend="torch"
    ).attach(opt)
    train_steps(model, monitor, 1, opt=opt)  # first step builds tables and index caches
    with SyncCounter() as counter:
        for _ in range(2):  # steps 1 and 2: no flush
            loss = model(torch.randn(5, 4)).square().mean()
            loss.backward()
            monitor.step(loss)
            opt.step()
            opt.zero_grad()
    assert counter.calls == []
    with SyncCounter() as counter:
        monitor.step()  # step 3 closes the window: exactly one device read
    assert counter.calls == ["cpu"]


@requires_gpu
def test_host_never_waits_fails_on_a_wait_and_passes_without_one():
    x = torch.arange(8.0, device="cuda")
    (x * 2).sum()  # a kernel's first launch loads its module (lazily), which may wait
    with host_never_waits():
        y = (x * 2).sum()  # issued, not waited for
    assert y.item() == 56.0
    with pytest.raises(AssertionError, match="the host waited"), host_never_waits():
        (x * 2).sum().item()
    with pytest.raises(AssertionError, match="the host waited"), host_never_waits():
        torch.cuda.synchronize()


@requires_gpu
def test_no_host_sync_between_flushes_on_gpu(make_monitor):
    """CUDA's own sync detector, then a stream held busy: any sync inside the window fails."""
    from examples_gpt2 import tiny_gpt_on_cuda

    model, opt, x, y = tiny_gpt_on_cuda()
    monitor = make_monitor(
        model, flush_every=6, activations__every=1, attention__every=1, weights__every=1
    ).attach(opt)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        monitor.step(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # step 0: builds tables, index caches and kernel plans (one-time transfers)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()  # steps 1 and 2: every probe runs, nothing flushes
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with host_never_waits():  # also the waits inside the driver, which the mode above misses
        step()
        step()  # steps 3 and 4, the same
    step()  # step 5 flushes
    snap = monitor.snapshot()
    assert snap.step == 5
    assert snap.series("attn_max_logit") and snap.series("weight_spectral_norm")


@requires_gpu
def test_new_gradient_and_module_layouts_do_not_sync_on_gpu(make_monitor):
    """A mixture-of-experts step (one expert sits out: its gradients are None, its module does
    not run) builds new index plans; their tables travel without a host sync."""

    class TwoExperts(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(16, 16)
            self.experts = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])

        def forward(self, x, use):
            h = self.inp(x)
            return sum(self.experts[i](h) for i in use)

    torch.manual_seed(0)
    model = TwoExperts().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = {"flush_every": 8, "activations__every": 1, "optimizer__every": 1}
    monitor = make_monitor(model, **cfg).attach(opt)
    x = torch.randn(4, 16, device="cuda")

    def step(use):
        loss = model(x, use).square().mean()
        loss.backward()
        monitor.step(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step((0, 1))  # both experts: kernels compiled, tables for the full layout
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step((0,))
        step((1,))  # two layouts never seen before
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monitor.flush()
    assert monitor.snapshot().series("grad_absmax")


def test_module_called_twice_and_several_outputs_merge_into_one_row(make_monitor):
    shared = Emit((torch.tensor([1.0, -3.0]), torch.tensor([float("nan"), 0.5, 2.0])))

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = shared
            self.last = Emit(torch.tensor([7.0]))

        def forward(self, x):
            self.shared(x)
            self.last(x)
            return self.shared(x)  # the same module again, after another one

    model = Twice()
    monitor = make_monitor(model, flush_every=1, activations__every=1).attach()
    model(None)
    monitor.step()
    snap = monitor.snapshot()
    assert snap.value("activation_numel", module="shared") == 10  # 2 calls x (2 + 3) elements
    assert snap.value("activation_nan", module="shared") == 2
    assert snap.value("activation_absmax", module="shared") == 3.0
    assert snap.value("activation_min", module="shared") == -3.0
    assert snap.value("activation_max", module="shared") == 2.0
    assert snap.value("activation_numel", module="last") == 1
    assert monitor.events[0].labels == {"module": "shared"}


def test_held_activation_outputs_are_bounded(make_monitor, monkeypatch):
    from numwatch.kernels import tensor_stats

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.parts = nn.ModuleList(Emit(torch.full((64,), float(i))) for i in range(4))

        def forward(self, x):
            return [part(x) for part in self.parts]

    batches = []
    real = tensor_stats.tensor_stats

    def spy(tensors, *args, **kwargs):
        batches.append(len(tensors))
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr(tensor_stats, "tensor_stats", spy)
    model = Chain()
    # 256 B per output and a 300 B budget: measured early, two outputs at a time
    monitor = make_monitor(
        model, flush_every=1, activations__every=1, activations__max_pending_bytes=300
    ).attach()
    model(None)
    monitor.step()
    assert batches == [2, 2]  # no output was left for the end of the forward
    snap = monitor.snapshot()
    assert [snap.value("activation_max", module=f"parts.{i}") for i in range(4)] == [0, 1, 2, 3]


def test_flushes_leave_no_tracked_records_and_restore_the_collector(make_monitor):
    """Retained snapshots are columns, not thousands of GC-tracked record tuples; the flush's
    pause of the cyclic collector ends with it and keeps a user's disabled collector off."""
    import gc

    from numwatch.snapshot import MetricRecord

    model = Net()
    monitor = make_monitor(model, flush_every=1).attach()
    gc.collect()
    before = sum(type(o) is MetricRecord for o in gc.get_objects())
    train_steps(model, monitor, 3)
    gc.collect()
    assert sum(type(o) is MetricRecord for o in gc.get_objects()) == before
    assert len(monitor.history) == 3 and gc.isenabled()
    snap = monitor.snapshot()
    names, labels, values = snap.columns()
    assert len(names) == len(labels) == len(values) == len(snap) > 40
    first = next(iter(snap))
    assert isinstance(first, MetricRecord) and first == (names[0], labels[0], values[0])
    assert snap.value("grad_numel", param="a.weight") == 32.0
    gc.disable()
    try:
        train_steps(model, monitor, 1)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_jsonl_writes_every_float_exactly_and_non_finite_as_strings(tmp_path):
    """The sink encodes a flush's numbers in one json.dumps: each must read back bitwise
    (repr's shortest round trip), ints as floats, and NaN/Inf as the log's strings."""
    from numwatch.sinks.jsonl import JsonlSink
    from numwatch.snapshot import MetricRecord, Snapshot

    values = [0.1, 3, -0.0, 1e-300, 5e-324, 1.7976931348623157e308, math.nan, math.inf, -math.inf]
    records = [MetricRecord("m", {"i": str(i)}, v) for i, v in enumerate(values)]
    sink = JsonlSink(tmp_path / "log.jsonl", "run")
    sink.emit(Snapshot(7, records, time=1.0), [])
    sink.emit(Snapshot(8, [], time=2.0), [])
    sink.close()
    line = (tmp_path / "log.jsonl").read_text().splitlines()[0]
    assert '"value": 3.0}' in line and '"value": "nan"}' in line and '"value": "-inf"}' in line
    first, empty = read_jsonl(tmp_path / "log.jsonl")
    got = [m["value"] for m in first["metrics"]]
    assert [m["labels"]["i"] for m in first["metrics"]] == [str(i) for i in range(len(values))]
    assert math.isnan(got[6]) and got[7:] == [math.inf, -math.inf]
    for g, v in zip(got[:6], values[:6], strict=True):
        assert g == v and math.copysign(1.0, g) == math.copysign(1.0, v) and type(g) is float
    assert empty["step"] == 8 and empty["metrics"] == []


def test_jsonl_reuses_a_flushs_layout_only_while_the_series_are_the_same(tmp_path):
    """Finite flushes format their numbers into the last flush's text: the values must read
    back bitwise, a '%' in a label must survive, and changed series (one more, or a label dict
    changed in place) must be written as they are now."""
    from numwatch.sinks.jsonl import JsonlSink
    from numwatch.snapshot import MetricRecord, Snapshot

    labels = [{"p": "a%sb"}, {"p": "100%"}, {"p": "c"}]
    sink = JsonlSink(tmp_path / "log.jsonl", "run")
    flushes = [[0.1, -0.0, 5e-324], [1e300, 3.0, -2.5], [7.0, 8.0, 9.0], [1.0, 2.0, 3.0, 4.0]]
    for step, values in enumerate(flushes):
        if step == 2:
            labels[2]["p"] = "changed"  # in place: the cached layout must not be reused
        if step == 3:
            labels.append({"p": "new"})
        records = [MetricRecord("m", lab, v) for lab, v in zip(labels, values, strict=True)]
        sink.emit(Snapshot(step, records, time=1.0), [])
    sink.close()
    log = read_jsonl(tmp_path / "log.jsonl")
    for record, values in zip(log, flushes, strict=True):
        got = [m["value"] for m in record["metrics"]]
        assert got == values and [math.copysign(1.0, g) for g in got] == [
            math.copysign(1.0, v) for v in values
        ]
    assert [m["labels"]["p"] for m in log[1]["metrics"]] == ["a%sb", "100%", "c"]
    assert [m["labels"]["p"] for m in log[2]["metrics"]] == ["a%sb", "100%", "changed"]
    assert [m["labels"]["p"] for m in log[3]["metrics"]] == ["a%sb", "100%", "changed", "new"]


def test_jsonl_finite_values_whose_sum_overflows_stay_numbers(tmp_path):
    """The non-finite check sums the flush's values: an overflowing sum of finite values must
    still write numbers."""
    from numwatch.sinks.jsonl import JsonlSink
    from numwatch.snapshot import MetricRecord, Snapshot

    big = 1.7976931348623157e308
    records = [MetricRecord("m", {"i": str(i)}, v) for i, v in enumerate([big, big, -1.5])]
    sink = JsonlSink(tmp_path / "log.jsonl", "run")
    sink.emit(Snapshot(1, records, time=1.0), [])
    sink.close()
    assert '"value": "' not in (tmp_path / "log.jsonl").read_text()
    (record,) = read_jsonl(tmp_path / "log.jsonl")
    assert [m["value"] for m in record["metrics"]] == [big, big, -1.5]


def test_jsonl_every_and_exclude_trim_the_log_but_keep_events_and_the_end(tmp_path):
    """every=3: flushes 3 and 6 are written, flush 2 for its event, and flush 7 (the last) at
    close; exclude drops exactly the matching metric names."""
    from numwatch.events import Event
    from numwatch.sinks.jsonl import JsonlSink
    from numwatch.snapshot import MetricRecord, Snapshot

    sink = JsonlSink(tmp_path / "log.jsonl", "run", every=3, exclude=["grad_m*", "loss"])
    names = ["grad_min", "grad_max", "grad_rms", "loss", "attn_rows"]
    for step in range(1, 8):
        records = [MetricRecord(n, {"p": "w"}, float(step)) for n in names]
        events = [Event("precursor", step, "planted")] if step == 2 else []
        sink.emit(Snapshot(step, records, time=float(step)), events)
    sink.close()
    log = read_jsonl(tmp_path / "log.jsonl")
    assert [r["step"] for r in log] == [2, 3, 6, 7]
    assert [len(r["events"]) for r in log] == [1, 0, 0, 0]
    for r in log:
        assert [m["name"] for m in r["metrics"]] == ["grad_rms", "attn_rows"]
        assert [m["value"] for m in r["metrics"]] == [float(r["step"])] * 2
    with pytest.raises(ValueError, match="every"):
        JsonlSink(tmp_path / "x.jsonl", "run", every=0)


def test_jsonl_options_reach_the_sink_from_the_config(tmp_path):
    model = nn.Linear(4, 4)
    path = tmp_path / "run.jsonl"
    monitor = numwatch.Monitor(
        model,
        flush_every=1,
        sinks__console__enabled=False,
        sinks__jsonl__path=str(path),
        sinks__jsonl__every=2,
        sinks__jsonl__exclude=["grad_*"],
    ).attach()
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        monitor.step()
    monitor.detach()
    log = read_jsonl(path)
    assert [r["step"] for r in log] == [1, 2]  # flush 2, then the last (flush 3) at detach
    assert all(not m["name"].startswith("grad_") for r in log for m in r["metrics"])
    assert {m["name"] for m in log[0]["metrics"]} >= {"step_seconds", "monitor_overhead_seconds"}


LOSS_ABOVE_0 = {
    "defaults": False,
    "add": [{"type": "threshold", "name": "lossy", "metric": "loss", "threshold": 0.0}],
}


def test_a_callback_that_flushes_gets_the_running_flush(make_monitor, caplog):
    """flush() inside a flush does nothing: no recursion, no second (empty) record or event."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = make_monitor(model, flush_every=2, rules=LOSS_ABOVE_0)
    returned = []
    monitor.on("*", lambda e: returned.append(monitor.flush())).attach(opt)
    with caplog.at_level("INFO", logger="numwatch"):
        train_steps(model, monitor, 4, opt=opt)
    monitor.detach()
    assert [(e.kind, e.step) for e in monitor.events] == [("precursor", 1), ("precursor", 3)]
    assert returned == monitor.history  # each nested call: the snapshot of its running flush
    assert all(s.get("grad_norm") is not None for s in monitor.history)
    records = read_jsonl(monitor.jsonl_path)
    assert [(r["step"], len(r["events"])) for r in records] == [(1, 1), (3, 1)]
    assert not any(monitor.errors.values()), monitor.errors
    told = [r for r in caplog.records if "during a flush does nothing" in r.getMessage()]
    assert len(told) == 1


def precursor_every_step(make_monitor):
    """A linear model, its SGD, and a monitor attached to it whose rule fires at every flush
    (every step), in the optimizer's step pre-hook."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rules = {"defaults": False, "add": [{"type": "threshold", "name": "any_grad",
                                         "metric": "grad_norm", "threshold": 0.0}]}  # fmt: skip
    monitor = make_monitor(model, flush_every=1, optimizer__every=1, rules=rules)
    return model, opt, monitor.attach(opt)


def test_a_callback_that_detaches_in_the_optimizer_hook_keeps_the_update(make_monitor):
    """A step closed by the optimizer's step pre-hook, whose flush runs a callback that
    detaches: removing numwatch's pre-hooks while torch iterated them made a pre-hook added
    after attach raise "OrderedDict mutated during iteration", and the update was lost. The
    update runs, and every hook numwatch added is gone after the step."""
    model, opt, monitor = precursor_every_step(make_monitor)
    later = opt.register_step_pre_hook(lambda *_: None)
    monitor.on("precursor", lambda _event: monitor.detach())
    model(torch.ones(2, 4)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    assert not monitor.attached
    assert not torch.equal(model.weight, before)
    assert list(opt._optimizer_step_pre_hooks) == [later.id]
    assert not opt._optimizer_step_post_hooks
    opt.step()  # and the next step runs with the user's hook alone


def test_a_step_interrupted_after_a_detach_in_its_pre_hook_leaves_a_reattach_working(
    make_monitor,
):
    """The step that deferred the removal of numwatch's pre-hooks never reached its post-hooks
    (a Ctrl-C in a later pre-hook): its clean-up post-hook stayed, and after a re-attach it
    removed itself while torch iterated the post-hooks, failing every later step."""
    model, opt, monitor = precursor_every_step(make_monitor)
    once = [True]
    monitor.on("precursor", lambda _event: once[0] and monitor.detach())

    def ctrl_c(*_):
        if once[0]:
            once[0] = False
            raise KeyboardInterrupt

    user = opt.register_step_pre_hook(ctrl_c)
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert not monitor.attached
    monitor.attach(opt)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        before = model.weight.detach().clone()
        opt.step()
        assert not torch.equal(model.weight, before)
    monitor.detach()
    assert list(opt._optimizer_step_pre_hooks) == [user.id]
    assert not opt._optimizer_step_post_hooks


def test_a_callback_that_detaches_waits_for_the_end_of_the_flush(make_monitor):
    torch.manual_seed(0)
    model = Net()
    before_hooks = hook_state(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = make_monitor(model, flush_every=2, rules=LOSS_ABOVE_0)
    monitor.on("precursor", lambda e: monitor.detach()).attach(opt)
    for _ in range(4):
        loss = model(torch.randn(5, 4)).square().mean()
        loss.backward()
        if monitor.attached:
            monitor.step(loss)
        opt.step()
        opt.zero_grad()
    assert not monitor.attached
    assert hook_state(model) == before_hooks and not opt._optimizer_step_pre_hooks
    assert [(e.kind, e.step) for e in monitor.events] == [("precursor", 1)]
    assert not any(monitor.errors.values()), monitor.errors
    records = read_jsonl(monitor.jsonl_path)  # the flush finished before the sinks closed
    assert [(r["step"], len(r["events"])) for r in records] == [(1, 1)]
    assert monitor.snapshot().get("grad_norm") is not None


def test_events_keep_the_most_recent_within_their_bound(make_monitor):
    """A rule firing every flush grew Monitor.events without bound over a long run."""
    rules = {"add": [{"type": "threshold", "name": "always", "metric": "grad_absmax",
                      "op": ">", "threshold": 0.0}]}  # fmt: skip
    model = Net()
    monitor = make_monitor(model, flush_every=1, events_kept=5, rules=rules).attach()
    train_steps(model, monitor, 4)
    assert len(monitor.events) == 5
    assert [e.step for e in monitor.events][-1] == 3 and monitor.events[0].step >= 2
    counts = monitor.snapshot().value("events_total", kind="precursor", rule="always")
    assert counts == 4 * 6  # every flush, each of the 6 parameters: all counted


def test_overhead_is_a_share_of_the_step_time_that_includes_the_flushes(make_monitor):
    """step_seconds left each flush's own time out while monitor_overhead_seconds counted it
    (the previous flush): with short steps and frequent flushes the console printed overheads
    of 118-173 % of the step time, and the steps' times did not add up to the wall time."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = make_monitor(model, flush_every=1).attach(opt)
    steps, overheads = [], []
    start = time.perf_counter()
    for _ in range(40):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        snap = monitor.snapshot()
        steps.append(snap.value("step_seconds"))
        overheads.append(snap.value("monitor_overhead_seconds"))
    wall = time.perf_counter() - start
    monitor.detach()
    assert all(o <= s for o, s in zip(overheads, steps, strict=True)), (overheads, steps)
    assert sum(steps) >= 0.8 * wall, (sum(steps), wall)  # the flushes are in the step times


def test_a_re_attach_does_not_charge_the_last_detach_to_its_first_window(tmp_path, monkeypatch):
    """The first window after a re-attach counted detach's final flush as overhead while its
    step time started at attach: 1030 % of the step time."""
    from numwatch.sinks.jsonl import JsonlSink

    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = numwatch.Monitor(
        model, flush_every=5, sinks__console__enabled=False,
        sinks__jsonl__path=str(tmp_path / "log.jsonl"),
    )  # fmt: skip
    slow, emit = [False], JsonlSink.emit

    def slow_emit(self, snapshot, events):
        if slow[0]:
            time.sleep(0.3)
        return emit(self, snapshot, events)

    monkeypatch.setattr(JsonlSink, "emit", slow_emit)

    def steps(n):
        for _ in range(n):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()

    monitor.attach(opt)
    steps(3)
    slow[0] = True
    monitor.detach()
    slow[0] = False
    monitor.attach(opt)
    steps(5)
    snap = monitor.snapshot()
    monitor.detach()
    assert snap.value("monitor_overhead_seconds") <= snap.value("step_seconds")


def test_headroom_of_a_module_whose_outputs_mix_dtypes():
    """An fp16 output with fp32 attention weights (eager Llama attention under autocast): the
    merged absmax was divided by the last tensor's dtype's range, so an fp16 output at 92 % of
    its range read 1.8e-34 (no overflow risk), and an fp32 value of 1e5 next to an fp16
    tensor read 1.53 (past overflow)."""

    class Mixed(nn.Module):
        def __init__(self, order):
            super().__init__()
            self.order = order

        def forward(self, x):
            big16, small32 = (x * 60000.0).half(), torch.softmax(x.float(), -1)
            big32, small16 = x.float() * 1e5, x.half()
            return (big16, small32) if self.order == "fp16 first" else (big32, small16)

    model = nn.Sequential(nn.Identity())
    model.missed, model.false_alarm = Mixed("fp16 first"), Mixed("fp32 first")

    def forward(x):
        return sum(t.float().sum() for t in (*model.missed(x), *model.false_alarm(x)))

    monitor = numwatch.Monitor(
        model, flush_every=1, activations__every=1, sinks__console__enabled=False,
        sinks__jsonl__enabled=False,
    ).attach()  # fmt: skip
    monitor.begin_forward()
    forward(torch.tensor([[1.0, -0.5, 0.25, 0.1]]))
    monitor.end_forward()
    monitor.step()
    snap = monitor.snapshot()
    monitor.detach()
    assert snap.value("activation_headroom", module="missed") == pytest.approx(60000 / 65504)
    assert snap.value("activation_headroom", module="false_alarm") == pytest.approx(1 / 65504)
    assert [e.labels for e in monitor.events if e.rule == "activation_overflow_risk"] == [
        {"module": "missed"}
    ]
