"""Device-side statistics state, read by the host once per flush.

Nothing here synchronises with the device except ``read_to_host``, which the monitor calls once
per flush: all tensors of one device are packed into one buffer and copied in one transfer.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from numwatch.kernels.host_copy import to_device
from numwatch.kernels.tensor_stats import (
    ABSMAX,
    MAX,
    MAX_COLUMNS,
    MIN,
    MIN_COLUMNS,
    NAN,
    NEGINF,
    NUMEL,
    POSINF,
    SUM,
    combine_stats,
    empty_stats,
)

# merge_rows slices the row by column ranges: NUMEL | ABSMAX MIN MAX | SUM ... (sums, counts).
assert (NUMEL, ABSMAX, MIN, MAX, SUM) == (0, 1, 2, 3, 4)
assert (MAX_COLUMNS, MIN_COLUMNS) == ((ABSMAX, MAX), (MIN,))

__all__ = [
    "SETTLE_STEPS",
    "DeviceTables",
    "LossWindow",
    "NonfiniteOrigin",
    "NonfiniteTracker",
    "StatTable",
    "merge_rows",
    "nonfinite_counts",
    "read_to_host",
    "reduce_by_index",
    "reduce_steps",
]

INF = float("inf")
# Per-step results (gradient statistics, losses) held on the device before they are merged in
# one batch: merging every step would put launches on the training's critical path.
SETTLE_STEPS = 64


_EXTREMES = slice(ABSMAX, MAX + 1)  # ABSMAX, MIN, MAX: max, min, max


def merge_rows(acc: torch.Tensor, new: torch.Tensor) -> None:
    """combine_stats in six launches (it is on the per-step path): sums add, extremes merge."""
    acc[:, :ABSMAX] += new[:, :ABSMAX]
    acc[:, SUM:] += new[:, SUM:]
    a, b = acc[:, _EXTREMES], new[:, _EXTREMES]
    acc[:, _EXTREMES] = torch.where(_min_mask(acc.device), torch.minimum(a, b), torch.maximum(a, b))


def reduce_steps(stacked: torch.Tensor) -> torch.Tensor:
    """Merge a stack of stat tables (k, n, N_STATS) over its first dim into one (n, N_STATS)."""
    out = stacked.sum(0)
    ext = stacked[:, :, _EXTREMES]
    out[:, _EXTREMES] = torch.where(_min_mask(stacked.device), ext.amin(0), ext.amax(0))
    return out


def reduce_by_index(stats: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    """Merge the rows of ``stats`` that share a segment id ``seg`` into ``n`` rows."""
    out = empty_stats(n, stats.device)
    out[:, :ABSMAX].index_add_(0, seg, stats[:, :ABSMAX])
    out[:, SUM:].index_add_(0, seg, stats[:, SUM:])
    idx = seg[:, None].expand(-1, MAX + 1 - ABSMAX)
    ext = stats[:, _EXTREMES]
    hi = out[:, _EXTREMES].scatter_reduce(0, idx, ext, "amax", include_self=True)
    lo = out[:, _EXTREMES].scatter_reduce(0, idx, ext, "amin", include_self=True)
    out[:, _EXTREMES] = torch.where(_min_mask(stats.device), lo, hi)
    return out


_MIN_MASKS: dict[torch.device, torch.Tensor] = {}


def _min_mask(device: torch.device) -> torch.Tensor:
    mask = _MIN_MASKS.get(device)
    if mask is None:
        mask = _MIN_MASKS[device] = to_device([False, True, False], torch.bool, device)
    return mask


def nonfinite_counts(stats: torch.Tensor) -> torch.Tensor:
    """NaN + Inf count per row of ``stats`` (..., N_STATS)."""
    return stats[..., NAN] + stats[..., POSINF] + stats[..., NEGINF]


class StatTable:
    """Rows of tensor statistics (one per parameter or module) on one device, for one window."""

    def __init__(self, n_rows: int, device: torch.device) -> None:
        self.device = device
        self.rows = empty_stats(n_rows, device)  # (n_rows, N_STATS) float64
        self._identity = empty_stats(1, device)
        self._arange: torch.Tensor | None = None

    def full_index(self) -> torch.Tensor:
        """The index meaning "every row, in order": add_rows then skips the gather/scatter."""
        if self._arange is None:
            self._arange = torch.arange(self.rows.shape[0], device=self.device)
        return self._arange

    def add_rows(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Merge ``rows`` into the table rows at ``index`` (a device LongTensor, no repeats;
        ``full_index()`` for all rows in order, which needs no gather/scatter)."""
        if index is self._arange:
            merge_rows(self.rows, rows)
            return
        acc = self.rows.index_select(0, index)
        merge_rows(acc, rows)
        self.rows.index_copy_(0, index, acc)

    def reset(self) -> None:
        self.rows.copy_(self._identity.expand_as(self.rows))


class DeviceTables:
    """One StatTable per device that tensors of a probe live on, merged on the host at flush."""

    def __init__(self, name: str, n_rows: int) -> None:
        self.name = name
        self.n_rows = n_rows
        self._tables: dict[torch.device, StatTable] = {}

    def __getitem__(self, device: torch.device) -> StatTable:
        table = self._tables.get(device)
        if table is None:
            table = self._tables[device] = StatTable(self.n_rows, device)
        return table

    def device_tensors(self) -> dict[str, torch.Tensor]:
        return {f"{self.name}/{i}": t.rows for i, t in enumerate(self._tables.values())}

    def merged(self, host: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """Host rows of all devices merged, or None if nothing was recorded yet."""
        tables = [host[f"{self.name}/{i}"] for i in range(len(self._tables))]
        if not tables:
            return None
        out = tables[0].clone()
        for t in tables[1:]:
            combine_stats(out, t)
        return out

    def reset(self) -> None:
        for t in self._tables.values():
            t.reset()


@dataclass(frozen=True)
class NonfiniteOrigin:
    """Where a NaN/Inf was seen: phase ('forward', 'backward', 'loss'), what, and when."""

    phase: str
    label: str  # 'module' or 'param' ('' for the loss)
    name: str
    step: int


class NonfiniteTracker:
    """Finds the first place (in execution order) a NaN/Inf appeared, without host syncs.

    Each observation gets an increasing order number on the host; the device keeps the smallest
    order number whose tensor held a non-finite value. The host maps it back at flush.
    """

    def __init__(self) -> None:
        self._first: dict[torch.device, torch.Tensor] = {}  # device -> 0-d float64 min order
        # One entry per reserved batch: (first order, phase, label, names, step, repeats); a
        # step's gradients are one batch, so the host does O(1) work per observation batch. A
        # batch reserved again right after itself (the same modules' activations, forward after
        # forward: validation, generate()) repeats the entry: no entry per forward until flush.
        self._batches: list[tuple[int, str, str, tuple[str, ...], int, int]] = []
        self._next = 0  # the next order number (never reused: device minima stay comparable)

    def next_order(self, origin: NonfiniteOrigin) -> int:
        return self.reserve(origin.phase, origin.label, (origin.name,), origin.step)

    def reserve(self, phase: str, label: str, names: tuple[str, ...], step: int) -> int:
        """Order numbers for ``names`` observed in this order; returns the first one."""
        first = self._next
        self._next += len(names)
        if self._batches:
            start, *same, repeats = self._batches[-1]
            if same == [phase, label, names, step] and start + len(names) * repeats == first:
                self._batches[-1] = (start, phase, label, names, step, repeats + 1)
                return first
        self._batches.append((first, phase, label, names, step, 1))
        return first

    def observe_many(self, orders: torch.Tensor, nonfinite: torch.Tensor) -> None:
        """``orders``: float64 order numbers on the device of the counts ``nonfinite`` (n,)."""
        first = self._slot(nonfinite.device)
        torch.minimum(first, torch.where(nonfinite > 0, orders, INF).amin(), out=first)

    def device_tensors(self) -> dict[str, torch.Tensor]:
        return {f"nonfinite_first/{i}": t for i, t in enumerate(self._first.values())}

    def first_origin(self, host: Mapping[str, torch.Tensor]) -> NonfiniteOrigin | None:
        found = self.first_position(host)
        return None if found is None else found[0]

    def first_position(
        self, host: Mapping[str, torch.Tensor]
    ) -> tuple[NonfiniteOrigin, int] | None:
        """The first origin and its place among its step's observations. Order numbers run on
        over the whole run, so ranks that observed different numbers of tensors in earlier steps
        hold different numbers for the same place: across ranks, compare places within a step."""
        orders = [float(host[f"nonfinite_first/{i}"]) for i in range(len(self._first))]
        best = min(orders, default=INF)
        if best == INF:
            return None
        order = int(best)
        i = bisect.bisect_right(self._batches, order, key=lambda b: b[0]) - 1
        first, phase, label, names, step, _ = self._batches[i]
        start = min(b[0] for b in self._batches if b[4] == step)
        name = names[(order - first) % len(names)]
        return NonfiniteOrigin(phase, label, name, step), order - start

    def reset(self) -> None:
        self._batches.clear()
        for t in self._first.values():
            t.fill_(INF)

    def _slot(self, device: torch.device) -> torch.Tensor:
        slot = self._first.get(device)
        if slot is None:
            slot = self._first[device] = torch.full((), INF, dtype=torch.float64, device=device)
        return slot


class LossWindow:
    """The largest and the mean loss over the steps since the last flush.

    A flush reads the loss of its last step only, so at the default cadence (50 steps) a spike
    between two flushes would pass unseen by the rules; these two cover every step. Device
    losses come in as the monitor settles them (every ``SETTLE_STEPS`` steps and at flush: a few
    launches, none per step), float losses on the host. A NaN loss makes the maximum NaN.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self._max: torch.Tensor | None = None  # device part
        self._sum: torch.Tensor | None = None
        self._fmax = -INF  # float part
        self._fsum = 0.0
        self._fsteps = 0

    def add_tensor(self, values: torch.Tensor) -> None:
        """Fold in a float64 vector of step losses (one device)."""
        mx, sm = values.max(), values.sum()
        if self._max is None or self._sum is None:
            self._max, self._sum = mx, sm
        else:
            self._max = torch.maximum(self._max, mx.to(self._max.device))
            self._sum = self._sum + sm.to(self._sum.device)
        self.steps += values.numel()

    def add_float(self, value: float) -> None:
        if not math.isnan(self._fmax) and (math.isnan(value) or value > self._fmax):
            self._fmax = value
        self._fsum += value
        self._fsteps += 1
        self.steps += 1

    def device_tensors(self) -> dict[str, torch.Tensor]:
        """What the flush reads: the window's maximum, sum and step count (a host tensor; summed
        over ranks, as the sum is, so the mean covers the steps of every rank that gave a loss)."""
        if not self.steps:
            return {}
        mx, sm = self._max, self._sum
        if self._fsteps:  # float losses (alone, or beside tensors in a loop that passed both)
            fmax = torch.tensor(self._fmax, dtype=torch.float64)
            fsum = torch.tensor(self._fsum, dtype=torch.float64)
            if mx is None or sm is None:
                mx, sm = fmax, fsum
            else:
                mx, sm = torch.maximum(mx, fmax.to(mx.device)), sm + fsum.to(sm.device)
        steps = torch.tensor(float(self.steps), dtype=torch.float64)
        return {"loss_window_max": mx, "loss_window_sum": sm, "loss_window_steps": steps}

    def values(self, host: Mapping[str, torch.Tensor]) -> tuple[float, float] | None:
        """(loss_max, loss_mean) from the flush's host read; None without losses (here, or on
        any rank: a rank that passes no loss reports the others')."""
        if "loss_window_max" not in host:
            return None
        mean = float(host["loss_window_sum"]) / float(host["loss_window_steps"])
        return float(host["loss_window_max"]), mean


def read_to_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy named device tensors to the host with one transfer per device.

    SYNC: this is the monitor's one host read per flush.
    """
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        by_device.setdefault(t.device, []).append((name, t))
    out: dict[str, torch.Tensor] = {}
    for items in by_device.values():
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for _, t in items])
        host = flat.cpu()
        offset = 0
        for name, t in items:
            n = t.numel()
            out[name] = host[offset : offset + n].reshape(t.shape)
            offset += n
    return out
