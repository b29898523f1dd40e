"""Optimizer probe: update/weight ratios, absorbed updates and the loss scale, planted exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import numwatch


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


def test_large_models_are_measured_in_rotation_within_the_byte_budget():
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(4)])  # 256 B each
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = monitor_for(model, opt, optimizer__max_bytes=600)  # two weights per update
    copies = []
    real_clone = torch.Tensor.clone
    weights = {p.data_ptr() for p in model.parameters()}

    def counting_clone(t, *a, **k):  # copies of parameters only
        if t.data_ptr() in weights:
            copies.append(t.numel() * t.element_size())
        return real_clone(t, *a, **k)

    torch.Tensor.clone = counting_clone
    try:
        for _ in range(2):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
            assert sum(copies) <= 600
            copies.clear()
    finally:
        torch.Tensor.clone = real_clone
    snap = monitor.flush()
    ratios = [snap.get("optimizer_update_ratio", param=f"{i}.weight") for i in range(4)]
    assert all(r is not None and r > 0 for r in ratios)  # all four after two updates
