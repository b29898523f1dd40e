"""Optimizer probe: how the update compares with the weight, absorbed updates, loss scale.

On sampled optimizer steps the probe keeps a copy of the parameters before the update and
measures, per parameter, RMS(update) / RMS(weight) and the fraction of elements whose weight did
not change although their gradient was non-zero: updates smaller than half an ULP of the weight
are absorbed by rounding, so a bf16 weight stops learning without any error. With a GradScaler
it also reports the loss scale and how often it dropped (overflow steps). A fused optimizer is
called on an overflow step too, handed the scaler's ``found_inf``, and skips the update itself:
that step is measured as no update (decided on the device, without a host read).

The update of a step happens after that step closed (and maybe flushed), so a flush reports the
latest update measured before it: at a step-closing flush, the previous step's.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from numwatch.buffers import nonfinite_counts
from numwatch.config import OptimizerProbeConfig
from numwatch.distributed import local_tensor
from numwatch.hooks import UserHook, after_first_closure_call, remove_step_pre_hook
from numwatch.kernels import tensor_stats as ts
from numwatch.kernels.host_copy import to_device
from numwatch.probes.base import ProbeContext, gathering_device
from numwatch.snapshot import MetricRecord

__all__ = ["OptimizerProbe", "numeric_lr"]

_TINY = torch.finfo(torch.float64).tiny


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real and imaginary parts (a view): the norms are the same, and
    each part counts as one element in the absorbed fraction."""
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def _sum_sq(stats: torch.Tensor) -> torch.Tensor:
    """Sum of squares per row of ``tensor_stats``, +inf where a value was not finite (the
    kernel's sums skip those)."""
    return torch.where(nonfinite_counts(stats) > 0, math.inf, stats[:, ts.SUMSQ])


def numeric_lr(lr: object) -> bool:
    """A learning rate that can be read and scaled: a real number or a tensor, not the None of
    an optimizer that computes its own step size (Adafactor(lr=None, relative_step=True))."""
    return isinstance(lr, numbers.Real | torch.Tensor)


def _given_name(group: dict, i: int) -> str | None:
    given = group.get("param_names")
    return str(given[i]) if isinstance(given, list) and i < len(given) else None


class OptimizerProbe:
    component = "optimizer"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: OptimizerProbeConfig,
        ctx: ProbeContext,
        scaler: Any = None,
        drops: torch.Tensor | None = None,
    ) -> None:
        """``drops``: the loss-scale drops counted by an earlier attach (a counter goes on)."""
        self.cfg = cfg
        self.ctx = ctx
        self.optimizer = optimizer
        self.scaler = scaler
        self.model = model
        self._model_names = {id(p): n for n, p in model.named_parameters()}
        self.params: list[tuple[str, torch.Tensor]] = []
        self._handles: list[Any] = []
        self._updates = 0
        self._before: list[torch.Tensor] | None = None
        self._grads: list[torch.Tensor] = []  # signs of the measured parameters' gradients
        self._taken: list[int] = []
        self._cursor = 0  # the next parameter to measure (rotating sample)
        # (n, 4) float64 of each parameter's latest sampled update: sum of update^2, of
        # weight^2, number of elements with a non-zero gradient, and of those whose weight moved
        self._sums: torch.Tensor | None = None
        self._scale_prev: torch.Tensor | None = None
        self._index_cache: dict[tuple[Any, ...], torch.Tensor] = {}
        self.drops: torch.Tensor | None = drops
        # parameters measured since the last flush: only they are reported (a model larger
        # than max_bytes is measured in rotation)
        self._fresh: set[int] = set()
        self._add_params()

    def _add_params(self) -> None:
        """Label the optimizer's parameters not labelled yet, after those that are (their rows
        of ``_sums`` stay theirs). A parameter outside the model takes the name the optimizer
        was given (named parameters), unless a model parameter or an earlier one has it (two
        series under one label)."""
        known = {id(p) for _, p in self.params}
        taken = set(self._model_names.values()) | {name for name, _ in self.params}
        for g, group in enumerate(self.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) in known:
                    continue
                name = self._model_names.get(id(p))
                if name is None:
                    given = _given_name(group, i)
                    name = given if given is not None and given not in taken else f"group{g}.{i}"
                    taken.add(name)
                known.add(id(p))
                self.params.append((name, p))
        if self._sums is not None and len(self.params) > len(self._sums):
            grown = self._sums.new_full((len(self.params), 4), float("nan"))
            grown[: len(self._sums)] = self._sums
            self._sums = grown

    def _sync_params(self) -> None:
        """Parameter groups added since attach (``add_param_group``: a head unfrozen later) are
        measured from their first sampled update on; a parameter the optimizer no longer holds
        is no longer measured."""
        held = [p for group in self.optimizer.param_groups for p in group["params"]]
        if len(held) == len(self.params) and all(
            p is q for p, (_, q) in zip(held, self.params, strict=True)
        ):
            return
        ids = {id(p) for p in held}
        if any(id(p) not in ids for _, p in self.params):  # removed: labels and rows anew
            self.params, self._sums = [], None
            self._fresh.clear()
            self._index_cache.clear()
            self._cursor = 0
        # a module added to the model since (a new head) has its path for a name
        self._model_names = {id(p): n for n, p in self.model.named_parameters()}
        self._add_params()

    def attach(self) -> None:
        self._handles = [
            self.optimizer.register_step_pre_hook(UserHook(self._pre)),
            self.optimizer.register_step_post_hook(UserHook(self._post)),
        ]

    def detach(self) -> None:
        for h in self._handles:
            remove_step_pre_hook(self.optimizer, h)
        self._handles.clear()

    def _pre(self, _optimizer: Any, args: tuple, kwargs: dict) -> Any:
        # step(closure) makes the gradients inside: keep the weights and the gradients' signs
        # once its first call has made them (the weights do not move before the update); taken
        # here, they were the previous step's signs (none at the first step)
        wrapped = after_first_closure_call(args, kwargs, self._keep_before_guarded)
        if wrapped is None:
            self._keep_before_guarded()
        return wrapped

    def _keep_before_guarded(self, _loss: Any = None) -> None:
        self.ctx.guard.run(self.component, self._keep_before)

    def _post(self, *_: Any) -> None:
        # GradScaler hands a fused optimizer (_step_supports_amp_scaling) found_inf for the step
        found_inf = getattr(self.optimizer, "found_inf", None)
        self.ctx.guard.run(self.component, self._measure, found_inf)

    @torch.no_grad()
    def _keep_before(self) -> None:
        self._before, self._grads = None, []
        if self._updates % self.cfg.every:
            return
        self._sync_params()
        # Copy at most max_bytes of parameters, continuing where the last sample stopped, so a
        # large model is covered over several samples without a model-sized memory spike.
        n = len(self.params)
        taken, size = [], 0
        for k in range(n):
            i = (self._cursor + k) % n
            p = self.params[i][1]
            # a sparse gradient (nn.Embedding(sparse=True)) has no dense sign mask: not measured
            if p.grad is None or p.grad.layout is not torch.strided or not p.numel():
                continue
            nbytes = p.numel() * p.element_size()
            if taken and size + nbytes > self.cfg.max_bytes:
                break
            taken.append(i)
            size += nbytes
        self._cursor = (taken[-1] + 1) % n if taken else self._cursor
        self._taken = sorted(taken)
        # x * 1 is x bit for bit (signed zeros and infinities too): one multi-tensor op where a
        # clone per parameter cost ~10 µs of host time each
        params = [_real(local_tensor(self.params[i][1]).detach()) for i in self._taken]
        self._before = torch._foreach_mul(params, 1.0) if params else None
        # The signs of the gradients the update is made of (all the measurement needs), taken
        # here: an optimizer may free (p.grad = None) or zero them inside step().
        grads = [_real(local_tensor(self.params[i][1].grad)) for i in self._taken]
        self._grads = torch._foreach_sign(grads) if grads else []

    @torch.no_grad()
    def _measure(self, found_inf: torch.Tensor | None) -> None:
        """``found_inf``: non-zero when the optimizer skipped this update (a scaler overflow)."""
        self._updates += 1  # a skipped update too: knowing it would take a host read
        if self._before is None or not self._taken:
            return
        # FSDP2 parameters are DTensors: each rank measures its shard; the per-parameter sums
        # below add up across ranks at flush (numwatch/distributed.py, key 'opt/sums').
        params = [_real(local_tensor(self.params[i][1]).detach()) for i in self._taken]
        grads = self._grads
        updates = torch._foreach_sub(params, self._before)
        self._before, self._grads = None, []
        taken = self._taken
        if len(set(map(torch.Tensor.get_device, params))) == 1:
            sums = self._update_sums(params, grads, updates)
        else:  # a model split over devices: one statistics call per device, gathered on one
            groups: dict[torch.device, list[int]] = {}
            for j, p in enumerate(params):
                groups.setdefault(p.device, []).append(j)
            target = gathering_device(groups)
            parts = []
            for js in groups.values():
                part = self._update_sums(*([x[j] for j in js] for x in (params, grads, updates)))
                parts.append(part.to(target, non_blocking=True))
            sums = torch.cat(parts)
            taken = [taken[j] for js in groups.values() for j in js]
        index = self._index(sums.device, taken)
        if self._sums is None or self._sums.device != sums.device:
            n = len(self.params)
            self._sums = torch.full((n, 4), float("nan"), dtype=torch.float64, device=sums.device)
        if found_inf is not None:  # no update: the rows keep the window's latest one (NaN: none)
            skipped = torch.as_tensor(found_inf, device=sums.device) != 0
            sums = torch.where(skipped, self._sums.index_select(0, index), sums)
        self._sums.index_copy_(0, index, sums)  # each parameter keeps its latest measurement
        self._fresh.update(taken)

    def _update_sums(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], updates: list[torch.Tensor]
    ) -> torch.Tensor:
        """(n, 4) sums of tensors on one device: update^2, weight^2, elements with a non-zero
        gradient and, of those, elements whose weight moved. ``grads``: the gradients' signs.
        Consumes ``updates``."""
        # Per-parameter sums from the fused statistics kernel (one launch per list): a
        # _foreach_norm returns one tensor per parameter, which made four of them and their
        # stacks most of this probe's host time.
        stats = functools.partial(ts.tensor_stats, underflow_dtype=None, backend=self.ctx.backend)
        u, w, g = stats(updates), stats(params), stats(grads)
        # u * sign(g) is u exactly where g != 0 and 0 where g == 0: its zeros are the elements
        # without a gradient or whose weight did not change (``grads`` are the signs already)
        torch._foreach_mul_(updates, grads)
        both = stats(updates)
        moved = g[:, ts.NUMEL] - g[:, ts.ZERO]
        # a NaN gradient's sign is 0 and its update NaN: the fraction is not defined (NaN);
        # counted as it came it read -numel
        nonfinite = u[:, ts.NAN] + u[:, ts.POSINF] + u[:, ts.NEGINF]
        moved = torch.where(nonfinite > 0, float("nan"), moved)
        changed = both[:, ts.NUMEL] - both[:, ts.ZERO]
        return torch.stack([_sum_sq(u), _sum_sq(w), moved, changed], dim=1)

    def _index(self, device: torch.device, taken: list[int]) -> torch.Tensor:
        """The measured parameters' positions on the device; the rotation repeats, so a few
        cached index tensors serve every sample after the first round."""
        key = (device, tuple(taken))
        index = self._index_cache.get(key)
        if index is None:
            if len(self._index_cache) > 64:
                self._index_cache.clear()
            index = self._index_cache[key] = to_device(taken, torch.long, device)
        return index

    def on_step(self) -> None:
        """The loss scale, read at every step close: GradScaler skips a non-fused optimizer's
        step() on an overflow step, so a run of overflows (the scale collapsing) passes no
        optimizer hook."""
        self._loss_scale()

    def _loss_scale(self) -> None:
        scaler = self.scaler
        if scaler is None or not scaler.is_enabled() or getattr(scaler, "_scale", None) is None:
            return
        scale = scaler._scale.detach().double().reshape(())
        if self._scale_prev is not None:
            dropped = (scale < self._scale_prev).double()
            self.drops = dropped if self.drops is None else self.drops + dropped
        elif self.drops is None:
            self.drops = torch.zeros_like(scale)
        self._scale_prev = scale.clone()

    def device_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        if self._sums is not None and self._fresh:  # no sample since: no repeated values
            out["opt/sums"] = self._sums
        if self._scale_prev is not None:
            out["opt/scale"], out["opt/drops"] = self._scale_prev, self.drops
        return out

    def records(self, host: Mapping[str, torch.Tensor]) -> list[MetricRecord]:
        out = [
            MetricRecord("optimizer_lr", {"group": str(g)}, float(group["lr"]))
            for g, group in enumerate(self.optimizer.param_groups)
            if numeric_lr(group.get("lr"))
        ]
        if "opt/sums" in host:
            sums = host["opt/sums"].tolist()
            for i in sorted(self._fresh):
                u_sq, w_sq, moved, changed = sums[i]
                if math.isnan(changed):  # no update in the window (overflows): a count otherwise
                    continue
                labels = {"param": self.params[i][0]}
                ratio = math.sqrt(u_sq / max(w_sq, _TINY))  # RMS ratio = norm ratio
                out.append(MetricRecord("optimizer_update_ratio", labels, ratio))
                absorbed = (moved - changed) / max(moved, 1.0)
                out.append(MetricRecord("optimizer_absorbed_fraction", labels, absorbed))
        if "opt/scale" in host:
            out.append(MetricRecord("loss_scale", {}, float(host["opt/scale"])))
            out.append(MetricRecord("loss_scale_drops_total", {}, float(host["opt/drops"])))
        return out

    def reset(self) -> None:
        """Values are the latest sampled update's; nothing accumulates between flushes. The rows
        go back to NaN: a skipped update keeps a row as it is, which must not report the
        previous window's update again."""
        self._fresh = set()
        if self._sums is not None:
            self._sums.fill_(float("nan"))
