"""Optimizer probe: update/weight ratios, absorbed updates and the loss scale, planted exactly."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import OwnStepSize
from torch import nn

import numwatch
from numwatch.errors import NumwatchError


def monitor_for(model, opt, **kw):
    kw.setdefault("sinks__console__enabled", False)
    kw.setdefault("sinks__jsonl__enabled", False)
    kw.setdefault("flush_every", 1)
    kw.setdefault("optimizer__every", 1)
    scaler = kw.pop("scaler", None)
    return numwatch.Monitor(model, **kw).attach(opt, scaler=scaler)


def test_update_ratio_of_plain_sgd():
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 0.0, 4.0, 0.0]]))  # ||w|| = 5
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(model, opt)
    model.weight.grad = torch.tensor([[1.0, 2.0, 2.0, 0.0]])  # ||g|| = 3
    opt.step()
    snap = monitor.flush()  # the update happens after its step's flush: read it now
    w_after = torch.tensor([3.0, 0.0, 4.0, 0.0]) - 0.1 * torch.tensor([1.0, 2.0, 2.0, 0.0])
    want = 0.3 / w_after.norm().item()
    assert snap.value("optimizer_update_ratio", param="weight") == pytest.approx(want, rel=1e-6)
    assert snap.value("optimizer_absorbed_fraction", param="weight") == 0.0
    assert snap.value("optimizer_lr", group="0") == 0.1


def test_a_parameter_outside_the_model_takes_the_name_given_to_the_optimizer():
    """A trained temperature that is no module parameter, passed to the optimizer by name: it
    was labelled group0.2, though torch keeps the name in the group's param_names."""
    model = nn.Linear(2, 1)
    temperature = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([*model.named_parameters(), ("temperature", temperature)], lr=0.1)
    monitor = monitor_for(model, opt)
    (model(torch.ones(1, 2)) * temperature).sum().backward()
    opt.step()
    params = {r.labels["param"] for r in monitor.flush().series("optimizer_update_ratio")}
    assert params == {"weight", "bias", "temperature"}
    monitor.detach()
    # a trained module outside the model whose names are the model's: no label taken twice
    aux = nn.Linear(2, 1)
    opt = torch.optim.SGD([*model.named_parameters(), *aux.named_parameters()], lr=0.1)
    monitor = monitor_for(model, opt)
    (model(torch.ones(1, 2)) + aux(torch.ones(1, 2))).sum().backward()
    opt.step()
    params = [r.labels["param"] for r in monitor.flush().series("optimizer_update_ratio")]
    assert sorted(params) == ["bias", "group0.2", "group0.3", "weight"]


def test_a_param_group_added_after_attach_is_measured_from_its_first_sampled_update():
    """add_param_group after attach (a head trained from a later stage): its parameters were
    never measured, silently, while optimizer_lr reported the group."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    extra = nn.Parameter(torch.ones(()))  # outside the model
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    monitor = monitor_for(model, opt)

    def update():
        opt.zero_grad()
        (model(torch.ones(2, 4)).sum() * extra).backward()
        opt.step()
        return {r.labels["param"] for r in monitor.flush().series("optimizer_update_ratio")}

    assert update() == {"0.weight", "0.bias"}
    opt.add_param_group({"params": list(model[1].parameters()), "lr": 0.01})
    opt.add_param_group({"params": [extra], "lr": 0.01})
    assert update() == {"0.weight", "0.bias", "1.weight", "1.bias", "group2.0"}
    # a group the optimizer no longer holds: its parameters go, the others are measured on
    del opt.param_groups[1]
    assert update() == {"0.weight", "0.bias", "group1.0"}
    # a module added to the model after attach, then to the optimizer: its model path
    model.append(nn.Linear(1, 1))
    opt.add_param_group({"params": list(model[2].parameters())})
    assert update() >= {"2.weight", "2.bias"}
    monitor.detach()


def test_absorbed_updates_of_bf16_weights():
    model = nn.Linear(8, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)  # bf16 ULP at 1.0 is 2^-7: half an ULP is 0.0039
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = monitor_for(model, opt)
    grad = torch.tensor([[1.0, 1.0, 1.0, 1.0, 10.0, 10.0, 10.0, 0.0]], dtype=torch.bfloat16)
    model.weight.grad = grad  # updates 0.001 (absorbed) x4, 0.01 (applied) x3, none x1
    opt.step()
    snap = monitor.flush()
    assert snap.value("optimizer_absorbed_fraction", param="weight") == pytest.approx(4 / 7)


def test_loss_scale_and_its_drops():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = monitor_for(model, opt, scaler=scaler)
    for step in range(3):
        loss = model(torch.ones(1, 2)).sum()
        scaler.scale(loss).backward()
        if step == 1:
            model.weight.grad[0, 0] = float("inf")  # overflow: the scaler skips and halves
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    snap = monitor.flush()
    assert snap.value("loss_scale") == 512.0
    assert snap.value("loss_scale_drops_total") == 1


def test_a_scaler_given_to_a_later_attach_is_taken():
    """attach(opt), then attach(opt, scaler=...) once AMP is set up: the scaler was ignored (no
    loss scale, its overflow a critical nonfinite event). Another scaler is refused."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = monitor_for(model, opt)
    monitor.attach(opt, scaler=scaler)
    for step in range(3):
        loss = model(torch.ones(1, 2)).sum()
        scaler.scale(loss).backward()
        if step == 1:
            model.weight.grad[0, 0] = float("inf")
        monitor.step(loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    events = [(e.kind, e.severity, e.rule, e.step) for e in monitor.events]
    assert events == [("anomaly", "info", "scaler_overflow", 1)]
    assert [s.value("loss_scale") for s in monitor.history] == [1024, 1024, 512]
    with pytest.raises(NumwatchError, match="another GradScaler"):
        monitor.attach(opt, scaler=torch.amp.GradScaler("cpu"))
    monitor.detach()


def test_every_drop_of_a_run_of_overflows_is_counted():
    """Overflow steps never reach optimizer.step(): reading the scale there saw a run of three
    halvings as one drop and reported no scale at the flushes in between."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = monitor_for(model, opt, scaler=scaler)
    for step in range(6):
        loss = model(torch.ones(1, 2)).sum()
        scaler.scale(loss).backward()
        if step in (1, 2, 3):
            model.weight.grad[0, 0] = float("inf")
        monitor.step(loss)  # README: with a GradScaler, close the step yourself
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert [s.value("loss_scale") for s in monitor.history] == [1024, 1024, 512, 256, 128, 128]
    assert [s.value("loss_scale_drops_total") for s in monitor.history] == [0, 0, 1, 2, 3, 3]


def test_loss_scale_drops_go_on_across_a_reattach():
    """A counter never goes back: a re-attach began the drops at 0 again."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = monitor_for(model, opt, scaler=scaler)
    drops = []
    for step in range(4):
        if step == 2:
            monitor.detach()
            monitor.attach(opt, scaler=scaler)
        loss = model(torch.ones(1, 2)).sum()
        scaler.scale(loss).backward()
        if step in (0, 2):
            model.weight.grad[0, 0] = float("inf")
        monitor.step(loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        drops.append(monitor.snapshot().value("loss_scale_drops_total"))
    assert drops == [0, 1, 1, 2]


def test_in_rotation_a_parameter_is_reported_by_the_flush_after_its_sample_only():
    """One weight per sample (max_bytes): every flush re-reported the weights measured earlier,
    so one measurement satisfied for_flushes=3."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(3)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(model, opt, optimizer__max_bytes=16 * 16 * 4)
    reported = []
    for _ in range(6):
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        snap = monitor.snapshot()
        reported.append([r.labels["param"] for r in snap.series("optimizer_update_ratio")])
    # flush i (at step i's close, before its update) reports the update of step i - 1
    assert reported == [[], ["0.weight"], ["1.weight"], ["2.weight"], ["0.weight"], ["1.weight"]]


def test_large_models_are_measured_in_rotation_within_the_byte_budget():
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(4)])  # 256 B each
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(model, opt, optimizer__max_bytes=600)  # two weights per update
    (probe,) = (p for p in monitor._probes if p.component == "optimizer")
    copied = []  # bytes of the parameter copies each update kept
    keep_before = probe._keep_before

    def counting_keep_before():
        keep_before()
        copied.append(sum(t.numel() * t.element_size() for t in probe._before or []))

    probe._keep_before = counting_keep_before
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    assert copied == [512, 512]
    monitor.flush()
    reported = {
        r.labels["param"]: r.value
        for snap in monitor.history
        for r in snap.series("optimizer_update_ratio")
    }  # each flush reports the weights sampled since the one before
    assert sorted(reported) == [f"{i}.weight" for i in range(4)]  # all four after two updates
    assert all(r > 0 for r in reported.values())


@pytest.mark.parametrize(
    "placement",
    [
        "cpu",
        pytest.param(
            "split",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
        ),
        pytest.param(
            "two_gpus",
            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
        ),
    ],
)
def test_update_sums_match_a_float64_oracle(placement):
    """Per-parameter sums of a mixed update: weight decay moves weights without a gradient,
    some gradients are zero, and a bf16 weight absorbs small updates; exact counts, the ratio
    against float64. ``split``: the first layer on the GPU, the second on the CPU (a model
    split over devices, as with offloading); ``two_gpus``: on two GPUs (``device_map``); one
    statistics call per device."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4).to(torch.bfloat16))
    if placement != "cpu":
        model[0].to("cuda:0")
    if placement == "two_gpus":
        model[1].to("cuda:1")
    with torch.no_grad():  # Adam's first steps are ~lr: absorbed at 4.0 (half an ULP 2^-6)
        model[1].weight[:, :4] = 4.0
        model[1].weight[:, 4:] = 0.1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    monitor = monitor_for(model, opt)
    for p in model.parameters():
        g = torch.randn_like(p)
        g[..., ::3] = 0  # no gradient for every third column
        p.grad = g
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    snap = monitor.flush()
    fractions = {}
    for name, p in model.named_parameters():
        u = (p.detach() - before[name]).double()
        want = (u.square().sum() / p.detach().double().square().sum()).sqrt().item()
        got = snap.value("optimizer_update_ratio", param=name)
        assert got == pytest.approx(want, rel=1e-5), name
        moved = p.grad != 0
        changed = moved & (u != 0)
        absorbed = (moved.sum() - changed.sum()).item() / moved.sum().item()
        assert snap.value("optimizer_absorbed_fraction", param=name) == pytest.approx(absorbed)
        fractions[name] = absorbed
    assert fractions["0.weight"] == 0 and 0.3 < fractions["1.weight"] < 0.7
    assert not any(monitor.errors.values())


class ComplexAndReal(nn.Module):
    def __init__(self):
        super().__init__()
        # 2**24 in float32: half an ULP below it is 0.5, so an update of 0.2 is absorbed
        self.w = nn.Parameter(torch.tensor([3 + 4j, 2.0**24], dtype=torch.complex64))
        self.lin = nn.Linear(2, 1, bias=False)


def test_complex_parameter_is_measured_through_its_real_view():
    """Norms of a complex tensor are its real view's; each real and imaginary part counts as an
    element of the absorbed fraction. A real parameter beside it keeps its ratio."""
    model = ComplexAndReal()
    with torch.no_grad():
        model.lin.weight.copy_(torch.tensor([[3.0, 4.0]]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(model, opt)
    # parts with a gradient: 1, 2 (first value), 2 (second, real): the last update is absorbed
    model.w.grad = torch.tensor([1 + 2j, 2 + 0j], dtype=torch.complex64)
    model.lin.weight.grad = torch.tensor([[1.0, 2.0]])
    opt.step()  # w: [2.9 + 3.8j, 2**24]
    snap = monitor.flush()
    want = math.sqrt((0.1**2 + 0.2**2) / (2.9**2 + 3.8**2 + 2.0**48))
    assert snap.value("optimizer_update_ratio", param="w") == pytest.approx(want, rel=1e-5)
    assert snap.value("optimizer_absorbed_fraction", param="w") == pytest.approx(1 / 3)
    w_after = torch.tensor([3.0, 4.0]) - 0.1 * torch.tensor([1.0, 2.0])
    want = math.sqrt(0.05) / w_after.norm().item()
    assert snap.value("optimizer_update_ratio", param="lin.weight") == pytest.approx(want, rel=1e-6)
    assert not any(monitor.errors.values())


@pytest.mark.parametrize("after_step", ["free", "zero"])
def test_an_optimizer_that_frees_or_zeroes_gradients_in_its_step_is_measured(after_step):
    """p.grad = None (freeing memory as soon as it is applied) or p.grad.zero_() inside step():
    the measurement after the step read the gradient then, and failed on every sampled step or
    counted a fully absorbed update as no update at all."""

    class FreeingSGD(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            loss = super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    if after_step == "free":
                        p.grad = None
                    else:
                        p.grad.zero_()
            return loss

    model = nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)  # lr * g = 1e-3, under half an ulp of 1.0 in bf16: absorbed
    opt = FreeingSGD(model.parameters(), lr=1e-3)
    monitor = monitor_for(model, opt)
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()
    snap = monitor.flush()
    assert snap.value("monitor_errors_total", component="optimizer") == 0
    assert snap.value("optimizer_absorbed_fraction", param="weight") == 1.0
    assert snap.value("optimizer_update_ratio", param="weight") == 0.0


@pytest.mark.parametrize("as_keyword", [False, True])
def test_a_step_with_a_closure_is_measured_on_its_own_gradients(as_keyword):
    """optimizer.step(closure) makes the gradients inside step(): the pre-hook took the
    previous step's gradient signs (none at the first step, which went unmeasured)."""
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 0.0, 4.0, 0.0]]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(model, opt)
    grads = [torch.tensor([[1.0, 2.0, 2.0, 0.0]]), torch.tensor([[0.0, 0.0, 1.0, 0.0]])]
    ratios, absorbed = [], []
    for g in grads:
        before = model.weight.detach().clone()

        def closure(g=g):
            model.weight.grad = g.clone()
            return torch.tensor(0.0)

        opt.step(closure=closure) if as_keyword else opt.step(closure)
        snap = monitor.flush()
        after = model.weight.detach()
        ratios.append(snap.value("optimizer_update_ratio", param="weight"))
        want = ((after - before).norm() / after.norm()).item()
        assert ratios[-1] == pytest.approx(want, rel=1e-6)
        # the elements with a gradient this step all moved: nothing absorbed
        absorbed.append(snap.value("optimizer_absorbed_fraction", param="weight"))
    assert absorbed == [0.0, 0.0]


def test_a_nan_gradient_makes_the_fractions_nan_not_negative():
    """sign(NaN) is 0 and the NaN update counted as a change: the absorbed fraction read -numel
    (-128 for an 8x16 weight) for the rest of a run with a NaN."""
    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(model, opt)
    model(torch.randn(4, 16)).sum().backward()
    model.weight.grad[0, 0] = float("nan")
    opt.step()
    snap = monitor.flush()
    assert math.isnan(snap.value("optimizer_absorbed_fraction", param="weight"))
    assert math.isnan(snap.value("optimizer_update_ratio", param="weight"))
    assert snap.value("optimizer_absorbed_fraction", param="bias") == 0.0


@pytest.mark.parametrize("fused", [False, True])
def test_an_overflow_step_of_a_fused_optimizer_is_no_update(fused):
    """GradScaler calls a fused optimizer's step() on an overflow step too, handing it found_inf
    (the kernel leaves the weights as they are): that step read as an update wholly absorbed,
    ratio 0 and absorbed fraction 1, where a non-fused optimizer's reported nothing."""
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 0.0, 4.0, 0.0]]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0, growth_interval=10**6)
    monitor = monitor_for(model, opt, scaler=scaler, flush_every=100)

    def update(grad):
        model.weight.grad = scaler.scale(torch.tensor([grad]))
        scaler.step(opt)
        scaler.update()

    update([1.0, 2.0, 2.0, 0.0])
    update([math.inf, 1.0, 1.0, 1.0])  # overflow: no update
    snap = monitor.flush()  # the window's latest update: the first
    w_after = torch.tensor([3.0, 0.0, 4.0, 0.0]) - 0.1 * torch.tensor([1.0, 2.0, 2.0, 0.0])
    want = 0.3 / w_after.norm().item()
    assert snap.value("optimizer_update_ratio", param="weight") == pytest.approx(want, rel=1e-6)
    assert snap.value("optimizer_absorbed_fraction", param="weight") == 0.0
    assert torch.equal(model.weight.detach(), w_after[None])
    update([math.inf, 1.0, 1.0, 1.0])
    assert monitor.flush().series("optimizer_update_ratio") == []  # no update since


def test_a_group_whose_lr_is_none_has_no_optimizer_lr_and_keeps_its_update_ratios():
    """float(None) of an Adafactor(lr=None) group failed every flush, losing every optimizer
    record with it."""
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 0.0, 4.0, 0.0]]))
    scale = nn.Parameter(torch.tensor([2.0]))  # outside the model
    opt = OwnStepSize([model.weight], size=0.1)
    opt.add_param_group({"params": [scale], "lr": 0.5})
    monitor = monitor_for(model, opt)
    model.weight.grad = torch.tensor([[1.0, 2.0, 2.0, 0.0]])  # ||g|| = 3
    scale.grad = torch.tensor([1.0])
    opt.step()
    snap = monitor.flush()
    assert monitor.errors == {}
    assert [(r.labels, r.value) for r in snap.series("optimizer_lr")] == [({"group": "1"}, 0.5)]
    w_after = torch.tensor([3.0, 0.0, 4.0, 0.0]) - 0.1 * torch.tensor([1.0, 2.0, 2.0, 0.0])
    want = 0.3 / w_after.norm().item()
    assert snap.value("optimizer_update_ratio", param="weight") == pytest.approx(want, rel=1e-6)
    assert snap.value("optimizer_update_ratio", param="group1.0") == pytest.approx(0.5 / 1.5)
