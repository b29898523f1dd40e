"""The Monitor: attaches probes to a model, closes steps, flushes statistics to rules and sinks.

Life of a step: forward hooks and post-accumulate-grad hooks fire during the user's forward and
backward; ``step()`` (called by the user after backward, or by the optimizer's step pre-hook)
reads the accumulated gradients into device-side tables; every ``flush_every`` steps ``flush()``
copies all tables to the host in one transfer per device, turns them into a ``Snapshot``, finds
events, and hands both to the sinks. No host sync happens between flushes, unless a step-level
rule (``skip_step``) is configured: it reads two scalars per step to decide before the update.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.amp.grad_scaler import OptState
from torch.distributed.algorithms.join import Joinable

from numwatch.actions.base import Action
from numwatch.actions.library import Halt, LrBackoff, QKClip, SkipStep, build_action
from numwatch.actions.optimizer_control import OptimizerControl, moves_before_closure
from numwatch.actions.swap_kernel import AttentionKernel, AttentionMode
from numwatch.buffers import (
    SETTLE_STEPS,
    LossWindow,
    NonfiniteOrigin,
    NonfiniteTracker,
    read_to_host,
)
from numwatch.config import MonitorConfig
from numwatch.distributed import (
    Aggregator,
    MonitorJoinHook,
    get_local_rank,
    get_rank,
    get_world_size,
    warn_fsdp1,
)
from numwatch.errors import NumwatchConfigError, NumwatchError, NumwatchHalt
from numwatch.events import Event, EventBus
from numwatch.gc_pause import gc_paused
from numwatch.guard import Guard
from numwatch.hooks import (
    UserHook,
    after_first_closure_call,
    remove_step_pre_hook,
    running_step_pre_hook,
    settle_step_hooks,
    warn_compiled,
)
from numwatch.integrations.transformers import check_attention_implementation
from numwatch.kernels import launch
from numwatch.kernels.host_copy import to_device
from numwatch.probes.attention import AttentionProbe
from numwatch.probes.base import ProbeContext
from numwatch.probes.optimizer import OptimizerProbe
from numwatch.probes.tensors import ActivationProbe, GradientProbe, gradients_flag
from numwatch.probes.weights import WeightProbe
from numwatch.rules import Rule, RuleEngine, at_flush, configured_rules, unadopted
from numwatch.selection import matches_any
from numwatch.sinks.base import Sink
from numwatch.sinks.console import ConsoleSink
from numwatch.sinks.jsonl import JsonlSink, LogInUse
from numwatch.sinks.prometheus import PrometheusSink
from numwatch.snapshot import MetricRecord, Snapshot

log = logging.getLogger("numwatch")

__all__ = ["Monitor"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_COMPONENTS = (
    "gradients",
    "weights",
    "optimizer",
    "activations",
    "attention",
    "step",
    "flush",
    "rules",
    "actions",
    "callbacks",
    "sinks",
)
_OPTIMIZER_ACTIONS = (SkipStep, LrBackoff, QKClip)
_LOSS_METRICS = ("loss", "loss_max", "loss_mean")  # what only step(loss) brings


def _warn_uncovered(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """skip_step, lr_backoff and qk_clip act through the attached optimizer alone: say so when
    another optimizer updates some trainable parameters (e.g. Muon for matrices, AdamW for the
    rest), since a skipped step would still apply those."""
    covered = {id(p) for group in optimizer.param_groups for p in group["params"]}
    other = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
    if other:
        shown = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
        log.warning(
            "numwatch: the attached optimizer does not update %d trainable parameters (%s); "
            "skip_step, lr_backoff and qk_clip act through it alone, so another optimizer "
            "still applies its updates to those",
            len(other),
            shown,
        )


def _refuse_lazy_parameters(model: nn.Module) -> None:
    """Lazy modules (nn.LazyLinear...) have no parameter shapes until their first forward: the
    weight and gradient probes, which take their parameters at attach, cannot read them."""
    lazy = [n for n, p in model.named_parameters() if nn.parameter.is_lazy(p)]
    if lazy:
        raise NumwatchConfigError(
            f"the model has uninitialized lazy parameters ({', '.join(lazy[:3])}"
            f"{', ...' if len(lazy) > 3 else ''}): run one forward pass (a dummy batch) before "
            "Monitor.attach(), so that they have their shapes"
        )


_last_default_name = ["", 0]  # the last default run name of this process, and its count


def _default_run_name() -> str:
    """``run-<UTC second>``; monitors made within one second in one process (a GAN's two) get
    ``-2``, ``-3``... so that their default logs do not mix."""
    base = datetime.datetime.now(datetime.timezone.utc).strftime("run-%Y%m%dT%H%M%SZ")
    n = _last_default_name[1] + 1 if _last_default_name[0] == base else 1
    _last_default_name[:] = [base, n]
    return base if n == 1 else f"{base}-{n}"


def _next_run_name(name: str) -> str:
    """``run-<second>`` -> ``run-<second>-2`` -> ``-3``..."""
    base, _, n = name.rpartition("-")
    return f"{base}-{int(n) + 1}" if n.isdigit() and base.endswith("Z") else f"{name}-2"


def _check_loss(loss: Any) -> None:
    """A loss ``step(loss=...)`` can record: a number or a one-element tensor."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(
                f"step(loss=...) needs a scalar loss, got shape {tuple(loss.shape)} (reduce "
                "per-sample losses first, e.g. loss.mean())"
            )
    elif loss is not None and not isinstance(loss, int | float):
        raise TypeError(f"step(loss=...) takes a tensor or a number, got {type(loss).__name__}")


def _comparable(settings: Any) -> Any:
    """Settings as the ranks can compare them: a callable by its name (its repr holds an
    address, which differs between processes), and without the paths a rank may set for
    itself (a snapshot ``directory`` with $RANK), which decide no collective."""
    if callable(settings):
        module = getattr(settings, "__module__", None)
        return f"{module}:{getattr(settings, '__qualname__', type(settings).__qualname__)}"
    if isinstance(settings, Mapping):
        return {k: _comparable(v) for k, v in settings.items() if k != "directory"}
    if isinstance(settings, list | tuple):
        return [_comparable(v) for v in settings]
    return settings


class Monitor(Joinable):
    """Numerical health monitor for one model.

    >>> monitor = numwatch.Monitor(model).attach(optimizer)
    >>> ...  # train as usual; the optimizer's step pre-hook closes each step
    >>> monitor.detach()
    """

    def __init__(
        self,
        model: nn.Module,
        config: MonitorConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        **overrides: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Monitor needs a torch.nn.Module, got {type(model).__name__}")
        super().__init__()  # Joinable: outside a Join, its config is the disabled one
        # torch.compile(model) wraps the module: its names would all start with '_orig_mod.'
        # (user globs would select nothing) and the model itself would count as a submodule
        if type(model).__name__ == "OptimizedModule":
            model = model._orig_mod
        self.model = model
        self.config = MonitorConfig.load(config, **overrides)
        self.events: deque[Event] = deque(maxlen=self.config.events_kept)  # the most recent
        self.rank = get_rank()
        self.run_name = self.config.run_name or _default_run_name()
        self._bus = EventBus()
        self._guard = Guard(self.config.strict)
        self._ctx = ProbeContext(
            guard=self._guard,
            tracker=NonfiniteTracker(),
            backend=self.config.kernel_backend,
            underflow_dtype=_DTYPES.get(self.config.underflow_dtype or ""),
            step=self.config.first_step,
        )
        self._probes: list[Any] = []
        self._sinks: list[Sink] = []
        self._jsonl_path: str | None = None
        self._optimizer_handles: list[Any] = []
        self._activity_handle: Any = None
        self._attention_checks: list[Any] = []  # first-forward checks of HF models' attention
        self._forwards_since_flush = False  # a forward of the model ran since the last flush
        self._pending_losses: list[tuple[int, torch.Tensor]] = []  # (order, loss) since a flush
        self._loss_window = LossWindow()
        self._attached = False
        self._snapshot: Snapshot | None = None
        self._last_close = ""  # who closed the last step: 'user' | 'optimizer' | 'late-loss'
        self._loss: torch.Tensor | float | None = None
        self._window_steps = 0
        self._window_start = 0.0
        self._attention: AttentionProbe | None = None
        self._gradients: GradientProbe | None = None
        self._activations: ActivationProbe | None = None
        # Kernel routing changes wait for a step boundary: (layer glob or None = all, kernel).
        self._pending_routes: list[tuple[str | None, AttentionKernel | None]] = []
        self._engine, self._actions = self._build_rules()
        # the user's rules on the loss, until a first loss comes (warned about if none does)
        added = {rule.name for rule in self.config.rules.add}
        self._loss_rules = sorted(
            r.name for r in self._engine.rules if r.name in added and r.metric in _LOSS_METRICS
        )
        # names this monitor's records in the log: a resumed run (a new process, the same
        # run_name and step numbers going on) starts its rules over, and replay with them
        self.monitor_id = secrets.token_hex(4)
        self._dist = Aggregator(self.config.distributed)  # cross-rank values (distributed.py)
        self._local_snapshot: Snapshot | None = None  # this rank's own values (per-rank JSONL)
        self._control: OptimizerControl | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._history: deque[Snapshot] = deque(maxlen=self.config.history)
        self._event_counts: Counter[tuple[str, str]] = Counter()
        self._unsent_events: list[Event] = []  # raised between flushes, for the next flush's sinks
        self._errors_flushed: Counter[str] = Counter()  # failures the last flush record counts
        # Re-entrancy: callbacks and actions run inside a step close or a flush (see flush()).
        self._depth = 0  # step closes and flushes under way
        self._flushing = False
        self._detaching = False
        self._detach_deferred = False
        self._detach_within = False  # the deferred detach's within_step
        self._detach_flush = True  # and its flush (False if any request asked for none)
        self._skipped_earlier = 0  # updates skipped while attached before (re-attach)
        self._scale_drops: torch.Tensor | None = None  # loss-scale drops counted before
        self._scaler: Any = None  # the attached GradScaler
        self._rules_step: int | None = None  # the step of the last flush the rules judged
        self._late_losses = False  # step(loss) comes after optimizer.step() in this loop
        # (step, order) reserved for that late loss at its step's close: a NaN loss is the
        # origin, not the gradients it made, whose orders the close reserves next
        self._late_loss_order: tuple[int, int] | None = None
        # the routing of the step just closed, where routes queued during it changed it since
        self._closed_routing: dict[str, AttentionKernel | None] | None = None
        self._flush_after_loss = False  # a flush waits for that late loss
        self._closing_step = False  # inside a step close, before the step counts as closed
        self._flush_deferred = False  # flush() called there: it runs when the close ends
        self._told_nested_flush = False
        self._told_no_optimizer = False  # steps closed with optimizer actions and no optimizer

    # ----------------------------------------------------------------------------- lifecycle
    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def steps(self) -> int:
        """Number of steps closed so far (the index of the step in progress)."""
        return self._ctx.step

    def attach(
        self, optimizer: torch.optim.Optimizer | None = None, *, scaler: Any = None
    ) -> Monitor:
        """Add the hooks (idempotent). With ``optimizer``, its step pre-hook closes each step
        and the optimizer probe measures updates; ``scaler`` (a GradScaler) adds its loss scale,
        also given to a later call than the optimizer's. An attach that fails leaves the model
        and the optimizer as they were. Accelerate's ``AcceleratedOptimizer`` is unwrapped (as
        the Hugging Face callback does), with its GradScaler where ``scaler`` is not given.
        """
        accelerated = None  # Accelerate's wrapper of the optimizer, given instead of it
        if isinstance(optimizer, torch.optim.Optimizer) and not hasattr(
            optimizer, "_optimizer_step_pre_hooks"
        ):  # a wrapper that never ran Optimizer.__init__: no hooks of its own
            inner = getattr(optimizer, "optimizer", None)  # Accelerate's: its steps run inner's
            if not isinstance(inner, torch.optim.Optimizer):
                raise NumwatchError(
                    f"attach(optimizer=...): {type(optimizer).__name__} is a torch Optimizer "
                    "without step hooks (it never ran Optimizer.__init__): pass the optimizer "
                    "it wraps"
                )
            scaler = scaler if scaler is not None else getattr(optimizer, "scaler", None)
            accelerated, optimizer = optimizer, inner
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "attach(optimizer=...) needs a torch.optim.Optimizer, "
                f"got {type(optimizer).__name__}"
            )
        if optimizer is not None and self._optimizer not in (None, optimizer):
            raise NumwatchError(
                "this monitor already watches another optimizer: numwatch closes steps on one "
                "optimizer (detach() first to switch)"
            )
        if scaler is not None and self._scaler not in (None, scaler):
            raise NumwatchError(
                "this monitor already watches another GradScaler (detach() first to switch)"
            )
        first = not self._attached
        self._attached = True
        try:
            if first:
                self._start_window()
                if self.config.enabled:
                    _refuse_lazy_parameters(self.model)
                    self._attention_checks = check_attention_implementation(self.model)
                    warn_fsdp1(self.model)
                    warn_compiled(self.model)
                    self.rank = get_rank()  # torch.distributed may start after __init__
                    self._dist.forget_layouts()
                    self._dist.agree(self._aggregation_settings())  # before any hook
                    shared = self._dist.shared_name(self.run_name)  # on every rank
                    if self.config.run_name is None:  # a default name: one for the job
                        self.run_name = shared
                    launch.CUDA_GRAPHS = self.config.cuda_graphs
                    self._build_probes()
                    self._build_sinks(scaler=scaler is not None)
                    # A step is under way once the model runs (step()/optimizer hook need it).
                    self._activity_handle = self.model.register_forward_pre_hook(
                        UserHook(self._mark_activity)
                    )
            if optimizer is not None and self.config.enabled and self._optimizer is None:
                self._attach_optimizer(optimizer, scaler or self._scaler, accelerated)
            elif scaler is not None and self.config.enabled:
                self._use_scaler(scaler)
        except BaseException:
            if first:
                self._teardown()
            raise
        return self

    def _start_window(self) -> None:
        """An attach starts a clean window: what a ``detach(flush=False)`` left unwritten (its
        steps, losses, NaN origins) belongs to the session it ended, and the detach's final
        flush is not this window's overhead."""
        self._window_steps = 0
        self._window_start = time.perf_counter()
        self._guard.overhead_seconds = 0.0
        self._pending_losses.clear()
        self._loss_window.reset()
        self._loss = None
        self._ctx.tracker.reset()
        self._ctx.activity = False
        self._late_loss_order = None
        self._flush_after_loss = False
        self._forwards_since_flush = False

    def _aggregation_settings(self) -> dict[str, Any]:
        """What decides when a rank's monitor issues collectives, and which (distributed)."""
        cfg = self.config
        probes = ("gradients", "activations", "attention", "weights", "optimizer")
        out: dict[str, Any] = {"flush_every": cfg.flush_every, "distributed": cfg.distributed}
        for name in probes:  # their selections decide the layouts the ranks combine
            out[name] = getattr(cfg, name).model_dump()
        # Rules decide actions (a skip on one rank only desyncs DDP replicas), step-level ones
        # collectives too.
        out["rules"] = sorted(repr(_comparable(r.model_dump())) for r in self._engine.rules)
        out["step_rules"] = sorted(r.name for r in self._engine.step_rules)
        # the actions that run (none with rules.act off): one rank backing off alone forks them
        out["actions"] = sorted(
            repr((name, [_comparable(a.model_dump()) for a in acts]))
            for name, acts in self._actions.items()
        )
        return out

    def _attach_optimizer(
        self, optimizer: torch.optim.Optimizer, scaler: Any, accelerated: Any = None
    ) -> None:
        settle_step_hooks(optimizer)  # hooks a detach inside a step left inert
        self._optimizer = optimizer
        self._scaler = scaler
        actions = [a for acts in self._actions.values() for a in acts]
        uses_optimizer = any(isinstance(a, _OPTIMIZER_ACTIONS) for a in actions)
        # A halt decided in the closure of a step that moved the parameters first (SAM's
        # ascent) puts them back before it stops training: only the wrapper copies them.
        halts = any(isinstance(a, Halt) for a in actions)
        wrapped = uses_optimizer or (halts and moves_before_closure(optimizer))
        # The control before the probe: its step pre-hook, where it withholds an update its
        # wrapper did not see by clearing the gradients, runs before the probe's reads them.
        if wrapped:  # the step wrapper closes steps itself, before deciding a skip
            if uses_optimizer:
                _warn_uncovered(self.model, optimizer)
            self._control = OptimizerControl(
                optimizer,
                self._before_optimizer_update,
                partial(self._guard.run, "actions"),
                accelerated,
                skips=bool(self._engine.step_rules),
                judge_again=self._judge_evaluation,
                halts=halts,
            )
        if self.config.optimizer.enabled:
            probe = OptimizerProbe(
                self.model, optimizer, self.config.optimizer, self._ctx, scaler, self._scale_drops
            )
            self._probes.append(probe)
            probe.attach()
        if not wrapped:
            self._optimizer_handles = [
                optimizer.register_step_pre_hook(
                    UserHook(running_step_pre_hook(self._on_optimizer_step))
                ),
            ]

    def _use_scaler(self, scaler: Any) -> None:
        """A GradScaler passed to a later attach() than the optimizer's (AMP set up after the
        monitor): its overflows are ``scaler_overflow`` anomalies from now on, not critical
        ``nonfinite`` events, and the optimizer probe reports its scale."""
        self._scaler = scaler
        for probe in self._probes:
            if isinstance(probe, OptimizerProbe):
                probe.scaler = scaler

    def detach(self, *, within_step: bool = False, flush: bool = True) -> None:
        """Flush what is pending, remove every hook, close the sinks. The model is as before,
        also when that last flush raises (a halt rule): the hooks go first, then it propagates,
        and what that flush's actions did is in the log.

        Called from a callback or an action (inside a step close or a flush), it waits for the
        end of that close or flush: the hooks it would remove are still being run; from inside
        a detach (a callback of its own last flush), it does nothing more. ``within_step``: the
        step was closed and its optimizer.step() is still to come (a framework's callback after
        a halt): a skip_step decided for it still withholds that update. ``flush=False``: no
        last flush, so the steps since the previous one are not written; for a rank that stops
        alone in a distributed run (an exception), where that flush's collectives would wait
        for ranks that never join them.
        """
        if not self._attached or self._detaching:
            return
        if self._depth:
            self._detach_deferred = True
            # asked inside a step close (a step-level callback): that step's optimizer.step()
            # is still to come, and a skip decided for it holds
            self._detach_within = self._detach_within or within_step or self._closing_step
            self._detach_flush = self._detach_flush and flush
            return
        self._detaching = True
        try:
            # forwards after the last closed step (a final validation, an inference loop) hold
            # statistics where a probe measures outside training (training_only false). Not
            # in a distributed run: its flush is collective, and one rank's evaluation (rank 0's
            # alone, often) would leave the others' detach without it.
            evaluated = (
                self._forwards_since_flush
                and not self._dist.active
                and not (
                    self.config.activations.training_only and self.config.attention.training_only
                )
            )
            if flush and (self._window_steps or evaluated) and self.config.enabled:
                self.flush()
        finally:
            self._guard.run("sinks", self._emit_late_events)
            self._warn_unflushed_errors()
            self._teardown(keep_skip=within_step)
            self._detaching = False

    def _teardown(self, keep_skip: bool = False) -> None:
        """Remove whatever attach installed (all of it, or what a failed attach got to)."""
        for probe in self._probes:
            probe.detach()
            if isinstance(probe, OptimizerProbe) and probe.drops is not None:
                self._scale_drops = probe.drops  # a counter: the next attach goes on from it
        if self._activity_handle is not None:
            self._activity_handle.remove()
            self._activity_handle = None
        for handle in self._attention_checks:
            handle.remove()
        self._attention_checks = []
        for handle in self._optimizer_handles:
            remove_step_pre_hook(self._optimizer, handle)
        if self._control is not None:
            self._control.uninstall(keep_skip)
            self._skipped_earlier += self._control.skipped_steps  # a counter: never goes back
            self._control = None
        for sink in self._sinks:
            self._guard.run("sinks", sink.close)
        self._probes, self._sinks, self._optimizer_handles = [], [], []
        self._attention = self._gradients = self._activations = None
        self._optimizer = None
        self._scaler = None
        self._pending_routes.clear()
        self._attached = False

    def __enter__(self) -> Monitor:
        return self.attach()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.detach()
            return
        try:  # the block's own exception (Ctrl-C, a bug) is the one that propagates
            self.detach()
        except NumwatchHalt as halt:
            log.warning(
                "numwatch: the final flush, after %s left the block, halted: %s",
                getattr(exc_type, "__name__", exc_type),
                halt,
            )

    def _build_probes(self) -> None:
        cfg = self.config
        if cfg.gradients.enabled:
            self._gradients = GradientProbe(
                self.model, cfg.gradients, self._ctx, every_step=bool(self._engine.step_rules)
            )
            self._probes.append(self._gradients)
        if cfg.activations.enabled:
            self._activations = ActivationProbe(self.model, cfg.activations, self._ctx)
            self._probes.append(self._activations)
        if cfg.weights.enabled:
            aggregate = self.config.distributed.aggregate
            self._probes.append(WeightProbe(self.model, cfg.weights, self._ctx, aggregate))
        # Always present: besides statistics it routes attention calls (kernel hot-swap).
        self._attention = AttentionProbe(self.model, cfg.attention, self._ctx)
        self._probes.append(self._attention)
        for probe in self._probes:
            probe.attach()

    def _build_sinks(self, scaler: bool = False) -> None:
        """``scaler``: a GradScaler comes with the optimizer (its overflows are events too)."""
        cfg = self.config.sinks
        per_rank = self.config.distributed.jsonl == "per_rank"
        shared_path = per_rank and "{rank}" not in cfg.jsonl.path and get_world_size() > 1
        if cfg.jsonl.enabled and shared_path:
            raise NumwatchConfigError(
                f"sinks.jsonl.path {cfg.jsonl.path!r} has no {{rank}} while "
                "distributed.jsonl='per_rank': every rank would append to that one file"
            )
        if cfg.jsonl.enabled and (self.rank == 0 or per_rank):
            # the config refused any field but {run_name} and {rank}
            self._jsonl_path = cfg.jsonl.path.format(run_name=self.run_name, rank=self.rank)
            self._sinks.append(self._jsonl_sink())
        if cfg.console.enabled and self.rank == 0:
            self._sinks.append(ConsoleSink(every=cfg.console.every))
        # a taken port raises NumwatchError (attach() undoes itself)
        exporter = PrometheusSink.from_config(
            cfg.prometheus,
            rank=self.rank,
            local_rank=get_local_rank(),
            run_name=self.run_name,
            known_events=[
                *((rule.kind, rule.name) for rule in self._engine.rules),
                *(("action", name) for name, acts in self._actions.items() if acts),
                ("nonfinite", "nonfinite"),  # the monitor's own, where no rule adopts it
                *([("anomaly", "scaler_overflow")] if scaler else []),
            ],
        )
        if exporter is not None:
            self._sinks.append(exporter)

    def _jsonl_sink(self) -> JsonlSink:
        """The log's sink; a default run name whose log another monitor writes (another
        process started in the same second: a sweep, a job array) takes the next suffix."""
        cfg = self.config.sinks.jsonl
        for _ in range(1000):
            try:
                return JsonlSink(
                    self._jsonl_path, self.run_name, cfg.every, cfg.exclude, self.monitor_id
                )
            except LogInUse as err:
                if self.config.run_name is not None or "{run_name}" not in cfg.path:
                    raise  # a name or a path of the user's own: theirs to change
                if get_world_size() > 1:  # each rank would pick its own suffix: names could
                    raise LogInUse(  # pair one job's rank 0 with another job's rank 1
                        f"{err} (a default run name is not renamed in a distributed run, whose "
                        "ranks must agree on it: set run_name, e.g. from the job id)"
                    ) from None
                self.run_name = _next_run_name(self.run_name)
                self._jsonl_path = cfg.path.format(run_name=self.run_name, rank=self.rank)
        raise NumwatchError(f"no free default log name after {self.run_name!r}")

    @property
    def prometheus_url(self) -> str | None:
        """Scrape URL of this process's Prometheus exporter while attached (sinks.prometheus)."""
        urls = [s.url for s in self._sinks if isinstance(s, PrometheusSink)]
        return urls[0] if urls else None

    @property
    def jsonl_path(self) -> str | None:
        """Path of this run's JSONL log, if that sink is on (also after detach)."""
        return self._jsonl_path

    # ----------------------------------------------------------------------------- steps
    def step(self, loss: torch.Tensor | float | None = None) -> None:
        """Close one training step: after backward, before the optimizer update.

        With an optimizer passed to ``attach``, its step pre-hook already does this; a call made
        after ``optimizer.step()`` in the same iteration then only records ``loss``.
        """
        if not self._attached:
            raise NumwatchError("Monitor.step() before attach(): call monitor.attach() first")
        if not self.config.enabled:
            return
        _check_loss(loss)  # the caller's mistake: raised here, not counted as a failed step
        if self._last_close == "optimizer" and not self._ctx.activity:
            # The step this loss belongs to was closed without it (a step-level rule judged it
            # without its loss). Its flush waits for it: from now on, a flush due at an
            # optimizer close runs here (or at the next close, if no loss comes).
            self._guard.run("step", self._record_loss, loss, self._ctx.step - 1)
            self._last_close = "late-loss"
            self._late_losses = True
            self._run_waiting_flush()
            return
        self._last_close = "user"  # before closing: a halt raised by the flush leaves it right
        if self._optimizer is None and not self._told_no_optimizer:
            self._warn_no_optimizer()
        self._close_step(loss)

    def _warn_no_optimizer(self) -> None:
        """skip_step and lr_backoff act through the attached optimizer: steps closed with none
        attached (``attach()`` alone, as ``with Monitor(model) as m:`` does) let through the
        update they should withhold or slow, with only a failed action on record at the NaN.
        Said once, at the first such step: ``attach()`` then ``attach(optimizer)`` is fine."""
        self._told_no_optimizer = True
        needing = {
            f"{name} ({action.type})"
            for name, acts in self._actions.items()
            for action in acts
            if isinstance(action, SkipStep | LrBackoff)
        }
        if needing:
            log.warning(
                "numwatch: rules %s act through the optimizer, and none is attached: their "
                "actions would fail and the updates they should withhold or slow would reach "
                "the weights; call monitor.attach(optimizer) before training",
                ", ".join(sorted(needing)),
            )

    def _on_optimizer_step(self, _optimizer: Any, args: tuple, kwargs: dict) -> Any:
        # step(closure) computes the gradients inside: close after the closure's first call,
        # with the loss it returned
        wrapped = after_first_closure_call(
            args,
            kwargs,
            lambda loss: self._before_optimizer_update(
                loss if isinstance(loss, torch.Tensor) else None
            ),
        )
        if wrapped is None:
            self._before_optimizer_update()
        return wrapped

    def _before_optimizer_update(self, loss: torch.Tensor | None = None) -> None:
        if self._last_close == "user" and not self._ctx.activity:
            return  # the user closed this step already
        self._last_close = "optimizer"
        self._close_step(loss)

    @torch.inference_mode(False)
    def _close_step(self, loss: torch.Tensor | float | None) -> None:
        # Never in inference mode (a step closed in an evaluation pass): the tables made lazily
        # here must stay normal tensors, or every later in-place update of them fails.
        self._run_waiting_flush()  # a step with no forward through the model (hooks only)
        self._depth += 1
        try:
            self._guard.run("step", self._dist.settle, self._ctx.step)  # a rank joined? (Join)
            self._closing_step = True
            try:
                self._guard.run("step", self._close_step_body, loss)
            finally:  # a halt from a step-level rule still closes its step (counted, labelled)
                self._closing_step = False
                self._ctx.activity = False
                # the flush of this step reports the kernels it ran, not those routed from now
                self._closed_routing = self.attention_routing() if self._pending_routes else None
                self._apply_routes()
                self._ctx.step += 1
                self._window_steps += 1
            if self._window_steps >= self.config.flush_every or self._flush_deferred:
                self._flush_deferred = False
                if self._late_losses and self._last_close == "optimizer":
                    self._flush_after_loss = True  # with the loss step(loss) brings after it
                else:
                    self.flush()
        finally:
            self._leave()

    def _close_step_body(self, loss: torch.Tensor | float | None) -> None:
        if self._control is not None:
            self._control.new_step()
        # Outputs of modules run outside the model's forward (Lightning's training_step calls
        # submodules) are still held: they came before the loss and the gradients, so they take
        # their order numbers first, and a NaN they hold is named as the origin.
        if self._activations is not None:
            self._guard.run("activations", self._activations.end_forward)
        # The loss next: it came before the gradients, so a NaN loss is named as the origin.
        # Guarded on its own: a loss it cannot read (an optimizer closure's) costs the loss only.
        loss = self._guard.run("step", self._record_loss, loss, self._ctx.step)
        if loss is None and self._late_losses:  # its order now, before the gradients'
            origin = NonfiniteOrigin("loss", "", "loss", self._ctx.step)
            self._late_loss_order = (self._ctx.step, self._ctx.tracker.next_order(origin))
        self._ctx.grad_scale = self._guard.run("step", self._gradient_scale)
        for probe in self._probes:
            if hasattr(probe, "on_step"):
                self._guard.run(probe.component, probe.on_step)
        self._dist.on_step(self._gradients)  # this rank's share of the global gradient norm
        if self._engine.step_rules:
            self._check_step(loss)

    def _check_step(self, loss: torch.Tensor | float | None) -> None:
        """Step-level rules (their actions decide before this step's optimizer update), on this
        step's values only: ``loss`` is None when the step closed without one (a loss recorded
        after optimizer.step() comes too late to judge its step, and an older one is not it).

        SYNC: one read of two scalars per step, only when such a rule is configured (skip_step).
        """
        # NaN where a gradient the optimizer applies and the probe does not watch is non-finite
        unwatched = None
        if self._gradients is not None and self._optimizer is not None:
            unwatched = self._gradients.unwatched_flag(self._optimizer)
        if self._dist.active:  # global values, so that every rank takes the same decision
            named = self._dist.step_values(loss, unwatched)
        else:
            norm_sq = self._gradients.step_norm_sq() if self._gradients is not None else None
            if unwatched is not None:
                norm_sq = unwatched if norm_sq is None else norm_sq + unwatched.to(norm_sq.device)
            named = {"grad_norm": norm_sq, "loss": loss}
        scale = self._scaler_scale()
        if scale is not None:  # read with the others: no extra sync
            named["loss_scale"] = scale
        on_device = {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}
        values = {k: float(v) for k, v in named.items() if isinstance(v, float)}
        if on_device:
            host = torch.stack([t.to(torch.float64) for t in on_device.values()]).tolist()
            values.update(zip(on_device, host, strict=True))
        if "grad_norm" in values:
            values["grad_norm"] = math.sqrt(values["grad_norm"])  # NaN stays NaN
        scale_now = values.pop("loss_scale", None)
        if (
            scale_now is not None
            and scale_now > 1.0
            and math.isfinite(values.get("loss", 0.0))
            and not math.isfinite(values.get("grad_norm", 0.0))
        ):
            del values["grad_norm"]  # the scaler's overflow (_scaler_overflows): it skips it
        values["nonfinite"] = sum(values.values())  # non-finite iff one of them is
        fired = self._guard.run("rules", self._engine.evaluate_step, self._ctx.step, values) or []
        for event, _ in fired:
            self._event_counts[(event.kind, event.rule)] += 1
        self._publish([e for e, _ in fired])
        self._run_actions(fired)

    @torch.inference_mode(False)
    def _judge_evaluation(self, loss: Any) -> None:
        """A later call of the closure of the step under way (SAM's at its perturbed weights,
        LBFGS's line search), whose gradients the optimizer's update uses too: the step-level
        nonfinite rules fire, and their actions (skip_step) run, on a NaN/Inf in the gradients
        of the attached optimizer's parameters or in the loss it returned.

        SYNC: one read of two scalars (one all-reduce when distributed) per such call, only with
        a nonfinite rule that has skip_step.
        """
        if not self._engine.judges_evaluations or self._optimizer is None:
            return
        params = [p for group in self._optimizer.param_groups for p in group["params"]]
        flag = self._guard.run("step", gradients_flag, params)  # () float64: 0, or NaN
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().reshape(()) if loss.numel() == 1 and not loss.is_meta else None
        elif isinstance(loss, bool) or not isinstance(loss, int | float):
            loss = None
        on_device = [t for t in (flag, loss) if isinstance(t, torch.Tensor)]
        host = []
        if on_device:
            device = on_device[0].device
            host = torch.stack([t.to(device, torch.float64) for t in on_device]).tolist()  # SYNC
        bad = host.pop(0) if flag is not None else 0.0
        value = host.pop(0) if isinstance(loss, torch.Tensor) else loss
        if self._dist.active:  # every rank decides alike
            bad, total, n = self._dist.sum_over_ranks(
                [float(not math.isfinite(bad)), value or 0.0, float(value is not None)]
            )
            bad = math.nan if bad else 0.0
            value = total / n if n else None
        named = {"grad_norm": bad}  # a flag: 0, or NaN (its rules read only whether it is finite)
        if value is not None:
            named["loss"] = value
        named["nonfinite"] = sum(named.values())
        self._depth += 1
        self._closing_step = True  # a detach asked from here keeps the skip for this update
        try:
            fired = (
                self._guard.run("rules", self._engine.judge_evaluation, self._ctx.step - 1, named)
                or []
            )
            for event, _ in fired:
                self._event_counts[(event.kind, event.rule)] += 1
            self._publish([e for e, _ in fired])
            self._run_actions(fired)
        finally:
            self._closing_step = False
            self._leave()

    @torch.no_grad()
    def _record_loss(
        self, loss: torch.Tensor | float | None, step: int
    ) -> torch.Tensor | float | None:
        """Record the loss of ``step``; returns the value kept (detached, or a float)."""
        if loss is None or (isinstance(loss, torch.Tensor) and loss.is_meta):
            return None  # a meta loss (a dry run) has no value to read
        self._loss_rules = []  # a loss came: the rules on it are fed
        _check_loss(loss)
        reserved, self._late_loss_order = self._late_loss_order, None

        def order() -> int:
            if reserved is not None and reserved[0] == step:  # a late loss: its step's order
                return reserved[1]
            return self._ctx.tracker.next_order(NonfiniteOrigin("loss", "", "loss", step))

        if isinstance(loss, torch.Tensor):
            value = loss.detach().reshape(())
            # Checked for NaN/Inf in batches at flush: no launches on the per-step path.
            self._pending_losses.append((order(), value))
            if len(self._pending_losses) >= SETTLE_STEPS:
                self._settle_losses()
            self._loss = value
        else:
            self._loss = float(loss)
            self._loss_window.add_float(self._loss)
            if not math.isfinite(self._loss):  # a host value: knowing it costs nothing
                self._ctx.tracker.observe_many(
                    torch.tensor([float(order())], dtype=torch.float64),
                    torch.ones(1, dtype=torch.float64),
                )
        return self._loss

    @torch.no_grad()
    def _settle_losses(self) -> None:
        pending, self._pending_losses = self._pending_losses, []
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for order, value in pending:
            by_device.setdefault(value.device, []).append((order, value))
        for device, items in by_device.items():
            values = torch.stack([v.to(torch.float64) for _, v in items])
            orders = to_device([float(o) for o, _ in items], torch.float64, device)
            self._ctx.tracker.observe_many(orders, (~torch.isfinite(values)).to(torch.float64))
            self._loss_window.add_tensor(values)

    # ----------------------------------------------------------------------------- kernels
    def swap_attention(
        self,
        layers: str | Iterable[str] | None = None,
        *,
        stabilize: bool = True,
        beta: float = 2.0,
        mode: AttentionMode = "stabilized",
        split_sum: bool = False,
    ) -> None:
        """Route the SDPA calls of ``layers`` (globs over module paths; None = all) to numwatch's
        flash-attention kernel, from the next step boundary on (now, if between steps). A glob
        takes the layers calling SDPA inside the modules it matches too (a block's path)."""
        kernel = AttentionKernel(stabilize=stabilize, beta=beta, mode=mode, split_sum=split_sum)
        if mode.startswith("paper_repro"):
            log.warning(
                "numwatch: attention routed to mode %r, an emulation of the paper's failing "
                "kernel for reproductions and tests (metric attn_kernel_mode{layer,mode}); "
                "not for training",
                mode,
            )
        self._queue_routes(layers, kernel)

    def restore_attention(self, layers: str | Iterable[str] | None = None) -> None:
        """Send ``layers`` (None = all) back to native SDPA, from the next step boundary on."""
        self._queue_routes(layers, None)

    def _queue_routes(self, layers: str | Iterable[str] | None, kernel: Any) -> None:
        if not self._attached or not self.config.enabled:
            raise NumwatchError("attention routing needs an attached, enabled monitor")
        # a list once: a generator was used up by the check below and routed nothing
        patterns = [None] if layers is None else [layers] if isinstance(layers, str) else [*layers]
        bad = [p for p in patterns if p is not None and not isinstance(p, str)]
        if bad:
            raise TypeError(
                f"layers must be module-path globs (str), got {type(bad[0]).__name__} {bad[0]!r}"
            )
        names = [name for name, _ in self.model.named_modules()]
        for p in patterns:
            if p is not None and not matches_any(names, p):  # a typo would route nothing
                log.warning(
                    "numwatch: layer pattern %r matches no module path of the model (paths "
                    "as in named_modules(), e.g. %r); no call is routed by it",
                    p,
                    names[-1],
                )
        self._pending_routes += [(p, kernel) for p in patterns]
        if not self._ctx.activity:  # between steps: nothing of this step has run yet
            self._apply_routes()

    def attention_routing(self) -> dict[str, AttentionKernel | None]:
        """The kernel each attention layer seen is routed to now (None: native SDPA). Calls the
        kernel cannot run (dropout, fp32...) still go to SDPA: attn_kernel_stabilized counts
        the share of a step's calls that ran it."""
        out: dict[str, AttentionKernel | None] = {}
        for layer in sorted(self._attention.layers_seen if self._attention else ()):
            kernel = self.attention_kernel(layer)
            out[layer] = kernel if self.attention_routable(layer) else None
        return out

    def attention_routable(self, layer: str) -> bool:
        """Whether a route can take ``layer``'s attention: it calls SDPA (not eager softmax, not
        numwatch's kernel directly, not inside nn.MultiheadAttention)."""
        probe = self._attention
        return probe is not None and layer in probe.sdpa_layers and layer not in probe.unroutable

    def _apply_routes(self) -> None:
        if self._attention is None:
            return
        for pattern, kernel in self._pending_routes:
            if pattern is None and kernel is None:
                self._attention.clear_routes()
            else:
                self._attention.set_route(pattern or "*", kernel)
        self._pending_routes.clear()

    def attention_kernel(self, layer: str) -> AttentionKernel | None:
        """The kernel ``layer``'s SDPA calls are routed to now (None = native SDPA)."""
        if self._attention is None:
            return None
        kernel = self._attention.route_for(layer)
        return kernel if isinstance(kernel, AttentionKernel) else None

    # --- integrations: training steps that run submodules without calling model.forward
    def _run_waiting_flush(self) -> None:
        """The flush that waits for a late loss: run by that loss, or, where none comes, when
        the next training step begins, before any of its hooks record (it would carry their
        values). A flush clears the wait."""
        if self._flush_after_loss:
            self.flush()

    def _mark_activity(self, *_: Any) -> None:
        # An evaluation forward (no_grad, inference_mode) between optimizer.step() and a late
        # step(loss) is not part of a training step: it must not make that call close one, nor
        # count in the activation statistics (training_only).
        # (A model in eval mode with grad on may be training, e.g. without dropout: its forward
        # begins a step.)
        grad = torch.is_grad_enabled()
        self._ctx.eval_forward = self._eval_forward()
        self._forwards_since_flush = True
        if grad:
            self._run_waiting_flush()
            self._ctx.activity = True
        if self._join_config.enable:  # inside Join: tell joined ranks this one still trains
            self._guard.run("step", self._dist.announce, self)

    def _eval_forward(self) -> bool:
        """A forward starting now is no training forward: no grad, or the model in eval mode."""
        return not torch.is_grad_enabled() or not self.model.training

    def begin_forward(self) -> None:
        """Open one forward of the model by hand (attention interception and kernel routing
        follow model.forward otherwise); Lightning's training_step needs it. Pair each call
        with ``end_forward()``; nested real forwards inside are fine. Under no_grad (a
        validation batch) it opens no training step, as the model's own forward would not.
        The modules run until ``end_forward()`` belong to this forward, as they would to the
        model's: with grad on and the model in train mode, a reentrant checkpoint's no_grad
        forward and a submodule kept in eval mode are measured (activations.training_only)."""
        self._ctx.eval_forward = self._ctx.opened_eval_forward = self._eval_forward()
        self._forwards_since_flush = True
        if torch.is_grad_enabled():
            self._run_waiting_flush()
            self._ctx.activity = True  # no Join flag: the model's own forward may follow
        if self._attention is not None:
            self._attention.begin_forward()

    def end_forward(self) -> None:
        """Close the forward ``begin_forward()`` opened."""
        self._ctx.eval_forward = self._ctx.opened_eval_forward = None
        if self._activations is not None:
            self._guard.run("activations", self._activations.end_forward)
        if self._attention is not None:
            self._attention.end_forward()

    # --- uneven inputs: ``with Join([ddp, monitor]):`` (after DDP), see distributed.announce
    def join_hook(self, **kwargs: Any) -> MonitorJoinHook:
        """Join calls this in its constructor: attach before, detach after the Join block. A
        monitor that is not attached (or disabled) has no forward hook to announce with, so it
        makes no flags group and its join hook does nothing."""
        if self._attached and self.config.enabled:
            self._dist.join_group()
        return MonitorJoinHook(self._dist, lambda: self._ctx.step)

    @property
    def joined_step(self) -> int | None:
        """The step from which this monitor stopped aggregating because a rank ran out of
        inputs under Join (None while it aggregates)."""
        return self._dist.joined_step

    @property
    def join_device(self) -> torch.device:
        return self._dist.join_device()

    @property
    def join_process_group(self) -> Any:
        return torch.distributed.group.WORLD

    # ----------------------------------------------------------------------------- flush
    def flush(self) -> Snapshot | None:
        """Read the device-side statistics (one transfer per device), emit events and sinks.

        Called from inside a flush (a callback or an action), it does nothing and returns the
        running flush's snapshot: that flush covers every step closed so far, and a second one
        would only write an empty record of the same step (or recurse, flushing on its events).
        Called from a step-level callback (skip_step's rules decide inside the step close), it
        runs once that step is closed, and returns the previous snapshot now.

        Under torch.distributed with aggregation on, a flush is collective (its all-reduces):
        call it on every rank at the same point of the loop, like a checkpoint's barrier.
        Called on one rank only (before rank 0 saves a checkpoint), its collectives meet the
        other ranks' DDP all-reduce: gloo aborts the job, NCCL hangs. ``snapshot()`` reads the
        last flush's values on one rank, with no collective.
        """
        if not self._attached:
            raise NumwatchError("Monitor.flush() before attach(): call monitor.attach() first")
        if not self.config.enabled:
            return None
        if self._closing_step:  # a step-level callback: flush once this step is closed
            self._flush_deferred = True
            return self._snapshot
        if self._flushing:
            if not self._told_nested_flush:
                self._told_nested_flush = True
                log.info(
                    "numwatch: flush() called from a callback or an action during a flush does "
                    "nothing: the running flush already covers every closed step"
                )
            return self._snapshot
        self._depth += 1
        self._flushing = True
        try:
            return self._flush()
        finally:
            self._flushing = False
            self._leave()

    def _leave(self) -> None:
        """End of a step close or a flush: the detach a callback asked for inside it runs now."""
        self._depth -= 1
        if self._detach_deferred and not self._depth:
            within, self._detach_deferred, self._detach_within = self._detach_within, False, False
            flush, self._detach_flush = self._detach_flush, True
            self.detach(within_step=within, flush=flush)

    def _flush(self) -> Snapshot | None:
        self._flush_after_loss = False  # any flush covers the closed steps (detach's too)
        self._forwards_since_flush = False
        start = time.perf_counter()
        self._guard.run("flush", self._dist.settle, self._ctx.step)
        self._guard.run("sinks", self._log_own_values)
        with gc_paused():
            snapshot, fired = self._guard.run("flush", self._collect) or (None, [])
            if snapshot is not None:
                self._snapshot = snapshot
                self._history.append(snapshot)
                events = [e for e, _ in fired]
                self._publish(events)
                unsent, self._unsent_events = self._unsent_events, []
                for sink in self._sinks:
                    # distributed.jsonl='per_rank': each rank's log holds its own values
                    view = self._local_snapshot if isinstance(sink, JsonlSink) else snapshot
                    self._guard.run("sinks", sink.emit, view, unsent)
        self._warn_no_loss()  # after the records: another rank's loss may feed this rank's rules
        # The flush's own cost is charged to the next window: to its overhead and to its wall
        # time (its clock starts here), so the overhead stays a share of step_seconds.
        self._window_steps = 0
        self._window_start = start
        self._guard.overhead_seconds = time.perf_counter() - start
        if snapshot is not None:
            self._run_actions(fired)  # after the sinks: a halt leaves the log complete
        return snapshot

    def _log_own_values(self) -> None:
        """Once a rank ran out of inputs under Join, each rank reports and acts on its own values:
        a rank without a log of its own (not rank 0, with ``distributed.jsonl='rank0'``) starts
        one, named as 'per_rank' names it, and prints to the console, or its events and skipped
        updates would reach no one."""
        if self._dist.joined_step is None:
            return
        cfg = self.config.sinks
        if cfg.jsonl.enabled and not any(isinstance(s, JsonlSink) for s in self._sinks):
            stem, suffix = os.path.splitext(cfg.jsonl.path)
            path = cfg.jsonl.path if "{rank}" in cfg.jsonl.path else f"{stem}.rank{{rank}}{suffix}"
            self._jsonl_path = path.format(run_name=self.run_name, rank=self.rank)
            self._sinks.append(self._jsonl_sink())
            log.warning(
                "numwatch: rank %d logs its own values to %s from step %d on (uneven inputs)",
                self.rank,
                self._jsonl_path,
                self._dist.joined_step,
            )
        if cfg.console.enabled and not any(isinstance(s, ConsoleSink) for s in self._sinks):
            self._sinks.append(ConsoleSink(every=cfg.console.every))

    def _emit_late_events(self) -> None:
        """The events no flush carried (what the last flush's actions did) to the sinks that
        keep a record (``emit_events``): otherwise the log would end before them."""
        unsent, self._unsent_events = self._unsent_events, []
        if not unsent:
            return
        for sink in self._sinks:
            emit_events = getattr(sink, "emit_events", None)
            if emit_events is not None:
                self._guard.run("sinks", emit_events, unsent)

    def _warn_unflushed_errors(self) -> None:
        """Failures after the last flush's records were built (a callback of its events, a
        sink writing it) reach no monitor_errors_total: say so at detach, or a callback that
        failed at the last flush would only be counted where nobody reads it."""
        late = self._guard.errors - self._errors_flushed
        if late:
            log.warning(
                "numwatch: %d failure(s) after the last flush reach no flush record "
                "(Monitor.errors counts them): %s",
                late.total(),
                "; ".join(
                    f"{c} {n}x, latest {self._guard.last_error.get(c, '')}"
                    for c, n in sorted(late.items())
                ),
            )
            self._errors_flushed = Counter(self._guard.errors)

    def _warn_no_loss(self) -> None:
        """Rules of the user's on the loss read what ``step(loss)`` records: in a loop where the
        optimizer hook closes the steps and no loss is passed, they never fire. Said once, from
        a flush after two steps on: a loss passed after optimizer.step() comes after the first
        step's flush."""
        if self._loss_rules and self._ctx.step >= 2:
            log.warning(
                "numwatch: rules %s read the loss, but no loss has reached numwatch (steps "
                "closed by the optimizer hook, or by step() without one), so they cannot fire; "
                "pass it every step: monitor.step(loss), before or after optimizer.step()",
                ", ".join(self._loss_rules),
            )
            self._loss_rules = []

    def _collect(self) -> tuple[Snapshot, list[tuple[Event, Rule | None]]]:
        ctx = self._ctx
        device_tensors: dict[str, torch.Tensor] = {}
        for probe in self._probes:
            # One probe failing here drops its tensors, not the flush: under torch.distributed
            # the other ranks are about to enter the aggregation's collectives with this one.
            device_tensors.update(self._guard.run(probe.component, probe.device_tensors) or {})
        self._settle_losses()
        device_tensors.update(ctx.tracker.device_tensors())
        if isinstance(self._loss, torch.Tensor):
            device_tensors["loss"] = self._loss
        device_tensors.update(self._loss_window.device_tensors())
        scale = self._scaler_scale()
        if scale is not None:  # for _scaler_overflows, optimizer probe or not
            device_tensors["scaler/scale"] = scale
        if self._dist.active:  # global values over all ranks (numwatch/distributed.py)
            optimizer = next((p for p in self._probes if isinstance(p, OptimizerProbe)), None)
            device_tensors = self._dist.aggregate(
                device_tensors, self._loss, self._gradients, optimizer
            )
        host, local_host = self._dist.split(read_to_host(device_tensors))  # SYNC: once per flush

        step = ctx.step - 1
        records: list[MetricRecord] = []
        for probe in self._probes:
            records += self._guard.run(probe.component, probe.records, host) or []
        loss = host.get("loss", self._loss)  # another rank's, on a rank that passes none
        if loss is not None:
            self._loss_rules = []  # fed, also on such a rank
            records.append(MetricRecord("loss", {}, float(loss)))
        records += self._loss_window_records(host)
        own = self._own_records(local_host) if self._dist.keeps_local else None
        self._loss_window.reset()
        self._loss = None  # a window whose steps record none has no loss, not an older one
        shared_from = len(records)  # records from here on are the same on every rank
        origin, seen = self._dist.first_nonfinite(ctx.tracker, host, local_host)
        nonfinite = [] if origin is None else [self._nonfinite_event(origin, step, seen)]
        nonfinite, overflows = self._scaler_overflows(nonfinite, host)
        if self._window_steps:
            elapsed = time.perf_counter() - self._window_start
            records.append(MetricRecord("step_seconds", {}, elapsed / self._window_steps))
            records.append(
                MetricRecord(
                    "monitor_overhead_seconds",
                    {},
                    self._guard.overhead_seconds / self._window_steps,
                )
            )
        if self._attention is not None:
            routing = self._closed_routing
            for layer, kernel in (self.attention_routing() if routing is None else routing).items():
                # the share of the step's calls that ran the kernel: the rest fell back to SDPA
                share = self._attention.kernel_share(layer)
                ran = 0.0 if kernel is None else 1.0 if share is None else share
                stabilized = ran if kernel is not None and kernel.stabilized else 0.0
                records.append(MetricRecord("attn_kernel_stabilized", {"layer": layer}, stabilized))
                if kernel is not None:  # which kernel, reproduction modes included
                    mode = {"layer": layer, "mode": kernel.mode_label}
                    records.append(MetricRecord("attn_kernel_mode", mode, ran))
            for reason, n in sorted(ctx.kernel_fallbacks.items()):
                records.append(
                    MetricRecord("attn_kernel_fallbacks_total", {"reason": reason}, float(n))
                )
            for reason, n in sorted(ctx.attn_unmeasured.items()):
                records.append(
                    MetricRecord("attn_unmeasured_calls_total", {"reason": reason}, float(n))
                )
        self._errors_flushed = Counter(self._guard.errors)
        for component in sorted({*_COMPONENTS, *self._guard.errors}):
            records.append(
                MetricRecord(
                    "monitor_errors_total",
                    {"component": component},
                    float(self._guard.errors[component]),
                )
            )
        for probe in self._probes:
            self._guard.run(probe.component, probe.reset)
        ctx.tracker.reset()
        ruled: list[tuple[Event, Rule | None]] = []
        if step != self._rules_step:  # a flush with no new step adds no observation
            self._rules_step = step
            ruled = (
                self._guard.run(
                    "rules",
                    self._engine.evaluate,
                    step,
                    records,
                    nonfinite,
                    lambda so_far: self._mitigation_records(
                        [*self._firings(so_far), *unadopted(nonfinite, so_far), *overflows]
                    ),
                )
                or []
            )
        mine = [*unadopted(nonfinite, [e for e, _ in ruled]), *overflows]
        fired = [*ruled, *((e, None) for e in mine)]
        for event in [*self._firings(e for e, _ in ruled), *mine]:
            self._event_counts[(event.kind, event.rule)] += 1
        records += self._mitigation_records()
        snapshot = Snapshot(step, records, time=time.time(), rank=self.rank)
        self._local_snapshot = snapshot
        if own is not None:
            own += records[shared_from:]
            self._local_snapshot = Snapshot(step, own, time=snapshot.time, rank=self.rank)
        return snapshot, fired

    def _scaler_scale(self) -> torch.Tensor | None:
        """The enabled GradScaler's scale on the device (None: no scaler, or none yet)."""
        scaler = self._scaler
        if scaler is None or not scaler.is_enabled():
            return None
        scale = getattr(scaler, "_scale", None)
        return scale.reshape(()) if isinstance(scale, torch.Tensor) else None

    def _gradient_scale(self) -> torch.Tensor | None:
        """The loss scale the gradients carry now: the GradScaler's until
        ``scaler.unscale_(optimizer)``, which ``scaler.step()`` runs before ``optimizer.step()``.
        So the step ``monitor.step()`` closes before ``scaler.step()`` has scaled gradients
        (x65536 at the default scale), and the one the optimizer hook closes has true ones."""
        scale = self._scaler_scale()
        states = getattr(self._scaler, "_per_optimizer_states", None)
        if scale is None or states is None:
            return None
        state = states.get(id(self._optimizer))  # none yet this iteration: READY, scaled
        return scale if state is None or state["stage"] is OptState.READY else None

    def _scaler_overflows(
        self, nonfinite: list[Event], host: Mapping[str, torch.Tensor]
    ) -> tuple[list[Event], list[Event]]:
        """(nonfinite, overflows). Under an enabled GradScaler, a NaN/Inf that first appears in
        the gradients (forward and loss finite) is the scaler's overflow: it skips that update
        and lowers its scale, as designed (at the start of fp16 training, and whenever it tries
        a larger scale). It is reported as an ``anomaly`` of severity ``info`` (rule
        ``scaler_overflow``), which no nonfinite rule, ``stop_on`` or halt acts on; while the
        scale is at 1 or below, where the scale no longer explains it, it stays ``nonfinite``."""
        if not nonfinite or self._scaler is None or not self._scaler.is_enabled():
            return nonfinite, []
        (event,) = nonfinite
        scale = float(host["scaler/scale"]) if "scaler/scale" in host else None
        if event.evidence.get("phase") != "backward" or (scale is not None and scale <= 1.0):
            return nonfinite, []
        at = "" if scale is None else f" (loss scale {scale:g})"
        overflow = dataclasses.replace(
            event,
            kind="anomaly",
            severity="info",
            rule="scaler_overflow",
            message=f"GradScaler overflow{at}: {event.message}; the scaler skips that update "
            "and lowers its scale",
            evidence={**event.evidence, "scaler_overflow": True, "loss_scale": scale},
        )
        return [], [overflow]

    def _own_records(self, local_host: Mapping[str, torch.Tensor]) -> list[MetricRecord]:
        """The probes' metrics and the loss from this rank's values only (per-rank JSONL)."""
        out: list[MetricRecord] = []
        for probe in self._probes:
            out += self._guard.run(probe.component, probe.records, local_host) or []
        if "loss" in local_host:
            out.append(MetricRecord("loss", {}, float(local_host["loss"])))
        return out + self._loss_window_records(local_host)

    def _loss_window_records(self, host: Mapping[str, torch.Tensor]) -> list[MetricRecord]:
        """The largest and the mean loss of the window's steps (rules on the loss would see only
        the last step's otherwise)."""
        values = self._loss_window.values(host)
        if values is None:
            return []
        return [MetricRecord("loss_max", {}, values[0]), MetricRecord("loss_mean", {}, values[1])]

    def _firings(self, events: Iterable[Event]) -> list[Event]:
        """The rule engine's ``events`` that count in events_total: the NaN/Inf origins a
        step-level rule takes over at the flush (without running its actions again) are the
        firing it counted at its step, and one NaN would count twice."""
        step_rules = {rule.name for rule in self._engine.step_rules}
        return [e for e in events if e.rule not in step_rules]

    def _mitigation_records(self, pending: Sequence[Event] = ()) -> list[MetricRecord]:
        """events_total (with ``pending``: events of this flush not counted yet), skipped
        steps and the LR factor."""
        counts = self._event_counts.copy()
        counts.update((e.kind, e.rule) for e in pending)
        out = [
            MetricRecord("events_total", {"kind": kind, "rule": rule}, float(n))
            for (kind, rule), n in sorted(counts.items())
        ]
        control = self._control
        out.append(
            MetricRecord(
                "mitigation_skipped_steps_total",
                {},
                float(self._skipped_earlier + (control.skipped_steps if control else 0)),
            )
        )
        out.append(MetricRecord("mitigation_lr_factor", {}, control.lr_factor if control else 1.0))
        return out

    def _nonfinite_event(
        self, origin: NonfiniteOrigin, flush_step: int, seen: Mapping[str, Any] | None = None
    ) -> Event:
        """``seen``: distributed, {'rank': who saw it first, 'ranks': everyone who saw one}."""
        where = f"{origin.label} {origin.name!r}" if origin.label else "loss"
        what = {"forward": "forward output of", "backward": "gradient of", "loss": ""}[origin.phase]
        subject = f"{what} {where}".strip() if origin.label else where
        labels = {origin.label: origin.name} if origin.label else {}
        metric = {"forward": "activation_nonfinite", "backward": "grad_nonfinite", "loss": "loss"}
        return Event(
            kind="nonfinite",
            severity="critical",
            step=origin.step,
            rule="nonfinite",
            metric=metric[origin.phase],
            labels=labels,
            message=f"NaN/Inf first seen in the {subject} ({origin.phase}) at step {origin.step}"
            + (f" on rank {seen['rank']}" if seen else ""),
            evidence={"phase": origin.phase, "flush_step": flush_step, **(seen or {})},
        )

    def _publish(self, events: Sequence[Event]) -> None:
        """Events go to .events and callbacks now, and to the sinks at the next emit."""
        self.events.extend(events)
        self._unsent_events.extend(events)
        for event in events:
            for callback in self._bus.callbacks_for(event):
                self._guard.run("callbacks", callback, event)

    # ----------------------------------------------------------------------------- rules
    def _build_rules(self) -> tuple[RuleEngine, dict[str, list[Action]]]:
        cfg = self.config.rules
        rules = configured_rules(cfg)
        actions = {
            name: [build_action(a, f"rules[{name}].actions") for a in rule.actions]
            for name, rule in rules.items()
            if cfg.act
        }
        step_level = [
            n for n, acts in actions.items() if any(isinstance(a, SkipStep) for a in acts)
        ]
        if not cfg.act:  # a dry run decides nothing per step: skip_step rules judge at flush
            rules = {name: at_flush(rule) for name, rule in rules.items()}
        engine = RuleEngine(rules.values(), step_level, partial(self._guard.run, "rules"))
        return engine, actions

    def _run_actions(self, fired: Sequence[tuple[Event, Rule | None]]) -> None:
        """Run the fired rules' actions in order. A halt is raised once all of them ran: a
        snapshot of a later rule in the halting flush is the forensics the halt is for."""
        done = []
        halt: NumwatchHalt | None = None
        try:
            for event, rule in fired:
                for action in self._actions.get(rule.name, []) if rule is not None else []:
                    failures = self._guard.errors["actions"]
                    try:
                        what = self._guard.run("actions", action.maybe_run, self, event)
                    except NumwatchHalt as exc:
                        halt = halt or exc  # the first halt's report
                        done.append(
                            Event(
                                kind="action",
                                step=event.step,
                                message=f"halt: training stopped (rule {event.rule})",
                                severity="critical",
                                rule=event.rule,
                                metric=event.metric,
                                labels=event.labels,
                                value=event.value,
                                evidence={"action": action.type},
                            )
                        )
                        continue
                    # A failed action is on record as one: the error count of the last flush
                    # before detach reaches no flush record (a snapshot to a full disk at the
                    # NaN that ended a run read as no error in the log and the report).
                    failed = self._guard.errors["actions"] > failures
                    if what or failed:
                        error = self._guard.last_error.get("actions", "") if failed else ""
                        done.append(
                            Event(
                                kind="action",
                                step=event.step,
                                message=f"{action.type}: "
                                + (f"failed ({error})" if failed else what)
                                + f" (rule {event.rule})",
                                severity="warning" if failed else "info",
                                rule=event.rule,
                                metric=event.metric,
                                labels=event.labels,
                                value=event.value,
                                evidence={"action": action.type, "failed": True, "error": error}
                                if failed
                                else {"action": action.type},
                            )
                        )
        finally:  # an action raising in strict mode: those that ran are on record too
            for event in done:
                self._event_counts[(event.kind, event.rule)] += 1
            self._publish(done)
            if halt is not None:  # and in the log now: a loop that dies of the halt never detaches
                self._guard.run("sinks", self._emit_late_events)
        if halt is not None:
            raise halt

    @property
    def optimizer_control(self) -> OptimizerControl | None:
        """The optimizer wrapper actions use (None unless an action needs one)."""
        return self._control

    @property
    def history(self) -> Sequence[Snapshot]:
        """The most recent flushes (``config.history`` of them), oldest first."""
        return list(self._history)

    def parameter(self, label: str) -> torch.Tensor | None:
        """The parameter a ``param`` label names: the model's, or one the optimizer trains
        outside the model under the label the optimizer probe gave it (None if neither)."""
        try:
            return self.model.get_parameter(label)
        except AttributeError:
            pass
        for probe in self._probes:
            if isinstance(probe, OptimizerProbe):
                for name, p in probe.params:
                    if name == label:
                        return p
        return None

    def nonfinite_origin(self) -> dict[str, str] | None:
        """The labels of where the step under way first saw a NaN/Inf on this rank ({}: the
        loss), for the actions of a step-level event, whose global gradient norm and loss name
        none (a snapshot's offending tensors); None outside a step close or without one. The
        flush names it too, but after skip_step has cleared the gradients.

        SYNC: one read of the tracker, only when an action asks (a snapshot at a NaN step).
        """
        if not self._closing_step:
            return None
        self._settle_losses()
        if self._gradients is not None:
            self._gradients.settle()
        tracker = self._ctx.tracker
        origin = tracker.first_origin(read_to_host(tracker.device_tensors()))
        if origin is None or origin.step != self._ctx.step:
            return None
        return {origin.label: origin.name} if origin.label else {}

    # ----------------------------------------------------------------------------- queries
    def snapshot(self) -> Snapshot | None:
        """The latest flushed metrics (None before the first flush)."""
        return self._snapshot

    def on(self, kind: str, callback: Callable[[Event], Any]) -> Monitor:
        """Call ``callback(event)`` for every event of ``kind`` ('*' = all kinds)."""
        self._bus.on(kind, callback)
        return self

    @property
    def errors(self) -> dict[str, int]:
        """Failures counted per component (the monitor_errors_total metric)."""
        return dict(self._guard.errors)
