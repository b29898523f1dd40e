"""Running under torch.distributed: ranks, global statistics at flush, one decision for all.

Data-parallel ranks see different data (activations, attention, the loss); FSDP2 ranks hold
different shards of every gradient; DDP ranks hold identical copies of it. At each flush the
monitor's device-side tables go through ``Aggregator.aggregate`` before its one host read: all of
them are packed into two flat float64 buffers, one all-reduced with SUM (counts, sums, sums of
squares, the loss) and one with MAX (maxima; minima as negated maxima; rows every rank holds in
full), both in flight at once. A tiny all-reduce on the CPU first checks that every rank packed
the same layout, so a rank whose probe failed can never hang the others. Every rank then holds
the same global values, so the rules fire and the actions run alike on all ranks, at one step.

Between flushes nothing is exchanged, except one 5-value all-reduce per step when a rule decides
before the optimizer update (skip_step): that decision has to be global as well.

``ShardedPowerIteration`` estimates spectral norms of row-sharded weights (FSDP2) with one small
all-reduce per iteration, never gathering a weight.
"""

from __future__ import annotations

import logging
import math
import os
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from numwatch.buffers import NonfiniteOrigin, NonfiniteTracker, nonfinite_counts
from numwatch.errors import NumwatchConfigError
from numwatch.kernels import attention_stats as ats
from numwatch.kernels import tensor_stats as ts
from numwatch.kernels.host_copy import to_device
from numwatch.kernels.power_iteration import WARMUP_ITERS, failed_scale, pow2_scale

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5
    try:
        from torch.distributed._tensor import DTensor
    except ImportError:
        DTensor = None

if TYPE_CHECKING:
    from numwatch.config import DistributedConfig
    from numwatch.probes.optimizer import OptimizerProbe
    from numwatch.probes.tensors import GradientProbe

__all__ = [
    "REPLICA",
    "SHARD",
    "SHARD_COPY",
    "Aggregator",
    "MatrixBlock",
    "MonitorJoinHook",
    "ShardedPowerIteration",
    "element_ops",
    "get_rank",
    "get_world_size",
    "is_dtensor",
    "is_initialized",
    "local_tensor",
    "shard_role",
    "warn_fsdp1",
    "weight_blocks",
]

log = logging.getLogger("numwatch")
INF = float("inf")
_ATTACH_KEY = "numwatch/attached"  # a counter on the default store (see Aggregator.agree)

# How one element combines across ranks. NONE: summed, but this rank adds nothing because another
# rank holds the same shard and counts it (HSDP replicas).
SUM, MAX, MIN, NONE = range(4)
# How a rank's local piece of a tensor relates to the whole tensor.
REPLICA, SHARD, SHARD_COPY = range(3)


# ------------------------------------------------------------------------------- ranks
def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank: from torch.distributed, or the RANK variable torchrun sets before init."""
    return dist.get_rank() if is_initialized() else int(os.environ.get("RANK", "0"))


def get_local_rank() -> int:
    """Rank on this host: the LOCAL_RANK torchrun sets, else the global rank (mp.spawn sets
    none; the global rank still keeps the ranks' ports apart)."""
    text = os.environ.get("LOCAL_RANK")
    if text is None:
        return get_rank()
    try:
        return int(text)
    except ValueError:
        raise NumwatchConfigError(f"LOCAL_RANK={text!r} is not an integer") from None


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def warn_fsdp1(model: torch.nn.Module) -> None:
    """Warn at attach when ``model`` is sharded by FSDP1: its flat parameter shards are plain
    tensors, which numwatch cannot tell from whole DDP replicas (FSDP2's are DTensors)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    # FSDP1 marks every parameter it manages, also those of the module it wraps (its own flat
    # parameters, and the originals with use_orig_params=True)
    flattened = any(getattr(p, "_fsdp_flattened", False) for p in model.parameters())
    if flattened or any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        log.warning(
            "numwatch: the model is sharded with FSDP1 (torch.distributed.fsdp."
            "FullyShardedDataParallel), which numwatch does not support: each rank's flat "
            "parameter shards read as whole parameters, so gradient and update statistics and "
            "grad_norm cover one rank's shard (rank 0's when aggregated), weight spectral norms "
            "are left out, and parameters may be labelled by FSDP's flat parameters "
            "(_flat_param); shard with FSDP2 (torch.distributed.fsdp.fully_shard) instead, "
            "whose shards numwatch combines"
        )


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local_tensor(t: Any) -> Any:
    """The rank-local part of a DTensor (an FSDP2 shard), or ``t`` itself."""
    if DTensor is not None and isinstance(t, DTensor):
        return t.to_local()
    return t


def shard_role(t: torch.Tensor) -> int:
    """REPLICA: this rank holds all of ``t`` (plain tensors, DDP); SHARD: a piece that this rank
    counts; SHARD_COPY: a piece whose identical copy on another rank is counted (HSDP)."""
    if DTensor is None or not isinstance(t, DTensor):
        return REPLICA
    placements = t.placements
    if not any(p.is_shard() for p in placements):
        return REPLICA
    coord = t.device_mesh.get_coordinate() or [0] * len(placements)
    first_copy = all(coord[d] == 0 for d, p in enumerate(placements) if not p.is_shard())
    return SHARD if first_copy else SHARD_COPY


# ------------------------------------------------------------------------------- layouts
def _columns(n: int, max_cols: Sequence[int], min_cols: Sequence[int]) -> torch.Tensor:
    ops = torch.full((n,), SUM, dtype=torch.int8)
    ops[list(max_cols)] = MAX
    ops[list(min_cols)] = MIN
    return ops


_STAT_OPS = _columns(ts.N_STATS, ts.MAX_COLUMNS, ts.MIN_COLUMNS)
_HEAD_OPS = _columns(ats.N_HEAD_STATS, ats.HEAD_MAX_COLUMNS, ats.HEAD_MIN_COLUMNS)
# Full values every rank holds already, and the window's largest loss (of any rank's steps).
_KNOWN_MAX = ("weights/", "opt/", "grad_norm_sq_", "loss_window_max", "act_headroom/")
# The loss and the window's loss sum add up with their counts (the ranks that gave a loss, the
# steps that did): a loop may pass the loss on one logging rank only, and its mean is then that
# rank's, not a share of it.
_LOSS_SUMS = ("loss", "loss_ranks", "loss_window_sum", "loss_window_steps")


def element_ops(
    key: str, shape: Sequence[int], roles: Mapping[str, Sequence[int]] | None = None
) -> torch.Tensor:
    """Cross-rank op of every element of the monitor's device tensor ``key`` (flat int8).

    ``roles`` (``shard_role`` of each row's parameter, for the gradient table ``grad_table`` and
    the optimizer's sums ``opt/sums``) sets how additive columns combine: shards add up (SUM),
    replicas are one value held everywhere (MAX, which is also the worst value should replicas
    ever differ), HSDP copies add nothing (NONE). Keys the table does not know hold values every
    rank already has in full (spectral norms): MAX.
    """
    head = key.split("/", 1)[0]
    numel = math.prod(shape)
    roles = roles or {}
    if head in ("grad_table", "act_table") or key == "opt/sums":
        if key == "opt/sums":  # (params, 4) sums of squares and counts: all additive
            ops = torch.full(tuple(shape), SUM, dtype=torch.int8)
        else:
            ops = _STAT_OPS.expand(*shape).clone()  # (rows, N_STATS)
        row_roles = roles.get("opt" if key == "opt/sums" else head)
        if head != "act_table" and row_roles is not None:
            role = torch.tensor(row_roles, dtype=torch.int8)[:, None]
            additive = ops == SUM
            ops[additive & (role == REPLICA)] = MAX
            ops[additive & (role == SHARD_COPY)] = NONE
        return ops.reshape(-1)
    if head == "attn" and key.endswith("/heads"):
        return _HEAD_OPS.expand(*shape).reshape(-1).clone()
    if (head == "attn" and key.endswith(("/errors", "/calls"))) or key == "grad_norm_steps":
        return torch.full((numel,), SUM, dtype=torch.int8)
    if head == "nonfinite_first":
        return torch.full((numel,), MIN, dtype=torch.int8)
    if key in _LOSS_SUMS:
        return torch.full((numel,), SUM, dtype=torch.int8)
    if not key.startswith(_KNOWN_MAX):
        log.debug("numwatch: %r has no cross-rank layout; reduced with MAX", key)
    return torch.full((numel,), MAX, dtype=torch.int8)


class _Plan:
    """Index sets that split one flat vector (all tensors of a layout) into the two buffers."""

    def __init__(self, ops: torch.Tensor, device: torch.device) -> None:
        index = torch.arange(ops.numel())
        adds = (ops == SUM) | (ops == NONE)
        self.numel = ops.numel()
        self.i_sum = index[adds].to(device)
        self.i_max = index[ops == MAX].to(device)
        self.i_min = index[ops == MIN].to(device)
        none = ops[adds] == NONE
        self.none = none.to(device) if bool(none.any()) else None
        self.n_max = self.i_max.numel() + self.i_min.numel()

    def pack(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = flat[self.i_sum]
        if self.none is not None:
            s = s.masked_fill(self.none, 0.0)
        m = torch.cat([flat[self.i_max], -flat[self.i_min]])
        # MAX all-reduces drop NaN (gloo, NCCL); carry it as a flag so NaN wins, as in torch.
        nan = torch.isnan(m)
        return s, torch.cat([m.masked_fill(nan, -INF), nan.to(torch.float64)])

    def unpack(self, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        m = m[: self.n_max].masked_fill(m[self.n_max :] > 0, float("nan"))
        n = self.i_max.numel()
        out = torch.empty(self.numel, dtype=torch.float64, device=s.device)
        out.index_copy_(0, self.i_sum, s)
        out.index_copy_(0, self.i_max, m[:n])
        out.index_copy_(0, self.i_min, -m[n:])
        return out


def _identity(ops: torch.Tensor) -> torch.Tensor:
    """The value a rank that lacks a tensor contributes: 0 to sums, -inf to max, +inf to min."""
    out = torch.zeros(ops.shape, dtype=torch.float64)
    out[ops == MAX] = -INF
    out[ops == MIN] = INF
    return out


# ------------------------------------------------------------------------------- aggregation
class Aggregator:
    """Cross-rank aggregation for one monitor (inactive unless torch.distributed runs with 2+
    ranks and ``distributed.aggregate`` is on); see the module docstring."""

    LOCAL = "local/"  # prefix of the rank-local copies read in the same host transfer

    def __init__(self, cfg: DistributedConfig) -> None:
        self.cfg = cfg
        self._cpu_group: Any = None
        self._plans: dict[tuple, tuple[_Plan, list[tuple[str, tuple[int, ...]]], Any]] = {}
        # shard_role of each row's parameter, per table: {"grad_table": ..., "opt": ...}
        self._roles: dict[str, tuple[int, ...]] = {}
        self._counted: dict[torch.device, torch.Tensor] = {}
        self._grad_params: Any = None  # the gradient probe's selection the two above are of
        self._one: dict[torch.device, torch.Tensor] = {}  # the 'has a norm' flag of an entry
        # per closed step: (3,) [counted norm^2 share, bad, has a norm]; every step has one, on
        # every rank (a failed or gradient-less step too), so the ranks' lists line up
        self._norms: list[torch.Tensor] = []
        # Whether the last flush's values were combined: when the ranks' layouts disagree they
        # stay local, and nothing may be exchanged on the strength of them.
        self._combined = False
        self.collectives = 0  # issued so far (benchmarks, tests)
        # Uneven inputs (``Join``): the group of the per-forward flags, the flags not yet read,
        # and the step from which a rank had run out of inputs (no aggregation from there on).
        self._flags_group: Any = None
        self._announced: list[tuple[torch.Tensor, Any, Any]] = []
        self.joined_step: int | None = None
        self._at_attach = False
        self._late_group_warned = False
        self._groups_world: Any = None  # the WORLD group the two groups above were made in

    def forget_layouts(self) -> None:
        """At a new attach: the probes are rebuilt, so are their rows' roles (a parameter
        unfrozen between a detach and an attach adds rows). A Join that ended the last attach
        (uneven inputs) ends with it: every rank attaches again, and aggregates again."""
        self._roles.clear()
        self._counted.clear()
        self._grad_params = None
        self._plans.clear()
        self._norms = []
        self.joined_step = None
        self._announced = []
        # groups made from an earlier WORLD: a destroy_process_group() and a new
        # init_process_group() between detach and attach left them dead
        world = dist.group.WORLD if is_initialized() else None
        if world is not self._groups_world:
            self._cpu_group = self._flags_group = None
            self._groups_world = world
        # a group that starts after attach (mp.spawn's workers init in the worker, a monitor
        # made before) found no rank, port or shared run name at attach: no aggregation
        self._at_attach = self.configured
        self._late_group_warned = False

    @property
    def configured(self) -> bool:
        """Aggregation is asked for and there are ranks to aggregate over."""
        return self.cfg.aggregate and is_initialized() and dist.get_world_size() > 1

    @property
    def active(self) -> bool:
        if not self._at_attach:
            if not self._late_group_warned and self.configured:
                self._late_group_warned = True
                log.warning(
                    "numwatch: torch.distributed started after attach(): this monitor keeps "
                    "the rank it read then and does not aggregate across ranks; attach after "
                    "init_process_group() (or detach and attach again) to aggregate"
                )
            return False
        return self.joined_step is None and self.configured

    @property
    def keeps_local(self) -> bool:
        """Rank-local values of every tensor are read too (per-rank JSONL)."""
        return self.active and self.cfg.jsonl == "per_rank"

    def agree(self, settings: Mapping[str, Any]) -> None:
        """Raise on every rank, at attach, when the ranks' monitors would issue different
        collectives: flushes at different steps, or different probes, meet DDP's gradient
        all-reduce instead of each other, and gloo aborts the process (or NCCL hangs).
        ``settings``: what decides when and what a rank aggregates. One 2-value all-reduce."""
        if not self.active:
            return
        self._wait_for_every_rank()
        text = repr(sorted(settings.items()))
        if not self._same_everywhere(text):
            mine: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(mine, text, self._group_cpu())
            self.collectives += 1
            differ = sorted({r for r, t in enumerate(mine) if t != mine[0]})
            raise NumwatchConfigError(
                "numwatch: the ranks' monitors are configured differently (flush cadence, probes "
                f"or step-level rules): ranks {differ} differ from rank 0 ({mine[0]}; rank "
                f"{differ[0]}: {mine[differ[0]]}); aggregation needs the same on every rank"
            )

    def shared_name(self, name: str) -> str:
        """Rank 0's ``name`` on every rank (default run names come from each rank's clock: ranks
        attaching across a second boundary named one job twice). One broadcast, at attach, on
        every rank once ``agree`` has lined them up."""
        if not self.active:
            return name
        box = [name]
        dist.broadcast_object_list(box, src=0, group=self._group_cpu())
        self.collectives += 1
        return box[0]

    def _wait_for_every_rank(self) -> None:
        """Count this attach on the default store and wait until every rank's is counted, up
        to ``attach_timeout``: a collective would hang without end when some rank never attaches.
        Attaches come in generations of world-size counts; one that times out takes its count
        back, so the ranks' next attach still lines up."""
        store = dist.distributed_c10d._get_default_store()
        world = dist.get_world_size()
        # a restarted job (torchrun) may keep its store: each attempt counts on its own
        key = f"{_ATTACH_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        n = store.add(key, 1)
        target = ((n - 1) // world + 1) * world
        deadline = time.monotonic() + self.cfg.attach_timeout
        pause = 0.005
        while (seen := store.add(key, 0)) < target:
            if time.monotonic() > deadline:
                store.add(key, -1)
                raise NumwatchConfigError(
                    f"numwatch: {seen - (target - world)} of {world} ranks attached a monitor "
                    f"within distributed.attach_timeout={self.cfg.attach_timeout:g} s; "
                    "aggregation needs one monitor on every rank, attached at the same point "
                    "(to watch some ranks alone, set distributed.aggregate=false)"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.5)

    # --------------------------------------------------------------------- per step
    def on_step(self, gradients: GradientProbe | None) -> None:
        """After the gradient probe read this step's gradients: this rank's share of the global
        squared gradient norm, and whether it saw a non-finite gradient (device tensors)."""
        if gradients is None or not self.active:
            return
        if not gradients.step_stats:  # nothing measured (no backward; the probe failed)
            self._norms.append(torch.zeros(3, dtype=torch.float64))
            return
        parts = []
        for rows, stats in gradients.step_stats:
            counted = self._counted_rows(gradients, rows.device)[rows]  # (n,) bool
            bad_here = nonfinite_counts(stats)
            sumsq = torch.where(counted, stats[:, ts.SUMSQ], 0.0).sum()
            # NaN as in clip_grad_norm_ when a counted gradient is non-finite
            sumsq = sumsq.masked_fill(torch.where(counted, bad_here, 0.0).sum() > 0, math.nan)
            has = self._one.get(sumsq.device)  # kept: no fill launched per step
            if has is None:
                has = self._one[sumsq.device] = sumsq.new_ones(())
            parts.append(torch.stack([sumsq, (bad_here.sum() > 0).to(sumsq.dtype), has]))
        entry = parts[0]
        for p in parts[1:]:
            entry = entry + p.to(entry.device, non_blocking=True)
        self._norms.append(entry)

    def step_values(
        self, loss: torch.Tensor | float | None, unwatched: torch.Tensor | None = None
    ) -> dict[str, float]:
        """Global squared gradient norm and mean loss of the step closing now, from one SUM
        all-reduce of [norm^2 share, non-finite flag, has norm, loss, has loss]. ``unwatched``:
        0, or NaN for a non-finite gradient the optimizer applies and the probe does not watch.

        SYNC: one per step, only when a rule decides every step (skip_step). The norm is NaN on
        every rank when any rank saw a non-finite gradient, so all of them skip together.
        """
        entry = self._norms[-1] if self._norms else torch.zeros(3, dtype=torch.float64)
        if unwatched is not None:  # counted as a norm share of 0 unless non-finite
            flag = unwatched.isnan().to(unwatched.dtype)
            extra = torch.stack([unwatched, flag, torch.ones_like(unwatched)])
            entry = entry + extra.to(entry.device)
        parts = [entry]
        if isinstance(loss, torch.Tensor):
            parts.append(loss.detach().reshape(1).to(parts[0].device, torch.float64))
        host = torch.cat([p.to(parts[0].device) for p in parts]).cpu().tolist()  # SYNC
        has_loss = loss is not None
        loss_value = (host[3] if isinstance(loss, torch.Tensor) else float(loss)) if has_loss else 0
        packet = torch.tensor(
            [host[0], host[1], host[2], loss_value, float(has_loss)],
            dtype=torch.float64,
        )
        dist.all_reduce(packet, group=self._group_cpu())
        self.collectives += 1
        norm_sq, bad, n_norm, loss_sum, n_loss = packet.tolist()
        out = {}
        if n_norm:
            out["grad_norm"] = math.nan if bad else norm_sq
        if n_loss:
            out["loss"] = loss_sum / n_loss
        return out

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        """``values`` summed over the ranks: one all-reduce on the host-side group."""
        packet = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(packet, group=self._group_cpu())
        self.collectives += 1
        return packet.tolist()

    # --------------------------------------------------------------------- uneven inputs
    # Under ``Join([ddp, monitor])`` a rank that ran out of inputs stops stepping, and the
    # others' next aggregation would wait for it forever. So while a Join is enabled, every
    # forward of a rank with data issues an asynchronous 1-value all-reduce of 1 on a group of
    # its own (``announce``), and a joined rank's hook matches it with 0 in each iteration of
    # Join's loop (``shadow``), which runs once per forward of the others. Before its next
    # collectives a rank reads its flags (``settle``): a sum below the world size means some
    # rank has joined, and from that step on every rank keeps its own values (``active`` is
    # False). The flags' group is separate: on a gloo WORLD they would interleave with DDP's.

    def join_group(self) -> None:
        """The flags' group, made in Join's constructor (``join_hook``), which every rank runs
        at the same point: a new group is a collective."""
        if self.configured and self._at_attach and self._flags_group is None:
            cpu = self._group_cpu()
            self._flags_group = dist.new_group(backend="gloo") if cpu is dist.group.WORLD else cpu

    def join_device(self) -> torch.device:
        """Where Join's own all-reduces run when the monitor is its first joinable."""
        return self._device(())

    def announce(self, joinable: Any) -> None:
        """A forward inside an enabled Join on a rank that still has inputs."""
        notified = Join.notify_join_context(joinable)  # Join's count, if the monitor is first
        if self._flags_group is None:  # not aggregating: nothing of ours to tell
            return
        flag = torch.ones(1, dtype=torch.float64)
        work = dist.all_reduce(flag, group=self._flags_group, async_op=True)
        self._announced.append((flag, work, notified))

    def settle(self, step: int) -> None:
        """Read the flags of the forwards since the last call (no device sync: CPU tensors)."""
        pending, self._announced = self._announced, []
        for flag, work, notified in pending:
            work.wait()
            if notified is not None:
                notified.wait()
            if flag.item() < dist.get_world_size() and self.joined_step is None:
                self._stop(step)

    def shadow(self, step: int) -> None:
        """Join's main hook on a rank that ran out of inputs: one iteration of the others."""
        if self._flags_group is None:
            return
        dist.all_reduce(torch.zeros(1, dtype=torch.float64), group=self._flags_group)
        if self.joined_step is None:
            self._stop(step)

    def _stop(self, step: int) -> None:
        self.joined_step = step
        self._norms = []
        log.warning(
            "numwatch: a rank ran out of inputs under Join (uneven inputs) by step %d: from "
            "here on each rank reports and acts on its own values, not aggregated",
            step,
        )

    # --------------------------------------------------------------------- at flush
    def aggregate(
        self,
        tensors: Mapping[str, torch.Tensor],
        loss: torch.Tensor | float | None,
        gradients: GradientProbe | None,
        optimizer: OptimizerProbe | None = None,
    ) -> dict[str, torch.Tensor]:
        """Global values of the monitor's device tensors, plus ``local/``-prefixed rank-local
        copies (the non-finite origins; all of them with ``jsonl='per_rank'``)."""
        # A DTensor value (a probe reading sharded weights) goes as its local part; a probe that
        # failed half-way may leave None: absent here, as on a rank where it never ran.
        tensors = {k: local_tensor(t) for k, t in tensors.items() if isinstance(t, torch.Tensor)}
        if isinstance(loss, float):
            tensors["loss"] = torch.tensor(loss, dtype=torch.float64)
        norms, self._norms = self._norms, []
        local = {
            k: t for k, t in tensors.items() if self.keeps_local or k.startswith("nonfinite_first/")
        }
        own_norms = {}
        if "grad_norm_sq_last" in tensors and norms:
            # Max over steps of a sum over ranks: the per-step shares go, not the local maxima.
            device = norms[0].device
            tensors["grad_norm_steps"] = torch.stack([n.to(device) for n in norms])  # (steps, 2)
            own_norms = {k: tensors.pop(k) for k in ("grad_norm_sq_last", "grad_norm_sq_max")}
        if gradients is not None:
            self._follow_selection(gradients)
        if optimizer is not None:  # every flush: a param group added or removed since
            self._roles["opt"] = tuple(shard_role(p) for _, p in optimizer.params)
        if "loss" in tensors:
            tensors["loss_ranks"] = torch.ones((), dtype=torch.float64)
        out = self._reduce(tensors)
        if "loss_ranks" in out:  # the mean over the ranks that gave a loss
            out["loss"] = out["loss"] / out.pop("loss_ranks")
        steps = out.pop("grad_norm_steps", None)
        if not self._combined:  # layouts disagree: this rank's own norms, not its shares
            out.update(own_norms)
        elif steps is not None:
            # steps no rank measured (no backward, a failed probe) are left out, as locally
            norm_sq = steps[:, 0].masked_fill(steps[:, 1] > 0, math.nan)  # (steps,)
            measured = steps[:, 2] > 0
            order = torch.arange(len(steps), device=steps.device)
            last = torch.where(measured, order, -1).argmax()
            out["grad_norm_sq_last"] = norm_sq[last]
            out["grad_norm_sq_max"] = norm_sq.masked_fill(~measured, -math.inf).max()
        out.update({self.LOCAL + k: t for k, t in local.items()})
        return out

    def split(self, host: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
        """(global, rank-local) views of one host read."""
        glob = {k: v for k, v in host.items() if not k.startswith(self.LOCAL)}
        local = {k[len(self.LOCAL) :]: v for k, v in host.items() if k.startswith(self.LOCAL)}
        return glob, local

    def first_nonfinite(
        self,
        tracker: NonfiniteTracker,
        host: Mapping[str, torch.Tensor],
        local_host: Mapping[str, torch.Tensor],
    ) -> tuple[NonfiniteOrigin | None, dict[str, Any]]:
        """Where a NaN/Inf appeared first over all ranks, and ``{'rank', 'ranks'}`` (which rank
        saw it first; every rank that saw one).

        Only when some rank saw one: the ranks exchange their own first origin (an object
        all-gather on the CPU), so the names come from the rank that saw it and the event is
        the same on every rank. First means earliest step, then place in that step's execution
        order (a rank's order numbers run on over the run, so they are compared within a step),
        then rank.
        """
        if not self.active or not self._combined:  # uncombined: a rank's own NaN, not all's
            return tracker.first_origin(host), {}
        orders = [float(v) for k, v in host.items() if k.startswith("nonfinite_first/")]
        if min(orders, default=INF) == INF:
            return None, {}
        mine = tracker.first_position(local_host)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine, self._group_cpu())
        self.collectives += 1
        seen = []
        for r, found in enumerate(gathered):
            if found is not None:
                origin, place = found
                seen.append((origin.step, place, r, origin))
        if not seen:
            return None, {}
        _, _, rank, origin = min(seen, key=lambda s: s[:3])
        return origin, {"rank": rank, "ranks": sorted({s[2] for s in seen})}

    # --------------------------------------------------------------------- internals
    def _counted_rows(self, gradients: GradientProbe, device: torch.device) -> torch.Tensor:
        """(n_params,) bool: this rank's rows count in global sums (shards; replicas on rank 0)."""
        self._follow_selection(gradients)
        counted = self._counted.get(device)
        if counted is None:
            first = dist.get_rank() == 0
            roles = [shard_role(p) for _, p in gradients.params]
            flags = [r == SHARD or (r == REPLICA and first) for r in roles]
            counted = self._counted[device] = to_device(flags, torch.bool, device)
        return counted

    def _follow_selection(self, gradients: GradientProbe) -> None:
        """The rows' roles of the gradient probe's selection, made again when it selected again
        (a parameter unfrozen or frozen: at the start of a flush window, alike on every rank)."""
        if gradients.params is not self._grad_params:
            self._grad_params = gradients.params
            self._roles["grad_table"] = tuple(shard_role(p) for _, p in gradients.params)
            self._counted.clear()

    def _reduce(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        layout = [(k, tuple(tensors[k].shape)) for k in sorted(tensors)]
        device = self._device(tensors.values())
        agreed = self._agree(layout)
        self._combined = agreed is not None
        if agreed is None:  # shapes disagree: no aggregation this flush, on any rank
            return dict(tensors)
        plan_key = (tuple(agreed), tuple(sorted(self._roles.items())), device)
        cached = self._plans.get(plan_key)
        if cached is None:
            ops = torch.cat([element_ops(k, s, self._roles) for k, s in agreed])
            fill = {k: _identity(element_ops(k, s, self._roles)) for k, s in agreed}
            cached = self._plans[plan_key] = (_Plan(ops, device), agreed, fill)
            if len(self._plans) > 16:
                self._plans.pop(next(iter(self._plans)))
        plan, agreed, fill = cached
        flat = torch.cat(
            [
                tensors[k].detach().reshape(-1).to(device, torch.float64)
                if k in tensors
                else fill[k].to(device)
                for k, _ in agreed
            ]
        )
        s, m = plan.pack(flat)
        works = [
            dist.all_reduce(buf, op=op, async_op=True)
            for buf, op in ((s, dist.ReduceOp.SUM), (m, dist.ReduceOp.MAX))
            if buf.numel()
        ]
        self.collectives += len(works)
        for work in works:
            work.wait()
        out = plan.unpack(s, m)
        sizes = [math.prod(shape) for _, shape in agreed]
        return {
            k: piece.reshape(shape)
            for (k, shape), piece in zip(agreed, out.split(sizes), strict=True)
        }

    def _agree(self, layout: list[tuple[str, tuple[int, ...]]]) -> list | None:
        """The layout every rank packs: its own when all agree (a 2-value CPU all-reduce), else
        the union (an object all-gather), or None when two ranks hold one key in two shapes."""
        if self._same_everywhere(repr((layout, sorted(self._roles.items())))):
            return layout
        layouts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(layouts, layout, self._group_cpu())
        self.collectives += 1
        shapes: dict[str, set[tuple[int, ...]]] = {}
        for each in layouts:
            for k, shape in each:
                shapes.setdefault(k, set()).add(shape)
        if any(len(s) > 1 for s in shapes.values()):
            log.warning("numwatch: ranks hold statistics of different shapes; not aggregated")
            return None
        return [(k, next(iter(shapes[k]))) for k in sorted(shapes)]

    def _same_everywhere(self, text: str) -> bool:
        """Whether every rank passed the same ``text``: the MAX of (crc, -crc) over ranks is
        (c, -c) only when all crcs are c. One 2-value all-reduce on the CPU group."""
        crc = float(zlib.crc32(text.encode()))
        check = torch.tensor([crc, -crc], dtype=torch.float64)
        dist.all_reduce(check, op=dist.ReduceOp.MAX, group=self._group_cpu())
        self.collectives += 1
        return bool(check[0] == -check[1])

    def _device(self, tensors: Any) -> torch.device:
        """CUDA when the backend is NCCL (current device), the CPU otherwise (gloo)."""
        backend = _backend()
        on_cuda = any(t.is_cuda for t in tensors)
        if "nccl" in backend and (on_cuda or "gloo" not in backend):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _group_cpu(self) -> Any:
        """A group for small host-side exchanges: the default one if it has a CPU backend, else
        a gloo group made once (collectively: every rank gets here at the same flush)."""
        if self._cpu_group is None:
            has_cpu = "gloo" in _backend()
            self._cpu_group = dist.group.WORLD if has_cpu else dist.new_group(backend="gloo")
        return self._cpu_group


class MonitorJoinHook(JoinHook):
    """What a joined rank's monitor does while the others still train (see ``announce``)."""

    def __init__(self, aggregator: Aggregator, step: Callable[[], int]) -> None:
        self.aggregator = aggregator
        self.step = step  # the monitor's current step

    def main_hook(self) -> None:
        self.aggregator.shadow(self.step())


def _backend() -> str:
    get = getattr(dist, "get_backend_config", None)
    return str(get() if get is not None else dist.get_backend())


# ------------------------------------------------------------------------------- spectral norms
@dataclass(frozen=True)
class MatrixBlock:
    """A matrix for ``ShardedPowerIteration``: ``weight`` (2-D; a DTensor sharded on dim 0, as
    FSDP2 makes them, or a plain tensor every rank holds in full), restricted to the range
    [start, stop) along ``dim`` and split there into ``groups`` equal parts (attention heads):
    ``dim=0`` for ``nn.Linear`` rows, ``dim=1`` for GPT-2 ``Conv1D`` columns (as ``HeadSlice``)."""

    weight: torch.Tensor
    groups: int = 1
    dim: int = 0
    start: int = 0
    stop: int | None = None


class ShardedPowerIteration:
    """Warm-started spectral norms of row-sharded matrices (FSDP2 ``Shard(0)`` weights), whole
    or per head, with one small all-reduce per iteration and no weight ever gathered.

    The vector ``u`` of each matrix lives in its column space and is the same on every rank, as
    is its power-of-two scale ``c`` (PowerIteration's: ``c * sigma`` near 1, so no square under-
    or overflows float32; the first from the largest magnitude, one MAX all-reduce). One
    iteration: each rank multiplies its rows ``A_r`` into ``v_r = A_r (c u)`` and sends
    ``[A_r^T v_r, ||v_r||^2]``; one SUM all-reduce over all matrices gives ``y = c A^T A u`` and
    ``||c A u||^2``; ``t = y c / ||c A u||``, ``sigma = ||t|| / c`` (PowerIteration's estimate,
    on ``A^T``), ``u <- t / ||t||``. Arithmetic is float32. A zero estimate, or a non-finite one
    (a weight holding NaN/Inf; reported as NaN), restarts ``u`` from its first value and
    adapts ``c`` (``failed_scale``).

    ``step(blocks)`` takes ``MatrixBlock``s or bare 2-D tensors (one whole matrix each) and returns
    the ``(sum of groups,)`` float32 estimates in order, on the weights' device, identical on all
    ranks. Empty and uneven shards are fine; plain tensors need no exchange.
    """

    def __init__(self, iters: int = 1, seed: int = 0) -> None:
        if iters < 1:
            raise ValueError(f"ShardedPowerIteration iters must be >= 1, got {iters}")
        self.iters = iters
        self.seed = seed
        self._signature: tuple = ()
        self._u: list[torch.Tensor] = []  # per block: (groups, k) float32 unit rows
        self._u0: list[torch.Tensor] = []
        self._c: list[torch.Tensor] = []  # per block: (groups,) float32 powers of two
        self._c0: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, blocks: Sequence[torch.Tensor | MatrixBlock]) -> torch.Tensor:
        if not blocks:
            raise ValueError("ShardedPowerIteration.step needs at least one matrix")
        pieces = [_piece(b if isinstance(b, MatrixBlock) else MatrixBlock(b)) for b in blocks]
        groups = {id(p.group): p.group for p in pieces if p.group is not None}
        if len(groups) > 1:
            raise ValueError("ShardedPowerIteration needs all sharded weights on one mesh")
        group = next(iter(groups.values()), None)
        device = pieces[0].rows.device
        fresh = self._ensure_vectors(pieces, group, device)
        sigmas: list[torch.Tensor] = []
        for _ in range(max(self.iters, WARMUP_ITERS) if fresh else self.iters):  # as PowerIteration
            packets = [
                _packet(p, u * c[:, None]) for p, u, c in zip(pieces, self._u, self._c, strict=True)
            ]
            shared = [q for q, p in zip(packets, pieces, strict=True) if p.group is not None]
            if shared:
                flat = torch.cat([q.reshape(-1) for q in shared])
                dist.all_reduce(flat, group=group)  # the one exchange of this iteration
                summed = iter(flat.split([q.numel() for q in shared]))
                packets = [
                    next(summed).view_as(q) if p.group is not None else q
                    for q, p in zip(packets, pieces, strict=True)
                ]
            sigmas = []
            for j, q in enumerate(packets):
                y, nv2 = q[:, :-1], q[:, -1]  # (G, k) c A^T A u, (G,) ||c A u||^2
                c, nw = self._c[j], nv2.sqrt()
                t = y * (c / nw.clamp_min(torch.finfo(torch.float32).tiny)).unsqueeze(-1)
                nt = t.norm(dim=-1)
                ok = (nv2 > 0) & torch.isfinite(nv2) & (nt > 0) & torch.isfinite(nt)
                sigma = torch.where(ok, nt / c, math.nan)
                sigmas.append(torch.where(nv2 == 0, 0.0, sigma))
                unit = t / torch.where(ok, nt, 1.0).unsqueeze(-1)
                self._u[j] = torch.where(ok.unsqueeze(-1), unit, self._u0[j])
                self._c[j] = torch.where(
                    ok, pow2_scale(sigma), failed_scale(c, self._c0[j], nw, nt)
                )
        return torch.cat(sigmas)

    def _ensure_vectors(self, pieces: list[_Piece], group: Any, device: torch.device) -> bool:
        """Whether the vectors were (re)built: the same on every rank (the shapes agree)."""
        signature = tuple((p.groups, p.rows.shape[-1]) for p in pieces)
        if signature == self._signature and self._u and self._u[0].device == device:
            return False
        gen = torch.Generator(device="cpu").manual_seed(self.seed)  # the same on every rank
        self._u0 = []
        for g, k in signature:
            u = torch.randn(g, k, generator=gen)
            self._u0.append((u / u.norm(dim=-1, keepdim=True)).to(device))
        self._u = list(self._u0)
        amax = [_group_amax(p) for p in pieces]
        shared = [a for a, p in zip(amax, pieces, strict=True) if p.group is not None]
        if shared:  # every rank starts from the scale of the whole matrix
            flat = torch.cat(shared)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
            maxima = iter(flat.split([a.numel() for a in shared]))
            amax = [
                next(maxima) if p.group is not None else a
                for a, p in zip(amax, pieces, strict=True)
            ]
        self._c0 = [torch.where((a > 0) & torch.isfinite(a), pow2_scale(a), 1.0) for a in amax]
        self._c = list(self._c0)
        self._signature = signature
        return True


def weight_blocks(
    params: Sequence[tuple[str, torch.Tensor]], layers: Sequence[tuple[str, Any]]
) -> list[MatrixBlock] | None:
    """The weight probe's matrices (2-D ``params``, then each layer's Q heads and K heads of its
    ``QKLayout``) as MatrixBlocks in the same order, when some are DTensors (FSDP2); else None."""
    weights = [p for _, p in params] + [h.weight for _, lay in layers for h in (*lay.q, *lay.k)]
    if DTensor is None or not any(isinstance(w, DTensor) for w in weights):
        return None
    blocks = [MatrixBlock(p) for _, p in params]
    for _, layout in layers:
        for heads in (layout.q, layout.k):
            first = heads[0]
            blocks.append(
                MatrixBlock(first.weight, len(heads), first.dim, first.start, heads[-1].stop)
            )
    return blocks


@dataclass
class _Piece:
    rows: torch.Tensor  # (local groups, rows per group, k) float32: this rank's rows
    first: int  # index of the first local group
    groups: int
    group: Any  # process group holding the other rows; None = all rows are here


def _local_rows(w: torch.Tensor) -> tuple[torch.Tensor, int, Any]:
    """This rank's rows of ``w``, the global index of the first one, and the group sharing ``w``."""
    if DTensor is None or not isinstance(w, DTensor):
        return w, 0, None
    dims = [d for d, p in enumerate(w.placements) if p.is_shard()]
    if not dims:
        return w.to_local(), 0, None
    if len(dims) > 1 or w.placements[dims[0]].dim != 0:
        raise NotImplementedError(
            f"ShardedPowerIteration needs weights sharded on dim 0 over one mesh dim, got "
            f"{w.placements}"
        )
    n, pos = w.device_mesh.size(dims[0]), w.device_mesh.get_coordinate()[dims[0]]
    chunk = -(-w.shape[0] // n)  # torch.chunk's split, which Shard(0) and FSDP2 use
    return w.to_local(), min(pos * chunk, w.shape[0]), w.device_mesh.get_group(dims[0])


def _piece(block: MatrixBlock) -> _Piece:
    w = block.weight
    if w.dim() != 2 or block.dim not in (0, 1):
        raise ValueError(f"MatrixBlock needs a 2-D weight and dim 0 or 1, got {tuple(w.shape)}")
    start, stop = block.start, w.shape[block.dim] if block.stop is None else block.stop
    if not 0 <= start < stop <= w.shape[block.dim] or block.groups < 1:
        raise ValueError(f"MatrixBlock range [{start}, {stop}) / {block.groups} groups is invalid")
    if (stop - start) % block.groups:
        raise ValueError(f"{stop - start} rows/columns do not split into {block.groups} groups")
    size = (stop - start) // block.groups
    local, lo, group = _local_rows(w)
    if block.dim == 1:  # column groups: every group has some of this rank's rows
        a = local[:, start:stop].float()  # (m_r, G * size)
        rows = a.view(a.shape[0], block.groups, size).permute(1, 0, 2)  # (G, m_r, size)
        return _Piece(rows, 0, block.groups, group)
    k = w.shape[1]
    s, e = max(lo, start), min(lo + local.shape[0], stop)  # global rows held here
    if s >= e:
        return _Piece(local.new_zeros(0, size, k, dtype=torch.float32), 0, block.groups, group)
    a = local[s - lo : e - lo].float()
    top = (s - start) % size
    bottom = -(top + e - s) % size
    if top or bottom:  # a group split between ranks: zero rows stand for the others' rows
        a = torch.cat([a.new_zeros(top, k), a, a.new_zeros(bottom, k)])
    return _Piece(a.view(-1, size, k), (s - start) // size, block.groups, group)


def _group_amax(piece: _Piece) -> torch.Tensor:
    """(G,) float32: the largest magnitude of this rank's rows of each group (0 where none)."""
    out = torch.zeros(piece.groups, dtype=torch.float32, device=piece.rows.device)
    n = piece.rows.shape[0]
    if n and piece.rows[0].numel():
        out[piece.first : piece.first + n] = piece.rows.abs().amax((1, 2))
    return out


def _packet(piece: _Piece, u: torch.Tensor) -> torch.Tensor:
    """(G, k + 1): [A_g^T A_g u_g, ||A_g u_g||^2] over this rank's rows of each group g."""
    k = u.shape[-1]
    out = torch.zeros(piece.groups, k + 1, dtype=torch.float32, device=u.device)
    n = piece.rows.shape[0]
    if n and piece.rows.shape[1]:
        v = torch.bmm(piece.rows, u[piece.first : piece.first + n].unsqueeze(-1))  # (n, rows, 1)
        out[piece.first : piece.first + n, :k] = torch.bmm(piece.rows.transpose(1, 2), v)[..., 0]
        out[piece.first : piece.first + n, k] = v[..., 0].square().sum(-1)
    return out
