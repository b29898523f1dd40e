"""Distributed: global statistics, the first non-finite's rank, rank-consistent mitigation.

Two gloo processes are spawned once for the whole file; they run every scenario in one process
group (DDP, then FSDP2 ``fully_shard`` on the CPU) and save what they saw (snapshots, events,
the raw tensors the probes read, parameters); the tests compare that with float64 oracles
computed here on the concatenation of both ranks' data. The packing itself is also checked
in-process against ``combine_stats`` with two simulated ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import io
import math
import os
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import numwatch
from numwatch.config import DistributedConfig
from numwatch.distributed import (
    MAX,
    REPLICA,
    SHARD,
    MatrixBlock,
    ShardedPowerIteration,
    _Plan,
    element_ops,
)
from numwatch.errors import NumwatchConfigError
from numwatch.kernels import tensor_stats as ts
from numwatch.sinks.jsonl import read_jsonl
from numwatch.testing import hook_state

WORLD = 2
D, HEADS, T = 16, 2, 8


# ------------------------------------------------------------------------------ model
class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_head = HEADS  # so that the weight probe finds each head's W_Q, W_K rows
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.plant = False  # two identical sink keys: every row's maximum is repeated
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, C = x.shape
        q, k, v = (
            t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in self.qkv(x).split(C, dim=2)
        )
        if self.plant:
            sink = q.mean(2, keepdim=True)
            sink = sink / sink.norm(dim=-1, keepdim=True) * 50
            k = torch.cat([sink, sink, k[:, :, 2:]], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        self.seen = [t.detach().clone() for t in (q, k, v, y)]
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Attn()
        self.b = Attn()
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.b(self.a(x))))


def batch(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(3, T, D, generator=gen)


# ------------------------------------------------------------------------------ workers
def _monitor(model: nn.Module, out: Path, name: str, **kw) -> numwatch.Monitor:
    kw.setdefault("sinks__console__enabled", False)
    kw.setdefault("sinks__jsonl__path", str(out / f"{name}.rank{{rank}}.jsonl"))
    kw.setdefault("flush_every", 1)
    kw.setdefault("activations__every", 1)
    kw.setdefault("attention__every", 1)
    kw.setdefault("attention__batch", 0)
    kw.setdefault("rules__defaults", False)
    return numwatch.Monitor(model, **kw)


def _events(monitor: numwatch.Monitor) -> list[dict]:
    return [{k: v for k, v in e.to_dict().items() if k != "time"} for e in monitor.events]


def _capture(model: nn.Module) -> dict[str, torch.Tensor]:
    """Forward outputs of every submodule of the last forward (what the activation probe saw)."""
    seen: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if name:
            m.register_forward_hook(lambda _m, _i, o, name=name: seen.__setitem__(name, o.detach()))
    return seen


def _skip_rules() -> dict:
    return {
        "defaults": False,
        "add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}],
    }


def scenario_ddp_stats(rank: int, out: Path) -> dict:
    """DDP, per-rank JSONL: global values vs. the concatenated data, local values per rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Net()
    net.b.plant = rank == 1
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    monitor = _monitor(net, out, "ddp_stats", distributed__jsonl="per_rank").attach(opt)
    acts = _capture(net)
    loss = ddp(batch(rank, 0)).square().mean()
    loss.backward()
    monitor.step(loss)
    res = {
        "acts": dict(acts),
        "attn": {layer: getattr(net, layer).seen for layer in ("a", "b")},
        "grads": {n: p.grad.clone() for n, p in net.named_parameters()},
        "loss": loss.item(),
        "snapshot": monitor.snapshot().to_dict(),
    }
    opt.step()
    monitor.detach()
    res["jsonl"] = monitor.jsonl_path
    return res


def scenario_probe_fails(rank: int, out: Path) -> dict:
    """DDP: rank 1's activation probe fails at its 2nd flush. The flush goes on without that
    probe's tensors on rank 1, and the aggregation's layout agreement keeps the ranks in step
    (the other rank died in a mismatched collective before)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    monitor = _monitor(net, out, "probe_fails").attach(opt)
    probe = next(p for p in monitor._probes if p.component == "activations")
    real, calls = probe.device_tensors, []

    def failing():
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            raise RuntimeError("planted")
        return real()

    probe.device_tensors = failing
    for step in range(4):
        ddp(batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    monitor.detach()
    return {
        "errors": {k: v for k, v in monitor.errors.items() if v},
        "steps": [snap.step for snap in monitor.history],
        "absmax": [snap.get("activation_absmax", module="a") for snap in monitor.history],
    }


def scenario_layer_on_one_rank(rank: int, out: Path) -> dict:
    """DDP: layer b runs on rank 1 only (a data-dependent branch). Its aggregated statistics
    reach rank 0's tables; rank 0 records them too (it had no attn_* record of b, so a rule on
    them acted on rank 1 only and the replicas forked)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Branch(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.head(torch.relu(self.b(h) if rank == 1 else h))

    torch.manual_seed(0)
    net = Branch()
    ddp = DDP(net, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    monitor = _monitor(net, out, "layer_on_one_rank").attach(opt)
    ddp(batch(rank, 0)).square().mean().backward()
    opt.step()
    snap = monitor.snapshot()
    monitor.detach()
    return {
        "errors": {k: v for k, v in monitor.errors.items() if v},
        "max_logit_b": [snap.get("attn_max_logit", layer="b", head=str(h)) for h in range(HEADS)],
        "calls_b": snap.get("attn_calls", layer="b"),
        "acts": sorted({r.labels["module"] for r in snap.series("activation_absmax")}),
    }


def scenario_config_mismatch(rank: int, out: Path) -> dict:
    """Rank 1 flushes every 3 steps, rank 0 every 2: their flushes' collectives would meet DDP's
    gradient all-reduce and gloo would abort the process; attach() refuses on both ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = Net()
    ddp = DDP(net)
    before = hook_state(net)
    monitor = _monitor(net, out, "config_mismatch", flush_every=2 + rank)
    error = ""
    try:
        monitor.attach()
    except NumwatchConfigError as e:
        error = str(e)
    ddp(batch(rank, 0)).sum().backward()  # the ranks are still in step
    return {"error": error, "attached": monitor.attached, "hooks_kept": hook_state(net) == before}


def scenario_rule_mismatch(rank: int, out: Path) -> dict:
    """A step-level rule of one name but another threshold on rank 1 (and a gradient selection
    of its own): one rank would skip an update the other applies, and the DDP replicas part
    silently. attach() refuses on both ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = Net()
    ddp = DDP(net)
    rule = {"type": "threshold", "name": "big_grad", "metric": "grad_norm",
            "threshold": 1e-3 if rank == 0 else 1e9, "actions": ["skip_step"]}  # fmt: skip
    errors = []
    backoff = {"type": "threshold", "name": "hi_loss", "metric": "loss", "threshold": -1.0,
               "actions": ["lr_backoff"]}  # fmt: skip
    for kw in ({"rules": {"defaults": False, "add": [rule]}},
               {"gradients__exclude": ["head.bias"] if rank else []},
               # actions on one rank only (rules.act): it alone would back off its LR
               {"rules": {"act": rank == 0, "add": [backoff]}}):  # fmt: skip
        monitor = _monitor(net, out, "rule_mismatch", **kw)
        try:
            monitor.attach()
            errors.append("")
        except NumwatchConfigError as e:
            errors.append(str(e))
    ddp(batch(rank, 0)).sum().backward()  # the ranks are still in step
    return {"errors": errors}


def scenario_layouts_differ(rank: int, out: Path) -> dict:
    """Pipeline-like: the ranks watch different models, so their statistics cannot combine and
    stay local. A NaN on rank 1 alone must not start an exchange rank 0 never joins (the ranks'
    next collectives then timed out), and each rank reports its own gradient norm."""
    torch.manual_seed(rank)
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(rank + 1)])
    monitor = _monitor(net, out, "layouts_differ").attach()
    norms = []
    for step in range(3):
        x = torch.ones(2, 4)
        if rank == 1 and step == 1:
            x[0, 0] = float("nan")
        net(x).square().mean().backward()
        norms.append(
            math.sqrt(sum(p.grad.double().square().sum().item() for p in net.parameters()))
        )
        monitor.step()
        net.zero_grad()
    snaps = [(s.step, s.value("grad_norm")) for s in monitor.history]
    nonfinite = [e.step for e in monitor.events if e.kind == "nonfinite"]
    monitor.detach()
    return {"snaps": snaps, "norms": norms, "nonfinite": nonfinite, "errors": dict(monitor.errors)}


def scenario_reattach_unfrozen(rank: int, out: Path) -> dict:
    """Detach, unfreeze a layer, attach again (README's advice for newly trainable parameters):
    the rows' roles are rebuilt; every later step and flush failed on the old ones."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    net[0].requires_grad_(False)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    monitor = _monitor(net, out, "reattach_unfrozen", activations__every=50).attach(opt)
    got = []
    for phase in ("frozen", "unfrozen"):
        if phase == "unfrozen":
            monitor.detach()
            net[0].requires_grad_(True)
            monitor.attach()
        net(torch.ones(2, 4) * (rank + 1)).square().mean().backward()
        for p in net.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= WORLD
        want = math.sqrt(sum(p.grad.double().square().sum().item()
                             for p in net.parameters() if p.grad is not None))  # fmt: skip
        monitor.step()
        opt.zero_grad()
        got.append((monitor.snapshot().value("grad_norm"), want))
    monitor.detach()
    return {"norms": got, "errors": dict(monitor.errors)}


def scenario_unfrozen_while_attached(rank: int, out: Path) -> dict:
    """A layer unfrozen after step 0: the gradient probe selects it at the first step of the
    next flush window (flush_every=1: step 1), and the rows' roles follow (global norms over
    the selected gradients at each step)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    net[0].requires_grad_(False)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    monitor = _monitor(net, out, "unfrozen_while_attached", activations__every=50).attach(opt)
    got = []
    for step in range(3):
        if step == 1:
            net[0].requires_grad_(True)
        net(torch.ones(2, 4) * (rank + 1)).square().mean().backward()
        for p in net.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= WORLD
        selected = net.parameters() if step else net[1].parameters()
        want = math.sqrt(sum(p.grad.double().square().sum().item() for p in selected))
        monitor.step()
        opt.zero_grad()
        got.append((monitor.snapshot().value("grad_norm"), want))
    monitor.detach()
    return {"norms": got, "errors": dict(monitor.errors)}


def scenario_attach_alone(rank: int, out: Path) -> dict:
    """Rank 0 attaches a monitor and rank 1 does not (monitoring 'on rank 0 only'): rank 0
    raises after attach_timeout instead of waiting in the first collective for ever; then both
    ranks attach one, and it aggregates."""
    net = Net()
    res: dict = {"raised": ""}
    if rank == 0:
        before = hook_state(net)
        alone = _monitor(net, out, "alone", distributed__attach_timeout=1.0)
        start = time.perf_counter()
        try:
            alone.attach()
        except NumwatchConfigError as e:
            res["raised"] = str(e)
        res["waited"] = time.perf_counter() - start
        res["hooks_kept"] = hook_state(net) == before and not alone.attached
    dist.barrier()
    monitor = _monitor(net, out, "after_alone").attach()
    net(batch(rank, 0)).square().mean().backward()
    monitor.step()
    res["numel"] = monitor.snapshot().value("activation_numel", module="head")
    monitor.detach()
    return res


class Chain(nn.Module):
    """a -> b -> head; ``extra`` runs ``extra_calls`` times first; ``poison`` names the module
    whose input gets a NaN (so its output is the first non-finite tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra, self.a, self.b, self.head = (nn.Linear(D, D) for _ in range(4))
        self.extra_calls = 0
        self.poison = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.extra_calls):
            x = x + 0 * self.extra(x)
        for name in ("a", "b", "head"):
            if self.poison == name:
                x = x.clone()
                x[0, 0, 0] = float("nan")
            x = getattr(self, name)(x)
        return x


def scenario_nan_after_uneven_module_counts(rank: int, out: Path) -> dict:
    """Rank 1 runs an extra module 20 times per step in steps 0-2, so its observation numbers
    run ahead of rank 0's. At step 3 rank 1's NaN appears in module a's output (first in the
    step), rank 0's in head's (last): the first origin is rank 1's a."""
    torch.manual_seed(0)
    net = Chain()
    monitor = _monitor(net, out, "nan_uneven_counts").attach()
    for step in range(4):
        net.extra_calls = 20 if rank == 1 and step < 3 else 0
        net.poison = ("head", "a")[rank] if step == 3 else ""
        net(batch(rank, step)).square().mean().backward()
        monitor.step()
        net.zero_grad()
    events = [e for e in _events(monitor) if e["kind"] == "nonfinite"]
    errors = {k: v for k, v in monitor.errors.items() if v}
    monitor.detach()
    return {"events": events, "errors": errors}


def scenario_ddp_nan(rank: int, out: Path) -> dict:
    """DDP: a NaN in rank 1's input at step 2; skip_step on both ranks; rank-0-only JSONL."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    monitor = _monitor(net, out, "ddp_nan", rules=_skip_rules()).attach(opt)
    res: dict = {}
    for step in range(4):
        x = batch(rank, step)
        if step == 2 and rank == 1:
            x[0, 3, 5] = float("nan")
        loss = ddp(x).square().mean()
        loss.backward()
        monitor.step(loss)
        before = {n: p.detach().clone() for n, p in net.named_parameters()}
        opt.step()
        if step == 2:
            res["unchanged"] = all(torch.equal(before[n], p) for n, p in net.named_parameters())
        opt.zero_grad()
    res["params"] = {n: p.detach().clone() for n, p in net.named_parameters()}
    res["events"] = _events(monitor)
    res["skipped"] = monitor.snapshot().value("mitigation_skipped_steps_total")
    monitor.detach()
    res["jsonl"] = monitor.jsonl_path
    return res


def scenario_ddp_nan_unwatched(rank: int, out: Path) -> dict:
    """DDP plus a temperature outside the model (its gradient not all-reduced): a NaN in it on
    rank 1 only at step 1; skip_step withholds that update on both ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net)
    temperature = nn.Parameter(torch.ones(()))
    params = [*net.parameters(), temperature]
    opt = torch.optim.SGD(params, lr=1e-2)
    monitor = _monitor(net, out, "ddp_nan_unwatched", rules=_skip_rules()).attach(opt)
    res: dict = {"updated": []}
    for step in range(3):
        (ddp(batch(rank, step)) * temperature).square().mean().backward()
        if step == 1 and rank == 1:
            temperature.grad.fill_(float("nan"))
        before = [p.detach().clone() for p in params]
        opt.step()
        opt.zero_grad()
        moved = not all(torch.equal(a, p) for a, p in zip(before, params, strict=True))
        res["updated"].append(moved)
    res["finite"] = bool(torch.isfinite(temperature))
    res["skipped"] = monitor.optimizer_control.skipped_steps
    monitor.detach()
    return res


class _SAM(torch.optim.SGD):
    """Sharpness-aware minimization: a closure call at the weights, an ascent, a call at the
    perturbed weights, whose gradients the update uses."""

    @torch.no_grad()
    def step(self, closure):
        loss = torch.enable_grad()(closure)()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        olds = [p.clone() for p in params]
        for p in params:
            p.add_(p.grad, alpha=0.05)
        torch.enable_grad()(closure)()
        for p, old in zip(params, olds, strict=True):
            p.copy_(old)
        super().step()
        return loss


def scenario_ddp_sam_nan(rank: int, out: Path) -> dict:
    """SAM under DDP: a NaN at the perturbed weights at step 1, in rank 1's gradient of a
    temperature outside the model (not all-reduced); the judgment of that later closure call
    withholds the update on both ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net)
    temperature = nn.Parameter(torch.ones(()))
    params = [*net.parameters(), temperature]
    opt = _SAM(params, lr=1e-2)
    monitor = _monitor(net, out, "ddp_sam_nan", rules=_skip_rules()).attach(opt)
    res: dict = {"updated": []}
    for step in range(3):
        calls = []

        def closure(step=step, calls=calls):
            calls.append(1)
            opt.zero_grad()
            loss = (ddp(batch(rank, step)) * temperature).square().mean()
            loss.backward()
            if step == 1 and rank == 1 and len(calls) == 2:
                temperature.grad.fill_(float("nan"))
            return loss

        before = [p.detach().clone() for p in params]
        opt.step(closure)
        moved = not all(torch.equal(a, p) for a, p in zip(before, params, strict=True))
        res["updated"].append(moved)
    res["finite"] = bool(torch.isfinite(temperature))
    res["skipped"] = monitor.optimizer_control.skipped_steps
    monitor.detach()
    return res


def scenario_ddp_add_group(rank: int, out: Path) -> dict:
    """DDP: the head's group added to the optimizer at step 2 (an unfreezing), a NaN in rank
    1's input at step 4. The update sums' per-row roles were taken at the first flush only, and
    every flush after the new group failed on every rank: the NaN went unreported."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net)
    body = [p for n, p in net.named_parameters() if not n.startswith("head.")]
    opt = torch.optim.SGD(body, lr=1e-2)
    monitor = _monitor(net, out, "ddp_add_group", optimizer__every=1).attach(opt)
    flushed = []
    for step in range(6):
        if step == 2:
            opt.add_param_group({"params": list(net.head.parameters())})
        x = batch(rank, step)
        if step == 4 and rank == 1:
            x[0, 3, 5] = float("nan")
        loss = ddp(x).square().mean()
        loss.backward()
        monitor.step(loss)
        opt.step()
        opt.zero_grad()
        flushed.append(monitor.snapshot().step)
    res = {"errors": dict(monitor.errors), "flushed": flushed, "events": _events(monitor)}
    res["params"] = sorted(r.labels["param"] for r in monitor.snapshot().series(
        "optimizer_update_ratio"))  # fmt: skip
    monitor.detach()
    return res


def scenario_eval_on_rank0_before_detach(rank: int, out: Path) -> dict:
    """An evaluation on rank 0 alone after the last step, then detach on every rank: detach's
    flush of evaluation forwards is collective, and rank 0 alone ran it (rank 1 met its
    all-reduce in a later barrier: a timeout, then both ranks died)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
    monitor = _monitor(net, out, "eval_rank0", flush_every=2,
                       activations__training_only=False).attach(opt)  # fmt: skip
    for step in range(4):
        ddp(batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        net.eval()
        with torch.no_grad():
            net(batch(rank, 9))
    monitor.detach()
    dist.barrier()
    return {"errors": dict(monitor.errors)}


def scenario_join_disabled(rank: int, out: Path) -> dict:
    """A disabled monitor in Join([ddp, monitor]) with uneven inputs: nothing of the monitor's
    runs, and nothing waits for it (its join hook used to wait for flags no rank sent)."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
    monitor = _monitor(net, out, "join_disabled", enabled=False).attach(opt)
    with Join([ddp, monitor]):
        for step in range(1 if rank == 0 else 3):
            ddp(batch(rank, step)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    monitor.detach()
    return {"steps": monitor.steps}


def scenario_ddp_join(rank: int, out: Path, accumulate: int) -> dict:
    """Uneven inputs under ``Join([ddp, monitor])``: rank 0 has 2 steps, rank 1 has 4, each of
    ``accumulate`` forwards (DDP's no_sync on all but the last); skip_step makes the ranks
    exchange values at every step too, and every step flushes."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
    monitor = _monitor(net, out, f"join{accumulate}", rules=_skip_rules()).attach(opt)
    losses = []
    with Join([ddp, monitor]):
        for step in range(2 if rank == 0 else 4):
            for micro in range(accumulate):
                last = micro == accumulate - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    loss = ddp(batch(rank, 10 * step + micro)).square().mean()
                    loss.backward()
            losses.append(loss.item())
            monitor.step(loss)
            opt.step()
            opt.zero_grad()
    flushed = [
        (s.step, s.value("loss"), s.value("activation_numel", module="head"))
        for s in monitor.history
    ]
    monitor.detach()
    joined_step = monitor.joined_step
    # the next epoch, even, attached again: the ranks aggregate again (the last Join had left
    # every later attach local: the ranks then skipped steps on their own values)
    monitor.attach(opt)
    again = []
    for step in range(2):
        loss = ddp(batch(rank, 100 + step)).square().mean()
        loss.backward()
        again.append(loss.item())
        monitor.step(loss)
        opt.step()
        opt.zero_grad()
    again_flushed = [s.value("loss") for s in monitor.history[-2:]]
    rejoined = monitor.joined_step
    monitor.detach()
    return {
        "steps": monitor.steps,
        "joined_step": joined_step,
        "errors": {k: v for k, v in monitor.errors.items() if v},
        "losses": losses,
        "flushed": flushed,
        "again": again,
        "again_flushed": again_flushed,
        "rejoined": rejoined,
    }


def scenario_join_logs(rank: int, out: Path) -> dict:
    """Uneven inputs, one log of global values (distributed.jsonl='rank0', a path without
    {rank}): rank 0 has 2 steps, rank 1 has 4 and a NaN in its input at step 3, after the join;
    what each rank's console printed and the logs' records."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
    path = out / "join_logs.jsonl"
    monitor = _monitor(
        net, out, "join_logs", rules=_skip_rules(), sinks__console__enabled=True,
        sinks__jsonl__path=str(path),
    ).attach(opt)  # fmt: skip
    console = io.StringIO()
    with contextlib.redirect_stderr(console), Join([ddp, monitor]):
        for step in range(2 if rank == 0 else 4):
            x = batch(rank, step)
            x[0, 0, 0] = math.nan if step == 3 else x[0, 0, 0]
            loss = ddp(x).square().mean()
            loss.backward()
            monitor.step(loss)
            opt.step()
            opt.zero_grad()
        monitor.detach()
    return {
        "errors": {k: v for k, v in monitor.errors.items() if v},
        "console": console.getvalue(),
        "jsonl": monitor.jsonl_path,
        "log": read_jsonl(monitor.jsonl_path) if monitor.jsonl_path else None,
    }


def _fsdp_net() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net()
    for block in (net.a, net.b):
        fully_shard(block)
    fully_shard(net)
    return net


def scenario_fsdp_qk_clip(rank: int, out: Path) -> dict:
    """QK-clip of FSDP2-sharded weights: each rank scales the head's rows of its own shard.
    Narrowing the DTensor made a redistributed copy, so the clip wrote into it and did nothing
    while reporting that it clipped."""
    from numwatch.actions.library import qk_clip

    net = _fsdp_net()
    qk_clip(net, "a", 1, 400.0, 100.0)
    return {n: p.full_tensor() for n, p in net.a.qkv.named_parameters()}


def scenario_fsdp_stats(rank: int, out: Path) -> dict:
    """FSDP2: gradient statistics of local shards aggregate to those of the full gradient."""
    net = _fsdp_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    monitor = _monitor(
        net, out, "fsdp_stats", weights__every=1, weights__iters=100, optimizer__enabled=False
    ).attach(opt)
    loss = net(batch(rank, 0)).square().mean()
    loss.backward()
    # gathered for the test's oracles only
    full = {n: p.grad.full_tensor() for n, p in net.named_parameters()}
    weights = {n: p.full_tensor() for n, p in net.named_parameters()}
    monitor.step(loss)
    opt.step()
    res = {"grads": full, "weights": weights, "snapshot": monitor.snapshot().to_dict()}
    monitor.detach()
    return res


def scenario_fsdp_opt(rank: int, out: Path) -> dict:
    """FSDP2: the optimizer probe measures each rank's shards; the sums add up at flush."""
    net = _fsdp_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    monitor = _monitor(
        net, out, "fsdp_opt", optimizer__every=1, weights__enabled=False, attention__enabled=False
    ).attach(opt)
    # gathered for the test's oracles only
    before = {n: p.full_tensor() for n, p in net.named_parameters()}
    grads = {}
    for step in range(2):  # step 1's flush reports the update of step 0
        loss = net(batch(rank, step)).square().mean()
        loss.backward()
        monitor.step(loss)
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in net.named_parameters()}
            opt.step()
            opt.zero_grad()
    after = {n: p.full_tensor() for n, p in net.named_parameters()}
    res = {"before": before, "after": after, "grads": grads}
    res["snapshot"] = monitor.snapshot().to_dict()
    monitor.detach()
    return res


def scenario_fsdp_nan(rank: int, out: Path, aggregate: bool) -> dict:
    """FSDP2: a NaN in rank 1's shard of one gradient at step 1 (rank 0's shard is clean)."""
    net = _fsdp_net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    monitor = _monitor(
        net,
        out,
        f"fsdp_nan_{aggregate}",
        rules=_skip_rules(),
        weights__enabled=False,
        optimizer__enabled=False,
        distributed__aggregate=aggregate,
    ).attach(opt)
    res: dict = {}
    for step in range(3):
        net(batch(rank, step)).square().mean().backward()
        if step == 1 and rank == 1:
            net.a.qkv.weight.grad.to_local()[0, 0] = float("nan")
        monitor.step()
        before = {n: p.to_local().clone() for n, p in net.named_parameters()}
        opt.step()
        if step == 1:
            after = dict(net.named_parameters())
            res["unchanged"] = all(torch.equal(before[n], after[n].to_local()) for n in before)
        opt.zero_grad()
    res["events"] = _events(monitor)
    res["skipped"] = monitor.optimizer_control.skipped_steps
    monitor.detach()
    return res


def scenario_fsdp_one_rank_local(rank: int, out: Path) -> dict:
    """FSDP2, a monitor on rank 0 alone with distributed.aggregate=false (the attach error's own
    advice): the weight probe's sharded power iteration all-reduced on the mesh, which rank 1
    never joined, and FSDP's own collectives met it (a hang, or a gloo timeout)."""
    net = _fsdp_net()
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    monitor = None
    if rank == 0:
        monitor = _monitor(net, out, "fsdp_one_rank", weights__every=1,
                           distributed__aggregate=False).attach(opt)  # fmt: skip
    for step in range(3):
        net(batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    res = {"steps": 3}
    if monitor is not None:
        res["weights"] = [r.name for r in monitor.snapshot() if r.name.startswith("weight_")]
        monitor.detach()
    return res


def scenario_swap(rank: int, out: Path, aggregate: bool) -> dict:
    """DDP: repeated maxima on rank 1 only; the swap rule decides on the global fraction."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Net()
    net.b.plant = rank == 1
    ddp = DDP(net)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    rule = {
        "type": "threshold",
        "name": "ties",
        "metric": "attn_repeated_max_fraction",
        "threshold": 0.05,
        "for_flushes": 2,
        "actions": ["swap_attention_kernel"],
    }
    monitor = _monitor(
        net,
        out,
        f"swap_{aggregate}",
        rules={"defaults": False, "add": [rule]},
        distributed__aggregate=aggregate,
    ).attach(opt)
    for step in range(4):
        ddp(batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    kernel = monitor.attention_kernel("b")
    res = {
        "events": _events(monitor),
        "stabilized": kernel is not None and kernel.stabilized,
        "other_layer": monitor.attention_kernel("a"),
        "params": {n: p.detach().clone() for n, p in net.named_parameters()},
    }
    monitor.detach()
    return res


# (index into _sigma_weights, groups, dim, start, stop) of each MatrixBlock
SIGMA_BLOCKS = [
    (0, 2, 0, 0, None),  # 2 groups of 24 rows: one per rank
    (1, 3, 0, 0, None),  # 3 groups of 4 rows; group 1 split over the ranks
    (2, 1, 0, 0, None),  # uneven shards (3 + 2 rows)
    (3, 1, 0, 0, None),  # rank 1's shard is empty
    (4, 2, 0, 8, 16),  # the K part of a fused qkv: one head on each rank
    (5, 3, 1, 0, 12),  # Conv1D column heads, rows sharded 5 + 5
]


def _sigma_weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    shapes = [(48, 16), (12, 8), (5, 6), (1, 9), (24, 8), (10, 12)]
    return [torch.randn(*shape, generator=gen) for shape in shapes]


def _sigma_blocks(weights: list[torch.Tensor]) -> list[MatrixBlock]:
    return [MatrixBlock(weights[i], g, d, a, b) for i, g, d, a, b in SIGMA_BLOCKS]


def scenario_sharded_sigma(rank: int, out: Path) -> dict:
    """ShardedPowerIteration on DTensor weights (and one plain weight every rank holds)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    full = _sigma_weights()
    blocks = _sigma_blocks([distribute_tensor(w, mesh, [Shard(0)]) for w in full])
    blocks.append(MatrixBlock(full[1], 3))
    pi = ShardedPowerIteration(iters=3)
    first = pi.step(blocks)
    converged = [pi.step(blocks) for _ in range(100)][-1]
    tiny = _sigma_blocks([distribute_tensor(w * 1e-30, mesh, [Shard(0)]) for w in full])
    tiny_pi = ShardedPowerIteration(iters=300)
    return {"first": first, "converged": converged, "tiny": tiny_pi.step(tiny)}


def scenario_default_name(rank: int, out: Path) -> dict:
    """Default run names come from each rank's clock: ranks attaching across a second boundary
    named one job twice (two logs, two Prometheus run labels). Rank 0's is everyone's."""
    from numwatch import monitor as monitor_module

    real = monitor_module._default_run_name
    monitor_module._default_run_name = lambda: f"run-20261201T00000{rank}Z"  # ranks' clocks
    try:
        monitor = numwatch.Monitor(
            Net(), flush_every=1, distributed__jsonl="per_rank", sinks__console__enabled=False,
            sinks__jsonl__path=str(out / "default_name" / "{run_name}.rank{rank}.jsonl"),
        ).attach()  # fmt: skip
    finally:
        monitor_module._default_run_name = real
    monitor.detach()
    return {"run_name": monitor.run_name, "jsonl": monitor.jsonl_path}


def _on_event(event, monitor) -> None:
    """A callback action's callable: the same function on every rank, at another address."""


def scenario_callable_callback(rank: int, out: Path) -> dict:
    """A callback action given as a callable: the attach-time check compared reprs holding
    the function's address, and refused every distributed run ('configured differently')."""
    rules = {
        "defaults": False,
        "add": [{"type": "threshold", "name": "big", "metric": "loss", "threshold": 1e9,
                 "actions": [{"type": "callback", "target": _on_event}]}],
    }  # fmt: skip
    monitor = _monitor(Net(), out, "callable_callback", rules=rules).attach()
    active = monitor._dist.active
    monitor.detach()
    return {"active": active}


def scenario_grad_probe_fails_once(rank: int, out: Path) -> dict:
    """Rank 1's gradient statistics fail at step 0 (an OOM): its window held one per-step norm
    entry to rank 0's two, every statistic of the flush stayed local, and the ranks decided
    apart (rank 1 halted on its own loss, rank 0 went into DDP's all-reduce alone)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    monitor = _monitor(net, out, "grad_fails_once", flush_every=2).attach(opt)
    probe, real = monitor._gradients, ts.tensor_stats

    def failing(*args, **kwargs):
        raise RuntimeError("planted: CUDA out of memory")

    losses = []
    for step in range(2):
        loss = ddp(torch.ones(2, 4)).sum() * 0 + (1.0 if rank == 0 else 100.0)
        loss.backward()
        if rank == 1 and step == 0:
            ts.tensor_stats = failing
        try:
            monitor.step(loss)
        finally:
            ts.tensor_stats = real
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    snap = monitor.snapshot()
    monitor.detach()
    return {
        "errors": {k: v for k, v in monitor.errors.items() if v},
        "loss": snap.get("loss"),
        "grad_norm": snap.get("grad_norm"),
        "combined": monitor._dist._combined,
        "entries": probe is not None,
    }


def scenario_step_without_backward(rank: int, out: Path) -> dict:
    """skip_step read the last per-step norm entry of the window, also at a step that added
    none (no backward through the watched model): a NaN step was seen again one step later."""
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    monitor = _monitor(m, out, "no_backward", flush_every=10, rules=_skip_rules()).attach(opt)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        if step != 1:
            m(torch.ones(2, 4) * (math.nan if step == 0 else 1.0)).sum().backward()
        opt.step()
    monitor.detach()
    return {
        "events": [(e.step, e.rule) for e in monitor.events if e.kind == "nonfinite"],
        "skipped": [e.message for e in monitor.events if e.kind == "action"],
    }


def scenario_loss_on_rank0_only(rank: int, out: Path) -> dict:
    """The loss passed to step() on the logging rank only: the flushed loss was rank 0's halved
    (rank 1's missing loss counted as 0), rank 1 had none, and a rule on it backed off the LR
    on rank 0 alone, so the DDP replicas forked."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    rules = {
        "defaults": False,
        "add": [{"type": "threshold", "name": "hi_loss", "metric": "loss", "threshold": 0.0,
                 "actions": [{"type": "lr_backoff", "factor": 0.1, "steps": 100}]}],
    }  # fmt: skip
    monitor = _monitor(net, out, "loss_rank0", flush_every=2, rules=rules).attach(opt)
    losses = []
    for _ in range(4):
        loss = ddp(torch.full((2, 4), float(rank + 1))).square().mean()
        loss.backward()
        losses.append(loss.item())
        if rank == 0:
            monitor.step(loss)
        opt.step()
        opt.zero_grad()
    snaps = [(s.get("loss"), s.get("loss_mean"), s.get("loss_max")) for s in monitor.history]
    monitor.detach()
    return {
        "losses": losses,
        "flushed": snaps,
        "actions": [e.step for e in monitor.events if e.kind == "action"],
        "params": torch.cat([p.detach().flatten() for p in net.parameters()]),
    }


def scenario_loss_skip(rank: int, out: Path) -> dict:
    """A step-level rule on the loss (skip_step decides every step): the rules read the 'has
    norm' count (1) as the loss instead of the ranks' mean loss, so a loss rule never fired."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    rules = {
        "defaults": False,
        "add": [{"type": "threshold", "name": "big_loss", "metric": "loss", "threshold": 5.0,
                 "actions": ["skip_step"]}],
    }  # fmt: skip
    monitor = _monitor(net, out, "loss_skip", rules=rules).attach(opt)
    losses, params = [], []
    for step in range(3):
        loss = ddp(torch.full((2, 4), float(rank + 1))).square().mean()
        loss = loss + (20.0 * (rank + 1) if step == 1 else 0.0)
        loss.backward()
        losses.append(loss.item())
        monitor.step(loss)
        opt.step()
        opt.zero_grad()
        params.append(torch.cat([p.detach().flatten() for p in net.parameters()]))
    fired = [(e.step, e.value) for e in monitor.events if e.kind == "precursor"]
    monitor.detach()
    return {"losses": losses, "fired": fired, "params": params}


def scenario_fsdp1_warns(rank: int, out: Path) -> dict:
    """FSDP1 (FullyShardedDataParallel): its flat shards read as whole parameters, so grad_norm
    was rank 0's shard's on every rank, with no word that FSDP1 is not supported."""
    import logging

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("numwatch").addHandler(handler)
    warned = {}
    try:
        for name, orig in (("flat", False), ("orig", True)):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
            fsdp = FSDP(net, device_id=torch.device("cpu"), use_orig_params=orig)
            for watched in (fsdp, net):  # the wrapper, or the module it wraps
                seen.clear()
                _monitor(watched, out, f"fsdp1_{name}").attach().detach()
                warned[name, watched is fsdp] = [m for m in seen if "FSDP1" in m]
        seen.clear()
        _monitor(_fsdp_net(), out, "fsdp2_quiet").attach().detach()
        warned["fsdp2"] = [m for m in seen if "FSDP1" in m]
    finally:
        logging.getLogger("numwatch").removeHandler(handler)
    return {"warned": warned}


def scenario_new_group_between_attaches(rank: int, out: Path) -> dict:
    """The group destroyed and a new one made between a detach and an attach of one monitor:
    the attach used the groups made in the dead one ('not initialized in the world group
    map'). Runs last: the scenarios after it would be on the new group."""
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    monitor = _monitor(m, out, "new_group").attach(opt)
    m(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    monitor.detach()
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", init_method=f"file://{out / 'rendezvous2'}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    monitor.attach(opt)
    m(torch.full((2, 4), float(rank))).sum().backward()
    opt.step()
    monitor.detach()
    return {
        "errors": {k: v for k, v in monitor.errors.items() if v},
        "absmax": monitor.snapshot().get("grad_absmax", param="weight"),
    }


SCENARIOS = {
    "ddp_stats": scenario_ddp_stats,
    "ddp_nan": scenario_ddp_nan,
    "ddp_nan_unwatched": scenario_ddp_nan_unwatched,
    "ddp_sam_nan": scenario_ddp_sam_nan,
    "ddp_add_group": scenario_ddp_add_group,
    "eval_rank0": scenario_eval_on_rank0_before_detach,
    "probe_fails": scenario_probe_fails,
    "config_mismatch": scenario_config_mismatch,
    "attach_alone": scenario_attach_alone,
    "nan_uneven_counts": scenario_nan_after_uneven_module_counts,
    "layer_on_one_rank": scenario_layer_on_one_rank,
    "fsdp_stats": scenario_fsdp_stats,
    "fsdp_opt": scenario_fsdp_opt,
    "fsdp_nan": lambda r, o: scenario_fsdp_nan(r, o, aggregate=True),
    "fsdp_nan_local": lambda r, o: scenario_fsdp_nan(r, o, aggregate=False),
    "swap": lambda r, o: scenario_swap(r, o, aggregate=True),
    "swap_local": lambda r, o: scenario_swap(r, o, aggregate=False),
    "sharded_sigma": scenario_sharded_sigma,
    "fsdp_qk_clip": scenario_fsdp_qk_clip,
    "join": lambda r, o: scenario_ddp_join(r, o, accumulate=1),
    "join_accumulate": lambda r, o: scenario_ddp_join(r, o, accumulate=2),
    "join_disabled": scenario_join_disabled,
    "join_logs": scenario_join_logs,
    "rule_mismatch": scenario_rule_mismatch,
    "layouts_differ": scenario_layouts_differ,
    "reattach_unfrozen": scenario_reattach_unfrozen,
    "unfrozen_while_attached": scenario_unfrozen_while_attached,
    "default_name": scenario_default_name,
    "fsdp_one_rank_local": scenario_fsdp_one_rank_local,
    "callable_callback": scenario_callable_callback,
    "grad_probe_fails_once": scenario_grad_probe_fails_once,
    "step_without_backward": scenario_step_without_backward,
    "loss_rank0": scenario_loss_on_rank0_only,
    "loss_skip": scenario_loss_skip,
    "fsdp1_warns": scenario_fsdp1_warns,
    "new_group_between_attaches": scenario_new_group_between_attaches,  # last: a new group
}


def _worker(rank: int, out: str) -> None:
    # These scenarios are CPU (gloo) by design. On a GPU host, FSDP2's DeviceMesh would pick a
    # CUDA device per rank (rank % GPUs) for CPU-sharded modules; keep the workers off CUDA.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    faulthandler.enable()  # a native crash in a worker prints its stack into the test report
    out_dir = Path(out)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir / 'rendezvous'}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    results: dict = {}
    code = 0
    try:
        for name, fn in SCENARIOS.items():
            start = time.perf_counter()
            try:
                results[name] = fn(rank, out_dir)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            results[name]["seconds"] = time.perf_counter() - start
            dist.barrier()
    except BaseException:
        traceback.print_exc()
        code = 1
    torch.save(results, out_dir / f"results.rank{rank}.pt")
    dist.destroy_process_group()
    # Leave without finalizing the interpreter: gloo's C++ threads can outlive the group and race
    # the teardown ("terminate called without an active exception", SIGABRT after every scenario
    # had passed, once in CI). The results are on disk and the group is gone; nothing is lost.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both ranks' results of every scenario: runs[name][rank]."""
    out = tmp_path_factory.mktemp("distributed")
    # The workers are CPU (gloo) by design: hidden from CUDA before their first import (a spawned
    # worker imports this module, torch and numwatch, before _worker runs), or on a GPU host
    # Triton picked a device the worker could not see ("Invalid device id") and it crashed.
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        ctx = mp.start_processes(
            _worker, args=(str(out),), nprocs=WORLD, join=False, start_method="spawn"
        )
    finally:
        if hidden is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("distributed workers did not finish in 240 s")
    loaded = [torch.load(out / f"results.rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return {name: [loaded[r][name] for r in range(WORLD)] for name in SCENARIOS}


def _ok(results: list[dict]) -> list[dict]:
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return results


def _value(snapshot: dict, name: str, **labels: str) -> float:
    hits = [m["value"] for m in snapshot["metrics"] if m["name"] == name and m["labels"] == labels]
    assert len(hits) == 1, (name, labels, len(hits))
    return hits[0]


# ------------------------------------------------------------------------------ oracles
def _stats64(x: torch.Tensor) -> dict[str, float]:
    x = x.double().reshape(-1)
    finite = x[torch.isfinite(x)]
    return {
        "numel": x.numel(),
        "absmax": finite.abs().max().item(),
        "min": finite.min().item(),
        "max": finite.max().item(),
        "mean": finite.mean().item(),
        "rms": finite.square().mean().sqrt().item(),
        "nan": torch.isnan(x).sum().item(),
        "zeros": (x == 0).sum().item(),
    }


def _check_stats(snapshot: dict, prefix: str, labels: dict, x: torch.Tensor) -> None:
    for stat, want in _stats64(x).items():
        got = _value(snapshot, f"{prefix}_{stat}", **labels)
        if stat in ("numel", "absmax", "min", "max", "nan", "zeros"):
            assert got == want, (prefix, labels, stat)  # exact: counts and extremes
        else:  # rms: the statistics square in the tensor's dtype, then add in float64
            assert got == pytest.approx(want, rel=1e-12 if stat == "mean" else 1e-7), stat


def _attention64(q, k, v, y) -> list[dict[str, float]]:
    """Per-head float64 oracle of the attention probe's metrics (causal SDPA, no mask)."""
    q, k, v, y = (t.double() for t in (q, k, v, y))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    s = s.masked_fill(~causal, -math.inf)
    rowmax = s.amax(-1, keepdim=True)
    p = torch.softmax(s, -1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)  # (B, H, T)
    err = y - p @ v
    out = []
    for h in range(q.shape[1]):
        sh = s[:, h]
        unmasked = sh[causal.expand_as(sh)]
        out.append(
            {
                "attn_rows": sh.shape[0] * T,
                "attn_repeated_max_rows": ((sh == rowmax[:, h]).sum(-1) >= 2).sum().item(),
                "attn_max_logit": unmasked.max().item(),
                "attn_min_logit": unmasked.min().item(),
                "attn_entropy_mean": entropy[:, h].mean().item(),
                "attn_entropy_min": entropy[:, h].min().item(),
                "attn_output_bias": (err[:, h].sum() / err[:, h].abs().sum()).item(),
                "attn_output_error_rms": err[:, h].square().mean().sqrt().item(),
            }
        )
    return out


def _check_attention(snapshot: dict, layer: str, seen: list[torch.Tensor]) -> None:
    for h, want in enumerate(_attention64(*seen)):
        for name, value in want.items():
            got = _value(snapshot, name, layer=layer, head=str(h))
            if name in ("attn_rows", "attn_repeated_max_rows"):
                assert got == value, (layer, h, name)
            elif name.startswith("attn_output"):
                # the probe's error is vs its own float64 recomputation, ours vs another order
                assert got == pytest.approx(value, rel=1e-6, abs=1e-12), (layer, h, name)
            else:  # fp32 scores in the probe, float64 here
                assert got == pytest.approx(value, rel=1e-5), (layer, h, name)


# ------------------------------------------------------------------------------ tests: packing
def _table(gen: torch.Generator, rows: int) -> torch.Tensor:
    t = torch.randn(rows, ts.N_STATS, generator=gen, dtype=torch.float64).abs() * 10
    t[:, ts.MIN] = -t[:, ts.MIN]
    return t


def test_packing_two_simulated_ranks_matches_combine_stats():
    """SUM/MAX buffers of two ranks, reduced elementwise, unpack to the merged tables: shards
    merge as combine_stats does, replicas keep their one value; NaN survives the MAX buffer."""
    gen = torch.Generator().manual_seed(0)
    roles = [SHARD, REPLICA, SHARD]
    tables = [_table(gen, 3) for _ in range(WORLD)]
    tables[1][1] = tables[0][1]  # the replica row: the same on both ranks
    heads = [torch.randn(2, 9, generator=gen, dtype=torch.float64) for _ in range(WORLD)]
    heads[1][0, 5] = float("nan")  # a NaN max logit on rank 1 only
    order = [torch.tensor(7.0, dtype=torch.float64), torch.tensor(math.inf, dtype=torch.float64)]
    # optimizer sums of a sharded and a replicated parameter
    opt = [torch.rand(2, 4, generator=gen, dtype=torch.float64) for _ in range(WORLD)]
    opt[1][1] = opt[0][1]
    layout = [
        ("attn/x/heads", (2, 9)),
        ("grad_table/0", (3, ts.N_STATS)),
        ("nonfinite_first/0", ()),
        ("opt/sums", (2, 4)),
    ]
    row_roles = {"grad_table": roles, "opt": [SHARD, REPLICA]}
    ops = torch.cat([element_ops(k, s, row_roles) for k, s in layout])
    plan = _Plan(ops, torch.device("cpu"))
    bufs = [
        plan.pack(
            torch.cat(
                [
                    heads[r].reshape(-1),
                    tables[r].reshape(-1),
                    order[r].reshape(1),
                    opt[r].reshape(-1),
                ]
            )
        )
        for r in range(WORLD)
    ]
    s = bufs[0][0] + bufs[1][0]
    m = torch.maximum(bufs[0][1], bufs[1][1])  # a MAX all-reduce that drops NaN is fine too
    out = plan.unpack(s, m)
    got_heads, got_table = out[:18].view(2, 9), out[18 : 18 + 3 * ts.N_STATS].view(3, -1)
    got_order, got_opt = out[18 + 3 * ts.N_STATS], out[-8:].view(2, 4)
    assert torch.equal(got_opt[0], opt[0][0] + opt[1][0])  # shard sums add
    assert torch.equal(got_opt[1], opt[0][1])  # the replica's: not doubled

    want = ts.combine_stats(tables[0].clone(), tables[1])
    assert torch.equal(got_table[[0, 2]], want[[0, 2]])
    assert torch.equal(got_table[1], tables[0][1])  # replica: not doubled
    assert math.isnan(got_heads[0, 5]) and got_heads[1, 5] == max(heads[0][1, 5], heads[1][1, 5])
    assert got_heads[0, 0] == heads[0][0, 0] + heads[1][0, 0]  # ROWS add
    assert got_heads[1, 6] == min(heads[0][1, 6], heads[1][1, 6])  # MIN_LOGIT via -max(-x)
    assert got_order == 7.0


def test_unknown_keys_reduce_with_max():
    assert bool((element_ops("weights/sigma", (5,)) == MAX).all())
    assert DistributedConfig().aggregate and DistributedConfig().jsonl == "rank0"


def test_sharded_power_iteration_single_process_matches_svd():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(12, 8, generator=gen)
    w[4:8] *= 5  # group 1 dominates, so the groups differ
    pi = ShardedPowerIteration(iters=200)
    sigma = pi.step([MatrixBlock(w, 3)])
    want = torch.linalg.matrix_norm(w.double().view(3, 4, 8), ord=2)
    torch.testing.assert_close(sigma.double(), want, rtol=1e-5, atol=0)
    w[0, 0] = float("nan")  # group 0 reports NaN and restarts; the others go on
    sigma = pi.step([MatrixBlock(w, 3)])
    assert torch.isnan(sigma[0]) and torch.isfinite(sigma[1:]).all()


# ------------------------------------------------------------------------------ tests: 2 ranks
def test_ddp_global_values_equal_float64_oracle_on_concatenated_data(runs):
    res = _ok(runs["ddp_stats"])
    snap = res[0]["snapshot"]
    host_side = ("step_seconds", "monitor_overhead_seconds")  # timings stay per rank
    same = [
        [
            (m["name"], m["labels"], m["value"])
            for m in r["snapshot"]["metrics"]
            if m["name"] not in host_side
        ]
        for r in res
    ]
    assert same[0] == same[1]  # every rank holds the same global values
    for r in range(WORLD):
        for name in res[0]["acts"]:
            both = torch.cat([res[i]["acts"][name].reshape(-1) for i in range(WORLD)])
            _check_stats(res[r]["snapshot"], "activation", {"module": name}, both)
        for layer in ("a", "b"):
            seen = [torch.cat([res[i]["attn"][layer][j] for i in range(WORLD)]) for j in range(4)]
            _check_attention(res[r]["snapshot"], layer, seen)
        for name, g in res[0]["grads"].items():
            assert torch.equal(g, res[1]["grads"][name])  # DDP: synchronized
            _check_stats(res[r]["snapshot"], "grad", {"param": name}, g)  # not doubled
        norm = math.sqrt(sum(g.double().square().sum().item() for g in res[0]["grads"].values()))
        assert _value(res[r]["snapshot"], "grad_norm") == pytest.approx(norm, rel=1e-7)
        mean_loss = (res[0]["loss"] + res[1]["loss"]) / 2
        assert _value(res[r]["snapshot"], "loss") == pytest.approx(mean_loss, rel=1e-12)
        assert _value(res[r]["snapshot"], "loss_mean") == pytest.approx(mean_loss, rel=1e-12)
        top = max(res[0]["loss"], res[1]["loss"])  # the largest loss of any rank's steps
        assert _value(res[r]["snapshot"], "loss_max") == pytest.approx(top, rel=1e-12)
    # planted ties on rank 1 only: half of the global rows of layer b repeat their maximum
    assert _value(snap, "attn_repeated_max_fraction", layer="b", head="0") >= 0.4


def test_ddp_a_param_group_added_after_attach_keeps_the_flushes_aggregating(runs):
    for res in _ok(runs["ddp_add_group"]):
        assert res["errors"] == {}
        assert res["flushed"] == list(range(6))
        nan = [e for e in res["events"] if e["kind"] == "nonfinite"]
        assert (nan[0]["step"], nan[0]["evidence"]["rank"]) == (4, 1)  # then NaN weights
        assert "head.weight" in res["params"]


def test_an_evaluation_on_one_rank_before_detach_issues_no_collective(runs):
    assert [res["errors"] for res in _ok(runs["eval_rank0"])] == [{}, {}]


def test_ddp_per_rank_jsonl_holds_each_ranks_own_values(runs):
    res = _ok(runs["ddp_stats"])
    for r in range(WORLD):
        record = read_jsonl(res[r]["jsonl"])[0]
        assert record["rank"] == r
        _check_stats(record, "activation", {"module": "a.qkv"}, res[r]["acts"]["a.qkv"])
        _check_attention(record, "b", res[r]["attn"]["b"])
        assert _value(record, "loss") == pytest.approx(res[r]["loss"], rel=1e-12)
        assert _value(record, "loss_max") == pytest.approx(res[r]["loss"], rel=1e-12)
    rows = [
        _value(read_jsonl(res[r]["jsonl"])[0], "attn_repeated_max_rows", layer="b", head="0")
        for r in range(WORLD)
    ]
    assert rows[0] == 0 and rows[1] > 0


def test_nan_on_rank1_is_reported_with_rank1_and_skipped_on_both_ranks(runs):
    res = _ok(runs["ddp_nan"])
    assert repr(res[0]["events"]) == repr(
        res[1]["events"]
    )  # NaN values compare equal  # the same events, hence the same actions
    origin = next(e for e in res[0]["events"] if e["kind"] == "nonfinite" and e["labels"])
    assert origin["labels"] == {"module": "a.qkv"} and origin["step"] == 2
    assert origin["evidence"]["rank"] == 1 and origin["evidence"]["ranks"] == [0, 1]
    assert origin["message"].endswith("at step 2 on rank 1")
    skips = [e for e in res[0]["events"] if e["kind"] == "action"]
    assert [e["step"] for e in skips] == [2]
    for r in range(WORLD):
        assert res[r]["unchanged"] and res[r]["skipped"] == 1
    for name, p in res[0]["params"].items():
        assert torch.equal(p, res[1]["params"][name]), name  # replicas bitwise identical
    assert Path(res[0]["jsonl"]).exists() and res[1]["jsonl"] is None  # rank 0 logs alone


def test_a_nan_in_an_unwatched_gradient_on_rank1_is_skipped_on_both_ranks(runs):
    """A parameter outside the model (its gradient not all-reduced by DDP): the skip covers it,
    and the ranks decide together."""
    for res in _ok(runs["ddp_nan_unwatched"]):
        assert res["updated"] == [True, False, True]
        assert res["finite"] and res["skipped"] == 1


def test_a_nan_at_sams_perturbed_weights_on_rank1_is_skipped_on_both_ranks(runs):
    """The later closure call is judged on global values, so that the ranks decide together."""
    for res in _ok(runs["ddp_sam_nan"]):
        assert res["updated"] == [True, False, True]
        assert res["finite"] and res["skipped"] == 1


def test_fsdp2_shard_statistics_aggregate_to_the_full_gradient(runs):
    res = _ok(runs["fsdp_stats"])
    full = res[0]["grads"]
    assert any(g.shape[0] < WORLD for g in full.values())  # an empty shard is covered
    for r in range(WORLD):
        snap = res[r]["snapshot"]
        for name, g in full.items():
            _check_stats(snap, "grad", {"param": name}, g)
        norm = math.sqrt(sum(g.double().square().sum().item() for g in full.values()))
        assert _value(snap, "grad_norm") == pytest.approx(norm, rel=1e-7)  # squares in fp32
        assert _value(snap, "grad_norm_max") == _value(snap, "grad_norm")


def test_fsdp2_optimizer_update_ratios_of_shards_match_the_full_parameters(runs):
    res = _ok(runs["fsdp_opt"])
    before, after, grads = res[0]["before"], res[0]["after"], res[0]["grads"]
    for r in range(WORLD):
        snap = res[r]["snapshot"]
        errors = [m for m in snap["metrics"] if m["name"] == "monitor_errors_total"]
        assert errors and not [m for m in errors if m["value"]]
        for name, w in after.items():
            update = (w - before[name]).double()
            want = (update.norm() / w.double().norm()).item()
            got = _value(snap, "optimizer_update_ratio", param=name)
            assert got == pytest.approx(want, rel=1e-5), name
            moved = grads[name] != 0
            absorbed = (moved & (update == 0)).sum().item() / max(moved.sum().item(), 1)
            assert _value(snap, "optimizer_absorbed_fraction", param=name) == absorbed


def test_fsdp2_spectral_norms_of_shards_match_svd_of_full_weights(runs):
    """The weight probe on DTensor weights: ShardedPowerIteration, 100 iterations at step 0."""
    res = _ok(runs["fsdp_stats"])
    for r in range(WORLD):
        snap = res[r]["snapshot"]
        assert _value(snap, "monitor_errors_total", component="weights") == 0
        for name, w in res[0]["weights"].items():
            if w.dim() == 2:
                want = torch.linalg.matrix_norm(w.double(), ord=2).item()
                got = _value(snap, "weight_spectral_norm", param=name)
                assert got == pytest.approx(want, rel=1e-4), name
        for layer in ("a", "b"):
            qkv = res[0]["weights"][f"{layer}.qkv.weight"].double()  # rows: [q heads | k | v]
            heads = qkv.view(3, HEADS, D // HEADS, D)
            for h in range(HEADS):
                for side, rows in (("q", heads[0, h]), ("k", heads[1, h])):
                    want = torch.linalg.matrix_norm(rows, ord=2).item()
                    got = _value(snap, f"attn_{side}_spectral_norm", layer=layer, head=str(h))
                    assert got == pytest.approx(want, rel=1e-4), (layer, side, h)


def test_fsdp2_nan_in_one_ranks_shard_skips_on_every_rank(runs):
    res = _ok(runs["fsdp_nan"])
    assert repr(res[0]["events"]) == repr(res[1]["events"])  # NaN values compare equal
    origin = next(e for e in res[0]["events"] if e["kind"] == "nonfinite" and e["labels"])
    assert origin["labels"] == {"param": "a.qkv.weight"} and origin["step"] == 1
    assert origin["evidence"]["rank"] == 1 and origin["evidence"]["ranks"] == [1]
    for r in range(WORLD):
        assert res[r]["skipped"] == 1 and res[r]["unchanged"]


def test_fsdp2_without_aggregation_the_ranks_fork(runs):
    """The control: deciding on local values, only rank 1 skips; its shard and rank 0's now
    belong to two different models. This is what aggregation prevents."""
    res = _ok(runs["fsdp_nan_local"])
    assert [res[r]["skipped"] for r in range(WORLD)] == [0, 1]


def test_swap_decided_on_global_attention_statistics_happens_on_both_ranks(runs):
    res = _ok(runs["swap"])
    assert repr(res[0]["events"]) == repr(res[1]["events"])  # NaN values compare equal
    swaps = [e for e in res[0]["events"] if e["kind"] == "action"]
    assert len(swaps) == 1 and swaps[0]["labels"]["layer"] == "b"
    for r in range(WORLD):
        assert res[r]["stabilized"] and res[r]["other_layer"] is None
    for name, p in res[0]["params"].items():
        assert torch.equal(p, res[1]["params"][name]), name
    local = _ok(runs["swap_local"])
    assert [local[r]["stabilized"] for r in range(WORLD)] == [False, True]  # the control


def test_sharded_power_iteration_matches_single_process_and_svd(runs):
    res = _ok(runs["sharded_sigma"])
    assert torch.equal(res[0]["first"], res[1]["first"])  # the same estimates on every rank
    assert torch.equal(res[0]["converged"], res[1]["converged"])
    full = _sigma_weights()
    single = ShardedPowerIteration(iters=3).step([*_sigma_blocks(full), MatrixBlock(full[1], 3)])
    torch.testing.assert_close(res[0]["first"], single, rtol=1e-5, atol=0)
    want = []
    for i, g, d, a, b in [*SIGMA_BLOCKS, (1, 3, 0, 0, None)]:
        w = full[i].double().narrow(d, a, (b or full[i].shape[d]) - a)
        heads = w.split(w.shape[d] // g, dim=d)
        want += [torch.linalg.matrix_norm(h, ord=2) for h in heads]
    torch.testing.assert_close(res[0]["converged"].double(), torch.stack(want), rtol=1e-4, atol=0)
    # weights of 1e-30 (||A u||^2 underflows float32 without the shared power-of-two scale)
    tiny = res[0]["tiny"].double() * 1e30
    torch.testing.assert_close(tiny, torch.stack(want[: tiny.numel()]), rtol=1e-4, atol=0)
    assert torch.equal(res[0]["tiny"], res[1]["tiny"])


def test_a_probe_failing_on_one_rank_at_a_flush_does_not_break_the_others(runs):
    r0, r1 = _ok(runs["probe_fails"])
    assert r0["errors"] == {} and r1["errors"] == {"activations": 1}
    assert r0["steps"] == r1["steps"] == [0, 1, 2, 3]
    # the 2nd flush (step 1) aggregates rank 0's rows alone: the global value is still there
    assert all(v is not None for v in r0["absmax"])


def test_a_layer_that_runs_on_one_rank_is_recorded_on_every_rank(runs):
    r0, r1 = _ok(runs["layer_on_one_rank"])
    assert r0["errors"] == r1["errors"] == {}
    assert r0["max_logit_b"] == r1["max_logit_b"] and None not in r0["max_logit_b"]
    # the global count, as the other statistics are (it was each rank's own: 0 and 1)
    assert (r0["calls_b"], r1["calls_b"]) == (1.0, 1.0)
    assert r0["acts"] == r1["acts"] and "b" in r0["acts"]


def test_ranks_configured_differently_are_refused_at_attach(runs):
    results = runs["config_mismatch"]
    for res in results:
        assert "configured differently" in res["error"] and "ranks [1] differ" in res["error"]
        assert not res["attached"] and res["hooks_kept"]


def test_rules_and_selections_that_differ_between_ranks_are_refused_at_attach(runs):
    for res in _ok(runs["rule_mismatch"]):
        assert len(res["errors"]) == 3
        assert all("configured differently" in e and "ranks [1] differ" in e for e in res["errors"])


def test_statistics_that_cannot_combine_stay_local_and_a_nan_on_one_rank_does_not_hang(runs):
    results = _ok(runs["layouts_differ"])
    for rank, res in enumerate(results):
        assert not any(res["errors"].values()), res["errors"]
        assert [s for s, _ in res["snaps"]] == [0, 1, 2]
        for (_, got), want in zip(res["snaps"], res["norms"], strict=True):
            assert math.isnan(got) if math.isnan(want) else got == pytest.approx(want, rel=1e-6)
        assert res["nonfinite"] == ([1] if rank == 1 else [])


def test_a_new_attach_rebuilds_the_rows_roles(runs):
    for res in _ok(runs["reattach_unfrozen"]):
        assert not any(res["errors"].values()), res["errors"]
        for got, want in res["norms"]:
            assert got == pytest.approx(want, rel=1e-6)


def test_a_layer_unfrozen_while_attached_is_aggregated_from_its_next_step(runs):
    for res in _ok(runs["unfrozen_while_attached"]):
        assert not any(res["errors"].values()), res["errors"]
        for got, want in res["norms"]:
            assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("name", ["join", "join_accumulate"])
def test_uneven_inputs_under_join_stop_aggregating_instead_of_hanging(runs, name):
    """Rank 0 runs out of inputs after 2 steps: without the monitor's join hook, rank 1's next
    collectives would wait for it until the group's timeout. Both ranks stop aggregating from
    step 2: values up to step 1 are global (the mean loss, both ranks' activations), later
    ones rank 1's own."""
    r0, r1 = _ok(runs[name])
    assert r0["errors"] == r1["errors"] == {}
    assert r0["rejoined"] is None and r1["rejoined"] is None
    mean = [(a + b) / 2 for a, b in zip(r0["again"], r1["again"], strict=True)]
    assert r0["again_flushed"] == r1["again_flushed"] == pytest.approx(mean, rel=1e-12)
    assert (r0["steps"] - 2, r1["steps"] - 2) == (2, 4)
    assert r0["joined_step"] == r1["joined_step"] == 2
    assert r0["flushed"] == r1["flushed"][:2]
    per_rank = r1["flushed"][2][2]
    for step, loss, numel in r1["flushed"]:
        if step < 2:
            assert loss == pytest.approx((r0["losses"][step] + r1["losses"][step]) / 2, rel=1e-12)
            assert numel == 2 * per_rank
        else:
            assert loss == pytest.approx(r1["losses"][step], rel=1e-12)
            assert numel == per_rank
    assert [s for s, *_ in r1["flushed"]] == [0, 1, 2, 3]


def test_after_a_join_a_rank_without_a_log_logs_its_own_values_and_events(runs):
    """Once rank 0 ran out of inputs, rank 1 trained on alone on its own values, with no log
    and no console (rank 0's): its NaN at step 3 and the update it skipped were logged nowhere."""
    r0, r1 = _ok(runs["join_logs"])
    assert r0["errors"] == r1["errors"] == {}
    assert Path(r0["jsonl"]).name == "join_logs.jsonl"
    assert [(rec["rank"], rec["step"]) for rec in r0["log"]] == [(0, 0), (0, 1)]
    assert Path(r1["jsonl"]).name == "join_logs.rank1.jsonl"  # the path has no {rank}
    assert [(rec["rank"], rec["step"]) for rec in r1["log"]] == [(1, 2), (1, 3)]
    assert [(e["step"], e["kind"], e["message"]) for e in r1["log"][1]["events"]] == [
        (3, "nonfinite", "[nonfinite] NaN/Inf in the step's gradients or loss (nan)"),
        (3, "action", "skip_step: skipped the optimizer update of step 3 (rule nonfinite)"),
        (
            3,
            "nonfinite",
            "NaN/Inf first seen in the forward output of module 'a.qkv' (forward) at step 3",
        ),
    ]
    lines = [line.split(" | ")[0] for line in r1["console"].splitlines()]
    assert [line for line in lines if line.startswith("numwatch ")] == [
        "numwatch rank 1 step 2",
        "numwatch rank 1 step 3",
    ]
    assert "skip_step: skipped the optimizer update of step 3" in r1["console"]
    assert f"numwatch: rank 1 logs its own values to {r1['jsonl']} from step 2 on" in r1["console"]


def test_a_monitor_attached_on_one_rank_only_raises_instead_of_hanging(runs):
    r0, r1 = _ok(runs["attach_alone"])
    assert "1 of 2 ranks attached a monitor" in r0["raised"] and r1["raised"] == ""
    assert 1.0 <= r0["waited"] < 10 and r0["hooks_kept"]
    # the next attach of both ranks lines up (the timed-out count was taken back): global rows
    assert r0["numel"] == r1["numel"] == 2 * 3 * T * 1


def test_first_nonfinite_is_compared_by_place_in_its_step_across_ranks(runs):
    for res in _ok(runs["nan_uneven_counts"]):
        assert res["errors"] == {}
        (event,) = res["events"]
        assert event["evidence"]["rank"] == 1 and event["evidence"]["ranks"] == [0, 1]
        assert "module 'a'" in event["message"], event


def test_a_disabled_monitor_in_join_does_not_wait_for_flags(runs):
    r0, r1 = _ok(runs["join_disabled"])
    assert r0["steps"] == r1["steps"] == 0


def test_scenarios_are_fast(runs):
    for name, results in runs.items():
        assert max(r["seconds"] for r in results) < 30, name


def test_a_default_run_name_is_rank_0s_on_every_rank(runs):
    results = _ok(runs["default_name"])
    assert [r["run_name"] for r in results] == ["run-20261201T000000Z"] * 2
    assert [Path(r["jsonl"]).name for r in results] == [
        "run-20261201T000000Z.rank0.jsonl",
        "run-20261201T000000Z.rank1.jsonl",
    ]


def test_a_local_monitor_on_one_fsdp_rank_issues_no_collective(runs):
    results = _ok(runs["fsdp_one_rank_local"])
    assert [r["steps"] for r in results] == [3, 3]
    assert results[0]["weights"] == []  # sharded weights are left out without aggregation


def test_the_rank_is_read_at_attach(monkeypatch, tmp_path):
    """A Monitor made before init_process_group (mp.spawn sets no RANK) took rank 0 on every
    rank: all of them wrote rank 0's log and printed to the console."""
    import numwatch.monitor as nm

    monkeypatch.setattr(nm, "get_rank", lambda: 0)
    monitor = numwatch.Monitor(
        nn.Linear(2, 1), sinks__console__enabled=False,
        sinks__jsonl__path=str(tmp_path / "log.rank{rank}.jsonl"), distributed__jsonl="per_rank",
    )  # fmt: skip
    monkeypatch.setattr(nm, "get_rank", lambda: 1)  # the process group started meanwhile
    monitor.attach()
    assert monitor.rank == 1 and monitor.jsonl_path.endswith("log.rank1.jsonl")
    monitor.detach()


def test_qk_clip_scales_the_local_shards_of_fsdp_weights(runs):
    from numwatch.actions.library import qk_clip

    res = _ok(runs["fsdp_qk_clip"])
    torch.manual_seed(0)
    full = Net()  # the same initial weights as _fsdp_net's
    before = {n: p.detach().clone() for n, p in full.a.qkv.named_parameters()}
    qk_clip(full, "a", 1, 400.0, 100.0)
    for name, p in full.a.qkv.named_parameters():
        assert not torch.equal(p, before[name])  # the head's rows changed
        for r in res:
            assert torch.equal(r[name], p.detach()), name


def test_a_callback_action_given_as_a_callable_agrees_across_ranks(runs):
    assert [r["active"] for r in _ok(runs["callable_callback"])] == [True, True]


def test_a_gradient_probe_failing_once_on_one_rank_keeps_the_flush_aggregated(runs):
    r0, r1 = _ok(runs["grad_probe_fails_once"])
    assert r0["errors"] == {} and r1["errors"] == {"gradients": 1}
    assert r0["combined"] and r1["combined"]
    assert r0["loss"] == r1["loss"] == 50.5  # the global mean, on both ranks
    assert r0["grad_norm"] == r1["grad_norm"] is not None


def test_a_step_without_backward_does_not_reuse_the_last_steps_norm(runs):
    for res in _ok(runs["step_without_backward"]):
        assert res["skipped"] == [
            "skip_step: skipped the optimizer update of step 0 (rule nonfinite)"
        ]
        assert {step for step, _ in res["events"]} == {0}


def test_a_monitor_attaches_again_on_a_new_process_group(runs):
    r0, r1 = _ok(runs["new_group_between_attaches"])
    assert r0["errors"] == r1["errors"] == {}
    assert r0["absmax"] == r1["absmax"] == 2.0  # aggregated: rank 1's 2s, rank 0's zeros


def test_a_group_started_after_attach_is_not_aggregated_over(monkeypatch, caplog):
    """mp.spawn workers that init the group after attach: every rank had read rank 0 (labels,
    ports, logs), yet the flushes went collective without the attach-time agreement."""
    import numwatch.distributed as nd

    monitor = numwatch.Monitor(
        Net(), flush_every=1, sinks__console__enabled=False, sinks__jsonl__enabled=False
    ).attach()
    monkeypatch.setattr(nd, "is_initialized", lambda: True)
    monkeypatch.setattr(nd.dist, "get_world_size", lambda group=None: 2)
    assert monitor._dist.configured and not monitor._dist.active
    assert not monitor._dist.active
    monitor.step()  # a flush: local, no collective
    assert monitor._dist.collectives == 0
    warned = [r for r in caplog.records if "started after attach()" in r.getMessage()]
    assert len(warned) == 1
    monkeypatch.undo()
    monitor.detach()


def test_a_loss_passed_on_one_rank_only_is_that_ranks_loss_on_every_rank(runs):
    r0, r1 = _ok(runs["loss_rank0"])
    own = r0["losses"]
    # per flush of two steps: (loss, loss_mean, loss_max), all rank 0's
    want = [
        own[1],
        (own[0] + own[1]) / 2,
        max(own[:2]),
        own[3],
        (own[2] + own[3]) / 2,
        max(own[2:]),
    ]
    for res in (r0, r1):
        assert [v for flushed in res["flushed"] for v in flushed] == pytest.approx(want, rel=1e-12)
        assert res["actions"] == [1]  # the back-off on both ranks, at the same flush
    assert torch.equal(r0["params"], r1["params"])  # the replicas did not fork


def test_a_step_rule_on_the_loss_reads_the_ranks_mean_loss_and_skips_on_both(runs):
    r0, r1 = _ok(runs["loss_skip"])
    mean = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"], strict=True)]
    assert mean[0] < 5.0 < mean[1]  # step 1 only: 30 + 1 on rank 0, 40 + 4 on rank 1 (approx.)
    for res in (r0, r1):
        assert [s for s, _ in res["fired"]] == [1]
        assert res["fired"][0][1] == pytest.approx(mean[1], rel=1e-12)
        assert torch.equal(res["params"][1], res["params"][0])  # step 1's update withheld
        assert not torch.equal(res["params"][2], res["params"][1])
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True))


def test_fsdp1_is_named_unsupported_at_attach_and_fsdp2_is_not(runs):
    for res in _ok(runs["fsdp1_warns"]):
        warned = res["warned"]
        assert warned.pop("fsdp2") == []
        assert len(warned) == 4
        for messages in warned.values():
            assert len(messages) == 1
            assert "FSDP2 (torch.distributed.fsdp.fully_shard)" in messages[0]
            assert "grad_norm cover one rank's shard" in messages[0]
