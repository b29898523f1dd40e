"""Tensor probe: statistics of gradients (per parameter) and forward outputs (per module).

Gradients are read at step time, after every backward of the step has accumulated into
``.grad``; post-accumulate-grad hooks only learn the backward order (used to name the first
parameter whose gradient went non-finite), on one step per flush window. Forward outputs are
read in forward hooks that exist on sampled steps only. Either way the statistics end up in
device-side tables; the host reads them at flush.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import cache, partial
from itertools import repeat
from operator import attrgetter
from typing import Any

import torch
from torch import nn

from numwatch.buffers import (
    SETTLE_STEPS,
    DeviceTables,
    nonfinite_counts,
    reduce_by_index,
    reduce_steps,
)
from numwatch.config import ActivationConfig, GradientConfig
from numwatch.distributed import is_dtensor, local_tensor
from numwatch.hooks import UserHook, outside_graphs
from numwatch.kernels import tensor_stats as ts
from numwatch.kernels.host_copy import to_device
from numwatch.probes.base import ProbeContext
from numwatch.selection import parameter_state, select_modules, select_parameters
from numwatch.snapshot import MetricRecord

__all__ = [
    "ActivationProbe",
    "GradientProbe",
    "gradients_flag",
    "stat_records",
    "table_records",
]

log = logging.getLogger("numwatch")


_STAT_METRICS = (
    "numel",
    "absmax",
    "min",
    "max",
    "mean",
    "rms",
    "nan",
    "posinf",
    "neginf",
    "nonfinite",
    "zeros",
    "zero_fraction",
    "subnormal",
    "underflow_fraction",
    "headroom",
)


@cache
def _metric_names(prefix: str) -> tuple[str, ...]:
    return tuple(f"{prefix}_{k}" for k in _STAT_METRICS)


_make_record = MetricRecord._make  # tuple.__new__ over an iterable: no keyword parsing


@cache
def _dtype_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def stat_records(
    prefix: str,
    label: str,
    name: str,
    row: torch.Tensor | Sequence[float],
    dtype: torch.dtype | None,
    headroom: float | None = None,
) -> list[MetricRecord]:
    """Metrics ``{prefix}_*`` of one host-side stat row (see README, 'Metric reference').
    ``headroom``: measured per tensor (outputs of several dtypes); else absmax over ``dtype``'s
    largest finite value.

    A flush turns every row of every table into these records (GPT-2: ~2,200 per flush), so
    this is written for the host's speed: one label dict per row, names built once."""
    r = row.tolist() if isinstance(row, torch.Tensor) else row
    numel = r[ts.NUMEL]
    nonfinite = r[ts.NAN] + r[ts.POSINF] + r[ts.NEGINF]
    finite = numel - nonfinite
    zeros = r[ts.ZERO]
    nonzero_finite = finite - zeros
    values = (  # in _STAT_METRICS order
        numel,
        r[ts.ABSMAX],
        r[ts.MIN],
        r[ts.MAX],
        r[ts.SUM] / finite if finite else math.nan,
        math.sqrt(r[ts.SUMSQ] / finite) if finite else math.nan,
        r[ts.NAN],
        r[ts.POSINF],
        r[ts.NEGINF],
        nonfinite,
        zeros,
        zeros / numel if numel else 0.0,
        r[ts.SUBNORMAL],
        r[ts.UNDERFLOW] / nonzero_finite if nonzero_finite else 0.0,
        headroom
        if headroom is not None
        else r[ts.ABSMAX] / _dtype_max(dtype)
        if dtype is not None
        else math.nan,
    )
    return list(map(_make_record, zip(_metric_names(prefix), repeat({label: name}), values)))


def table_records(
    prefix: str,
    label: str,
    named: Sequence[tuple[str, Any]],
    merged: torch.Tensor | None,
    dtypes: Mapping[int, torch.dtype],
    headroom: Sequence[float] | None = None,
) -> list[MetricRecord]:
    """``stat_records`` of every row of a merged host table that saw values. A row this process
    never measured (other ranks' values after aggregation: a module that ran there only) has no
    dtype here: its headroom is NaN, unless ``headroom`` (per row, measured) has it."""
    if merged is None:
        return []
    out: list[MetricRecord] = []
    for i, ((name, _), row) in enumerate(zip(named, merged.tolist(), strict=True)):
        if row[ts.NUMEL] > 0:
            h = headroom[i] if headroom is not None else None
            out += stat_records(prefix, label, name, row, dtypes.get(i), h)
    return out


def _norm_sq(stats: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """Squared norm over the rows of ``stats`` (..., n, N_STATS); NaN where a row has a
    non-finite count in ``bad`` (..., n), as clip_grad_norm_ would report it."""
    return stats[..., ts.SUMSQ].sum(-1).masked_fill(bad.sum(-1) > 0, math.nan)


def _nonfinite_flag(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """() float64: 0 where every tensor is finite, NaN where one is not (None: no tensors).
    Added to a squared norm, it makes it NaN without changing its value. Each tensor's largest
    magnitude, which cannot overflow where a sum of squares can: one multi-tensor launch per
    device and dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    flag = None
    for (_, dtype), group in groups.items():
        if dtype.itemsize == 1:  # float8: no norm kernel; bfloat16 holds its values
            group = [t.to(torch.bfloat16) for t in group]
        absmax = torch.stack(torch._foreach_norm(group, math.inf)).max()  # NaN, inf propagate
        part = absmax.to(torch.float64) * 0.0  # inf * 0 and NaN * 0 are NaN
        flag = part if flag is None else flag + part.to(flag.device, non_blocking=True)
    return flag


def gradients_flag(params: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """``_nonfinite_flag`` of the gradients of ``params`` that have values to measure (a
    DTensor's: its local shard); None where none has."""
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    return _nonfinite_flag([g for g in grads if _usable(g) is not None])


_GRAD = attrgetter("grad")
# The power of the loss scale that a stat column of scaled gradients holds (counts: none)
_SCALE_POWERS = {ts.ABSMAX: 1, ts.MIN: 1, ts.MAX: 1, ts.SUM: 1, ts.SUMSQ: 2}
# Measured forwards a device holds before they are merged into the table (forwards that close no
# step, as validation, generate() or an inference loop run, merged one per forward otherwise);
# also the measurements outside any forward that wait for their order numbers
_FOLD_AT = 64


def _usable(g: torch.Tensor | None) -> torch.device | None:
    """The device of a gradient with values to measure, else None."""
    return g.device if g is not None and _floating(g) else None


# Dtypes the statistics kernels read: packed sub-byte floats (float4_e2m1fn_x2) and complex
# numbers are not among them.
_MEASURABLE_DTYPES = frozenset(
    d
    for d in (
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        *(getattr(torch, n, None) for n in (
            "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"
        )),
    )
    if d is not None
)  # fmt: skip


def _floating(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(t,)`` if the statistics kernels can read ``t`` (a measurable floating dtype, with
    values, strided), else ``()``. Sparse tensors are left out: an uncoalesced one
    (nn.Embedding(sparse=True)'s gradient) repeats indices, so its values' extremes and sum of
    squares are not the tensor's, and coalescing it reads its size back to the host. Nested
    tensors (nn.TransformerEncoder's fast path) report a strided layout but cannot be
    flattened. Tensors of a torch.func
    transform (vmap, grad: per-sample gradients through the model) are the transform's own: a
    statistic would read batched values as one tensor, and vmap refuses the kernels' reads."""
    ok = (
        t.layout is torch.strided
        and not t.is_nested
        and t.dtype in _MEASURABLE_DTYPES
        and t.numel() > 0
        and not t.is_meta
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
    )
    return (t,) if ok else ()


def _floating_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a (nested) module output; ``_floating`` says which are statistics."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _floating_tensors(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from _floating_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _floating_tensors(getattr(obj, field.name, None))


def _unmeasured_kind(t: torch.Tensor) -> str | None:
    """Why a tensor with values that ``_floating`` refuses is left out, when a user would
    expect it measured (complex, a floating dtype the kernels do not read, sparse); None for
    the tensors that are not statistics anyway (integer, boolean, empty, meta, nested)."""
    if t.is_nested or t.is_meta or not t.numel() or not (t.is_complex() or t.is_floating_point()):
        return None
    kind = f"{type(t).__name__} of {t.dtype}"
    if t.layout is not torch.strided:  # sparse (see _floating)
        return f"{t.layout} {kind}"
    return None if t.dtype in _MEASURABLE_DTYPES else kind


class GradientProbe:
    """Per-parameter statistics of the accumulated gradient, once per (sampled) step.

    The per-step cost is host time on the training's critical path, so a step only issues the
    fused statistics launch and keeps its result; the merge into the table, the non-finite
    search and the gradient norms run batched at flush (or every ``SETTLE_STEPS`` steps, which
    bounds the memory held). Post-accumulate-grad hooks learn the backward order (which names
    the first non-finite gradient) on the first step and on the first step after each flush
    only: a Python hook per parameter per step would cost more than the statistics.

    ``every_step`` (a step-level rule is configured: skip_step) measures every step whatever
    ``cfg.every``: the rule needs each step's gradient norm, and the fused statistics launch
    that gives it is all a sampled step issues (the merge into the table is batched), so the
    step is measured in full; its non-finite gradients are then also named at flush.
    """

    component = "gradients"

    def __init__(
        self, model: nn.Module, cfg: GradientConfig, ctx: ProbeContext, every_step: bool = False
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        # weakly: the order hooks outlive a run dropped without detach (a halt, in a sweep) on
        # tensors the garbage collector cannot free, and through the model's own hooks they
        # would keep its monitor, and its Prometheus port, alive for good
        self._model = weakref.ref(model)
        self._every = 1 if every_step else cfg.every
        self._handles: list[Any] = []
        self._fired: list[int] = []
        self._fired_set: set[int] = set()
        self._unmeasured: set[int] = set()  # ids of parameters whose gradients were reported
        self._check_selection = False  # at the next step: the model's parameters changed?
        self._select("gradients.params")
        # Steps measured since the last settle: [(plan entry, stats, first order number)] each.
        self._pending: list[list[tuple[tuple, torch.Tensor, int]]] = []
        self._norm_sq_last: torch.Tensor | None = None
        self._norm_max: torch.Tensor | None = None
        # (table rows, stats) read at the last closed step: cross-rank gradient norms use them
        self.step_stats: list[tuple[torch.Tensor, torch.Tensor]] = []
        # per device: ((device, address, version) of the loss scale, its unscaling factors)
        self._factors: dict[torch.device, tuple[tuple, torch.Tensor]] = {}

    def _select(self, setting: str | None = None) -> None:
        """Choose the parameters: those that train now. Again at the first step of a flush
        window after the model's parameters changed (weights unfrozen or frozen: gradual
        unfreezing; a module replaced), as the weight probe does at its sampled steps, so that a
        window's table has the same rows for all of its steps, and the steps between pay
        nothing. ``setting``: say which globs match nothing."""
        model = self._model()
        self._param_state = parameter_state(model)
        self.params = select_parameters(model, self.cfg.params, self.cfg.exclude, setting)
        self._tensors = [p for _, p in self.params]
        self._sharded = any(is_dtensor(p) for p in self._tensors)
        self._order: tuple[int, ...] = ()  # backward order learned by the hooks
        self._tables = DeviceTables("grad_table", len(self.params))
        self._plans: dict[tuple, list[tuple]] = {}
        # (number of param groups, the optimizer's parameters this probe does not watch)
        self._unwatched: tuple[int, list[torch.Tensor]] = (-1, [])

    def attach(self) -> None:
        self._arm()

    def detach(self) -> None:
        self._disarm()

    def _arm(self) -> None:
        """Order hooks on the parameters that take gradients now (one frozen since the
        selection refuses a hook); each handle is kept as it is made, so detach removes all."""
        if not self._handles:
            for i, p in enumerate(self._tensors):
                if p.requires_grad:
                    self._handles.append(
                        p.register_post_accumulate_grad_hook(partial(self._on_grad, i))
                    )

    def _disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _on_grad(self, index: int, _param: torch.Tensor) -> None:
        if index not in self._fired_set:
            self._fired_set.add(index)
            self._fired.append(index)

    def on_step(self) -> None:
        """Read every gradient of the closing step (called by Monitor.step, guarded)."""
        if self._check_selection:  # the window's first step: one walk over the parameters
            self._check_selection = False
            model = self._model()
            if model is not None and parameter_state(model) != self._param_state:
                fired = [self._tensors[i] for i in self._fired]
                self._select()
                index = {id(p): i for i, p in enumerate(self._tensors)}
                self._fired = [index[id(p)] for p in fired if id(p) in index]  # backward order
        if self._handles:
            if self._fired and tuple(self._fired) != self._order:
                self._order = tuple(self._fired)
                self._plans.clear()  # plans follow the backward order
            self._fired, self._fired_set = [], set()
            self._disarm()
        self.step_stats = []
        if self.ctx.step % self._every:
            return
        grads = list(map(_GRAD, self._tensors))
        if self._sharded:
            grads = [local_tensor(g) for g in grads]  # FSDP2 (DTensor): the local shard
        # The plan groups the gradients by device; dtypes, sizes and addresses are the kernel
        # wrapper's to check (a gradient's dtype follows its parameter's: torch enforces it).
        # Device indices, not devices: a C-level read that builds no objects (-1 is the CPU and
        # also the meta device, whose gradients never come out of a training step).
        try:
            key = tuple(map(torch.Tensor.get_device, grads))
        except TypeError:  # a parameter got no gradient this step
            key = tuple(None if g is None else g.get_device() for g in grads)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(grads, tuple(_usable(g) for g in grads))
            if len(self._plans) > 16:
                self._plans.clear()
            self._plans[key] = plan
        measured = []
        for entry in plan:
            _, indices, rows, _, names = entry
            # table order: every gradient in order when they all are on this device
            tensors = grads if len(indices) == len(grads) else [grads[i] for i in indices]
            stats = ts.tensor_stats(tensors, self.ctx.underflow_dtype, self.ctx.backend)
            if self.ctx.grad_scale is not None:
                stats = stats * self._unscaling(self.ctx.grad_scale, stats.device)
            first = self.ctx.tracker.reserve("backward", "param", names, self.ctx.step)
            measured.append((entry, stats, first))
            self.step_stats.append((rows, stats))
        if measured:
            self._pending.append(measured)
            if len(self._pending) >= SETTLE_STEPS:
                self.settle()

    def _unscaling(self, scale: torch.Tensor, device: torch.device) -> torch.Tensor:
        """(N_STATS,) float64 factors from the stat rows of gradients multiplied by a GradScaler's
        ``scale`` to those of the true gradients: 1/scale for the extremes and the sum, 1/scale²
        for the sum of squares; counts stay (the subnormal and underflow counts are of the
        gradients as held: the underflow the scale guards against). Made again only when the
        scale changed (GradScaler.update() writes it in place), so a step costs one multiply."""
        key = (device, scale.data_ptr(), scale._version)
        cached = self._factors.get(device)
        if cached is None or cached[0] != key:
            powers = [-float(_SCALE_POWERS.get(i, 0)) for i in range(ts.N_STATS)]
            powers = to_device(powers, torch.float64, device)
            factors = scale.detach().to(device, torch.float64).pow(powers)  # (N_STATS,)
            cached = self._factors[device] = (key, factors)
        return cached[1]

    def _plan(self, grads: list[Any], usable: tuple[Any, ...]) -> list[tuple]:
        """Per device: (device, indices, table rows, rank, names) of the usable gradients in
        table order; rank = place in backward order (closest to the loss first, then gradients
        no hook saw), which orders the search for the first non-finite one. Built once per
        backward order and layout."""
        seen = set(self._order)
        backward = [*self._order, *(i for i in reversed(range(len(self.params))) if i not in seen)]
        rank_of = {i: r for r, i in enumerate(backward)}
        plan = []
        devices = {d for d in usable if d is not None}
        unmeasured = [  # reported once: complex or sparse (see _floating)
            i
            for i, (g, d) in enumerate(zip(grads, usable, strict=True))
            if d is None
            and id(self._tensors[i]) not in self._unmeasured
            and g is not None
            and g.numel()
            and not g.is_meta
        ]
        if unmeasured:
            self._unmeasured.update(id(self._tensors[i]) for i in unmeasured)
            log.warning(
                "numwatch: gradients not measured (their grad_* statistics, grad_norm and the "
                "non-finite search leave them out): %s",
                ", ".join(
                    f"{self.params[i][0]} ({grads[i].layout}, {grads[i].dtype})" for i in unmeasured
                ),
            )
        for device in devices:
            indices = [i for i, d in enumerate(usable) if d == device]
            table = self._tables[device]
            if len(indices) == len(self.params):
                rows = table.full_index()
            else:
                rows = to_device(indices, torch.long, device)
            by_rank = sorted(indices, key=rank_of.__getitem__)
            local = {i: r for r, i in enumerate(by_rank)}
            rank = to_device([float(local[i]) for i in indices], torch.float64, device)
            names = tuple(self.params[i][0] for i in by_rank)
            plan.append((device, indices, rows, rank, names))
        return plan

    @torch.no_grad()
    def settle(self) -> None:
        """Merge the pending steps into the table, the non-finite tracker and the norms (also
        for the monitor, which names a step's NaN/Inf origin before its flush)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        groups: dict[int, list[tuple[int, tuple, torch.Tensor, int]]] = {}
        for k, measured in enumerate(pending):
            for entry, stats, first in measured:
                groups.setdefault(id(entry), []).append((k, entry, stats, first))
        totals: torch.Tensor | None = None
        for items in groups.values():
            device, _, rows, rank, _ = items[0][1]
            stacked = torch.stack([stats for _, _, stats, _ in items])  # (k, n, N_STATS)
            self._tables[device].add_rows(rows, reduce_steps(stacked))
            bad = nonfinite_counts(stacked)  # (k, n)
            firsts = to_device([float(f) for *_, f in items], torch.float64, device)
            orders = rank + firsts[:, None]
            self.ctx.tracker.observe_many(orders.flatten(), bad.flatten())
            sq = _norm_sq(stacked, bad)
            if totals is None:
                totals = torch.zeros(len(pending), dtype=torch.float64, device=device)
            steps = to_device([k for k, *_ in items], torch.long, totals.device)
            if sq.device != totals.device:  # a model split over devices
                sq = sq.to(totals.device, non_blocking=True)
            totals.index_add_(0, steps, sq)
        assert totals is not None
        self._norm_sq_last = totals[-1]
        top = totals.max()  # NaN propagates
        self._norm_max = top if self._norm_max is None else torch.maximum(self._norm_max, top)

    def step_norm_sq(self) -> torch.Tensor | None:
        """Squared global norm of the last step's gradients (NaN if any was non-finite)."""
        if not self.step_stats:
            return None
        total = None
        for _, stats in self.step_stats:
            part = _norm_sq(stats, nonfinite_counts(stats))
            total = part if total is None else total + part.to(total.device, non_blocking=True)
        return total

    def unwatched_flag(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """0, or NaN where a gradient that ``optimizer`` applies and this probe does not watch
        (``gradients.exclude``; a parameter outside the model, as CLIP's logit_scale) is
        non-finite: added to ``step_norm_sq``, a skip_step decision covers every update it
        withholds, which let such a NaN into the weights (and every later step was skipped).
        Device-side: read with the norm, no sync of its own. Gradients the probe leaves
        unmeasured (sparse, complex) are left out here too."""
        groups = optimizer.param_groups
        if self._unwatched[0] != len(groups):  # at the first step, and after add_param_group
            watched = {id(p) for p in self._tensors}
            params = [p for group in groups for p in group["params"] if id(p) not in watched]
            self._unwatched = (len(groups), params)
        return gradients_flag(self._unwatched[1])

    def device_tensors(self) -> dict[str, torch.Tensor]:
        self.settle()
        out = self._tables.device_tensors()
        if self._norm_sq_last is not None:
            out["grad_norm_sq_last"] = self._norm_sq_last
            out["grad_norm_sq_max"] = self._norm_max
        return out

    def records(self, host: Mapping[str, torch.Tensor]) -> list[MetricRecord]:
        # A gradient has its parameter's dtype (torch enforces it), so the headroom of a window
        # uses the dtype the parameters have at its flush (after model.half(), the new one).
        dtypes = {i: p.dtype for i, p in enumerate(self._tensors)}
        out = table_records("grad", "param", self.params, self._tables.merged(host), dtypes)
        if "grad_norm_sq_last" in host:
            out.append(MetricRecord("grad_norm", {}, math.sqrt(float(host["grad_norm_sq_last"]))))
            out.append(
                MetricRecord("grad_norm_max", {}, math.sqrt(float(host["grad_norm_sq_max"])))
            )
        return out

    def reset(self) -> None:
        """After a flush: a new window, whose first step checks the selection, and one step
        that re-learns the backward order."""
        self._pending.clear()
        self._tables.reset()
        self._norm_sq_last = self._norm_max = None
        self._check_selection = True
        self._arm()


class ActivationProbe:
    """Per-module statistics of forward outputs on sampled steps.

    Forward hooks only collect the outputs (host-side bookkeeping); when the model's forward
    returns, one fused statistics call per device measures all of them and a few launches merge
    the rows into the table. The outputs are held until then (at most ``max_pending_bytes``;
    beyond that the measurement runs early), which is why the collection ends with the root
    forward rather than with the step.

    A held output is an alias: an in-place op after its module returned (``nn.ReLU(inplace=True)``
    after a Linear, ``out += identity``) would change what is measured. Its version counter,
    kept at collection, tells: such an output is dropped (that forward's row lacks it), and its
    module's outputs are measured in its own hook from then on, with those held before them
    (forward order, for the non-finite search). Inference tensors have no version counter, so
    they are measured in their module's hook too.
    """

    component = "activations"

    def __init__(self, model: nn.Module, cfg: ActivationConfig, ctx: ProbeContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.model = model
        self.modules = select_modules(
            model, cfg.modules, cfg.exclude, cfg.module_types, "activations.modules",
            "activations.module_types",
        )  # fmt: skip
        self._handles: list[Any] = []
        self._module_handles: list[Any] = []
        self._tables = DeviceTables("act_table", len(self.modules))
        # dtype of each module's latest measured output: the headroom of a window with several
        # (an fp32 step, then autocast) uses the latest
        self._dtypes: dict[int, torch.dtype] = {}
        # (module index, output, its version counter or None) in order
        self._pending: list[tuple[int, torch.Tensor, int | None]] = []
        self._pending_bytes = 0
        self._unbatched: set[int] = set()  # modules whose outputs changed in place
        # (tensor type, dtype) the statistics failed on (a __torch_dispatch__ subclass such as
        # MaskedTensor): left out from then on, so that they cannot sink other modules' rows
        self._unreadable: set[tuple[type, torch.dtype]] = set()
        self._told: set[int] = set()  # modules warned about an output left out
        # (device, module indices, stat rows, dtypes) per measurement of the running forward,
        # waiting for their order numbers: the forward's end reserves them in one tracker batch
        self._unordered: list[tuple[torch.device, list[int], torch.Tensor, tuple]] = []
        # device -> (first order number, module indices, stat rows, dtypes) per measurement
        self._measured: dict[torch.device, list[tuple[int, list[int], torch.Tensor, tuple]]] = {}
        self._plans: dict[tuple[torch.device, tuple[int, ...]], tuple[Any, Any, int]] = {}
        # Per device: each module's largest absmax / (its tensor's dtype's largest finite
        # value) this window. A module's outputs may mix dtypes (an fp16 output with fp32
        # attention weights under autocast): their merged absmax over one dtype's range was no
        # headroom of either.
        self._headroom: dict[torch.device, torch.Tensor] = {}
        self._ranges: dict[tuple[torch.device, tuple[torch.dtype, ...]], torch.Tensor] = {}

    def attach(self) -> None:
        self._handles.append(
            self.model.register_forward_hook(UserHook(self._forward_done), always_call=True)
        )
        if self.ctx.step % self.cfg.every == 0:
            self._arm()

    def detach(self) -> None:
        self._disarm()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending.clear()
        self._unordered.clear()
        self._measured.clear()

    def _arm(self) -> None:
        """Module hooks exist only during sampled steps: a hooked module leaves PyTorch's fast
        call path, which costs every forward of every step, sampled or not."""
        if not self._module_handles:
            self._module_handles = [
                m.register_forward_hook(UserHook(self._hook, i))
                for i, (_, m) in enumerate(self.modules)
            ]

    def _disarm(self) -> None:
        for h in self._module_handles:
            h.remove()
        self._module_handles.clear()

    # Hooks run outside compiled graphs: traced by Dynamo, this bookkeeping split the user's
    # graphs and broke AOTAutograd on sampled steps (tests/test_compile.py).
    @outside_graphs
    def _hook(self, index: int, module: nn.Module, _inputs: Any, output: Any) -> None:
        # The probe's own torch calls skip __torch_function__ handling: on sampled steps the
        # attention probe's TorchFunctionMode is active, and its Python dispatch on each of
        # these calls (~1,500 per GPT-2 forward) cost more than the statistics themselves.
        # Guarded: an output the collection cannot walk or detach (a __torch_dispatch__ subclass
        # without aten.detach, a structure that holds itself) is a failure of the probe, counted,
        # never the user's forward's.
        with torch._C.DisableTorchFunction():
            self.ctx.guard.run(self.component, self._collect, index, module, output)

    def _collect(self, index: int, module: nn.Module, output: Any) -> None:
        if self.cfg.training_only and self._eval_forward(module):
            return
        if torch._C._current_graph_task_id() != -1:
            return  # activation checkpointing's recompute, inside backward: counted already
        # a plain tensor (most modules) skips the structure walk: 136 hooks per GPT-2 forward
        plain = type(output) is torch.Tensor
        now = index in self._unbatched
        for t in (output,) if plain else _floating_tensors(output):
            if not _floating(t) or (self._unreadable and (type(t), t.dtype) in self._unreadable):
                self._tell_unmeasured(index, t)
                continue
            t = t.detach()
            try:
                version = t._version
            except RuntimeError:  # an inference tensor
                version, now = None, True
            self._pending.append((index, t, version))
            self._pending_bytes += t.numel() * t.element_size()
        if now or self._pending_bytes > self.cfg.max_pending_bytes:  # or early: bounded memory
            self.ctx.guard.run(self.component, self._measure)

    def _eval_forward(self, module: nn.Module) -> bool:
        """No training forward: the model's (or begin_forward()'s), decided at its entry;
        outside any, the module's."""
        if self.ctx.eval_forward is not None:
            return self.ctx.eval_forward
        return not module.training or not torch.is_grad_enabled()

    @outside_graphs
    def _forward_done(self, *_: Any) -> None:
        self.ctx.eval_forward = self.ctx.opened_eval_forward  # None: each module's own
        if self._pending or self._unordered:
            self.ctx.guard.run(self.component, self.end_forward)

    def end_forward(self) -> None:
        """Measure the outputs still held and give the forward's rows their order numbers.
        Run when the model's forward returns, at ``Monitor.end_forward()``, and as the step
        closes, before the loss and the gradients take theirs (outputs of modules run outside
        any forward are held until then: they came first)."""
        if self._pending:
            with torch._C.DisableTorchFunction():
                self._measure()
        self._order()

    def _order(self) -> None:
        """One tracker batch for the rows waiting for their order numbers, in the order they
        were measured. Per forward, not per measurement: a forward measured output by output
        (inference tensors, in their hooks) then reserves the batch the previous forward did,
        which the tracker keeps as one entry (validation, generate(), inference loops)."""
        parts, self._unordered = self._unordered, []
        if not parts:
            return
        names = tuple(self.modules[i][0] for _, indices, _, _ in parts for i in indices)
        first = self.ctx.tracker.reserve("forward", "module", names, self.ctx.step)
        for device, indices, stats, dtypes in parts:
            measured = self._measured.setdefault(device, [])
            measured.append((first, indices, stats, dtypes))
            first += len(indices)
        if max(map(len, self._measured.values())) >= _FOLD_AT:  # forwards with no step
            self._settle()  # closing (validation, generate(), inference): not held one by one

    def on_step(self) -> None:
        """The step's rows are merged; the hooks are armed for the next step if it is
        sampled."""
        if self._measured:
            self._settle()
        if (self.ctx.step + 1) % self.cfg.every == 0:
            self._arm()
        else:
            self._disarm()

    def _plan(self, device: torch.device, indices: list[int]) -> tuple[Any, Any, int]:
        """(table rows, segment ids or None, number of rows) for outputs of these modules:
        a module met twice in one forward (or with several outputs) is merged to one row."""
        key = (device, tuple(indices))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:
                self._plans.clear()
            uniq = list(dict.fromkeys(indices))
            rows = to_device(uniq, torch.long, device)
            seg = None
            if len(uniq) != len(indices):
                pos = {m: k for k, m in enumerate(uniq)}
                seg = to_device([pos[i] for i in indices], torch.long, device)
            plan = self._plans[key] = (rows, seg, len(uniq))
        return plan

    @torch.no_grad()
    def _measure(self) -> None:
        """One fused statistics call per device over the held outputs; the rows wait in
        ``_unordered`` for the forward's end, then in ``_measured`` (a GPT-2 forward measures
        ~11 times under the default memory bound, and merging each time cost ~0.6 ms of host
        time)."""
        pending, self._pending = self._pending, []
        self._pending_bytes = 0
        groups: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for index, t, version in pending:
            if version is not None and t._version != version:  # changed after its module
                self._unbatched.add(index)
                continue
            groups.setdefault(t.device, []).append((index, t))
            self._dtypes[index] = t.dtype
        for device, group in groups.items():
            items, stats = self._stats(group)
            if items:
                dtypes = tuple(t.dtype for _, t in items)
                self._unordered.append((device, [i for i, _ in items], stats, dtypes))
        if self.ctx.eval_forward is None and len(self._unordered) >= _FOLD_AT:
            self._order()  # outside any forward: no end to wait for

    def _stats(
        self, items: list[tuple[int, torch.Tensor]]
    ) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor | None]:
        """One fused statistics call; where it fails, tensor by tensor: a tensor subclass the
        kernels cannot read (a MaskedTensor) is left out from then on, with a warning, so that
        one module's odd output does not lose every module's row. A plain tensor that fails is
        the probe's own failure: raised (and counted), as strict mode raises any."""
        tensors = [t for _, t in items]
        try:
            return items, ts.tensor_stats(tensors, self.ctx.underflow_dtype, self.ctx.backend)
        except Exception:
            if self.ctx.guard.strict:
                raise
        kept, rows = [], []
        for index, t in items:
            try:
                rows.append(ts.tensor_stats([t], self.ctx.underflow_dtype, self.ctx.backend))
            except Exception as exc:
                if type(t) in (torch.Tensor, nn.Parameter):  # a failure of the probe itself:
                    raise  # counted by the guard, nothing left out for good
                self._unreadable.add((type(t), t.dtype))
                self._tell_unmeasured(index, t, exc)
                continue
            kept.append((index, t))
        return kept, torch.cat(rows) if rows else None

    def _tell_unmeasured(
        self, index: int, t: torch.Tensor, exc: BaseException | None = None
    ) -> None:
        """Warn once per module about an output left out (complex, sparse, an unreadable dtype
        or tensor type): its activation_* series lack it."""
        if index in self._told:
            return
        kind = _unmeasured_kind(t) if exc is None else f"{type(t).__name__} of {t.dtype}"
        if kind is None:
            return
        self._told.add(index)
        log.warning(
            "numwatch: an output of module %r is not measured (%s%s); its activation_* "
            "statistics leave it out",
            self.modules[index][0],
            kind,
            "" if exc is None else f": {type(exc).__name__}: {str(exc)[:200]}",
        )

    def _note_headroom(
        self, device: torch.device, indices: list[int], stats: torch.Tensor, dtypes: tuple
    ) -> None:
        ranges = self._ranges.get((device, dtypes))
        if ranges is None:
            if len(self._ranges) > 64:
                self._ranges.clear()
            ranges = self._ranges[(device, dtypes)] = to_device(
                [_dtype_max(d) for d in dtypes], torch.float64, device
            )
        table = self._headroom.get(device)
        if table is None:  # a normal tensor, also when made in an inference-mode forward
            with torch.inference_mode(False):
                n = len(self.modules)
                table = self._headroom[device] = torch.zeros(n, dtype=torch.float64, device=device)
        rows, _, _ = self._plan(device, indices)
        index = rows if len(rows) == len(indices) else to_device(indices, torch.long, device)
        table.scatter_reduce_(0, index, stats[:, ts.ABSMAX].double() / ranges, "amax")

    @torch.no_grad()
    @torch.inference_mode(False)
    def _settle(self) -> None:
        """Merge the measured rows into the tables and the non-finite tracker, per device.
        Also called from a forward hook (every _FOLD_AT forwards), maybe inside the user's
        inference_mode(): tables and tracker slots it makes there must be normal tensors, or
        every later in-place update of them fails."""
        measured, self._measured = self._measured, {}
        for device, parts in measured.items():
            stats = torch.cat([st for _, _, st, _ in parts])
            orders = [float(first + k) for first, idx, _, _ in parts for k in range(len(idx))]
            self.ctx.tracker.observe_many(
                to_device(orders, torch.float64, device), nonfinite_counts(stats)
            )
            rows, seg, n = self._plan(device, [i for _, idx, _, _ in parts for i in idx])
            self._tables[device].add_rows(
                rows, stats if seg is None else reduce_by_index(stats, seg, n)
            )
            for _, idx, st, dtypes in parts:
                self._note_headroom(device, idx, st, dtypes)

    def device_tensors(self) -> dict[str, torch.Tensor]:
        self.end_forward()  # outputs of modules run outside any forward since the step closed
        self._settle()
        out = self._tables.device_tensors()
        out.update({f"act_headroom/{i}": t for i, t in enumerate(self._headroom.values())})
        return out

    def records(self, host: Mapping[str, torch.Tensor]) -> list[MetricRecord]:
        merged = self._tables.merged(host)
        parts = [host[k] for k in host if k.startswith("act_headroom/")]
        headroom = torch.stack(parts).amax(0).tolist() if parts else None
        return table_records("activation", "module", self.modules, merged, self._dtypes, headroom)

    def reset(self) -> None:
        self._tables.reset()
        for table in self._headroom.values():
            table.zero_()
