"""The Monitor: attaches probes to a model, closes steps, flushes statistics to rules and sinks.

Life of a step: forward hooks and post-accumulate-grad hooks fire during the user's forward and
backward; ``step()`` (called by the user after backward, or by the optimizer's step pre-hook)
reads the accumulated gradients into device-side tables; every ``flush_every`` steps ``flush()``
copies all tables to the host in one transfer per device, turns them into a ``Snapshot``, finds
events, and hands both to the sinks. No host sync happens between flushes.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from numwatch.buffers import NonfiniteOrigin, NonfiniteTracker, read_to_host
from numwatch.config import MonitorConfig
from numwatch.errors import NumwatchError
from numwatch.events import Event, EventBus
from numwatch.guard import Guard
from numwatch.probes.base import ProbeContext
from numwatch.probes.tensors import ActivationProbe, GradientProbe
from numwatch.sinks.base import Sink
from numwatch.sinks.console import ConsoleSink
from numwatch.sinks.jsonl import JsonlSink
from numwatch.snapshot import MetricRecord, Snapshot

__all__ = ["Monitor"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_COMPONENTS = ("gradients", "activations", "step", "flush", "callbacks", "sinks")


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


class Monitor:
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
        self.model = model
        self.config = MonitorConfig.load(config, **overrides)
        self.events: list[Event] = []
        self.rank = _rank()
        self.run_name = self.config.run_name or datetime.datetime.now(
            datetime.timezone.utc
        ).strftime("run-%Y%m%dT%H%M%SZ")
        self._bus = EventBus()
        self._guard = Guard(self.config.strict)
        self._ctx = ProbeContext(
            guard=self._guard,
            tracker=NonfiniteTracker(),
            backend=self.config.kernel_backend,
            underflow_dtype=_DTYPES.get(self.config.underflow_dtype or ""),
        )
        self._probes: list[Any] = []
        self._sinks: list[Sink] = []
        self._jsonl_path: str | None = None
        self._optimizer_handles: list[Any] = []
        self._attached = False
        self._snapshot: Snapshot | None = None
        self._last_close = ""  # who closed the last step: 'user' | 'optimizer' | 'late-loss'
        self._loss: torch.Tensor | float | None = None
        self._window_steps = 0
        self._window_start = 0.0

    # ----------------------------------------------------------------------------- lifecycle
    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def steps(self) -> int:
        """Number of steps closed so far (the index of the step in progress)."""
        return self._ctx.step

    def attach(self, optimizer: torch.optim.Optimizer | None = None) -> Monitor:
        """Add the hooks (idempotent). With ``optimizer``, its step pre-hook closes each step."""
        if not self._attached:
            self._attached = True
            self._window_start = time.perf_counter()
            if self.config.enabled:
                self._build_probes()
                self._build_sinks()
        if optimizer is not None and self.config.enabled and not self._optimizer_handles:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    "attach(optimizer=...) needs a torch.optim.Optimizer, "
                    f"got {type(optimizer).__name__}"
                )
            self._optimizer_handles = [
                optimizer.register_step_pre_hook(self._on_optimizer_step),
            ]
        return self

    def detach(self) -> None:
        """Flush what is pending, remove every hook, close the sinks. The model is as before."""
        if not self._attached:
            return
        if self._window_steps and self.config.enabled:
            self.flush()
        for probe in self._probes:
            probe.detach()
        for handle in self._optimizer_handles:
            handle.remove()
        for sink in self._sinks:
            self._guard.run("sinks", sink.close)
        self._probes, self._sinks, self._optimizer_handles = [], [], []
        self._attached = False

    def __enter__(self) -> Monitor:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _build_probes(self) -> None:
        cfg = self.config
        if cfg.gradients.enabled:
            self._probes.append(GradientProbe(self.model, cfg.gradients, self._ctx))
        if cfg.activations.enabled:
            self._probes.append(ActivationProbe(self.model, cfg.activations, self._ctx))
        for probe in self._probes:
            probe.attach()

    def _build_sinks(self) -> None:
        cfg = self.config.sinks
        if cfg.jsonl.enabled:
            self._jsonl_path = cfg.jsonl.path.format(run_name=self.run_name, rank=self.rank)
            self._sinks.append(JsonlSink(self._jsonl_path, self.run_name))
        if cfg.console.enabled and self.rank == 0:
            self._sinks.append(ConsoleSink(every=cfg.console.every))

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
        if self._last_close == "optimizer" and not self._ctx.activity:
            self._guard.run("step", self._record_loss, loss)
            self._last_close = "late-loss"
            return
        self._close_step(loss)
        self._last_close = "user"

    def _on_optimizer_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self._last_close == "user" and not self._ctx.activity:
            return  # the user closed this step already
        self._close_step(None)
        self._last_close = "optimizer"

    def _close_step(self, loss: torch.Tensor | float | None) -> None:
        self._guard.run("step", self._close_step_body, loss)
        self._ctx.activity = False
        self._ctx.step += 1
        self._window_steps += 1
        if self._window_steps >= self.config.flush_every:
            self.flush()

    def _close_step_body(self, loss: torch.Tensor | float | None) -> None:
        for probe in self._probes:
            if hasattr(probe, "on_step"):
                self._guard.run(probe.component, probe.on_step)
        self._record_loss(loss)

    @torch.no_grad()
    def _record_loss(self, loss: torch.Tensor | float | None) -> None:
        if loss is None:
            return
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(
                    f"step(loss=...) needs a scalar loss, got shape {tuple(loss.shape)}"
                )
            value = loss.detach().reshape(()).to(torch.float64)
            order = self._ctx.tracker.next_order(
                NonfiniteOrigin("loss", "", "loss", self._ctx.step)
            )
            self._ctx.tracker.observe(order, (~torch.isfinite(value)).to(torch.float64))
            self._loss = value
        else:
            self._loss = float(loss)

    # ----------------------------------------------------------------------------- flush
    def flush(self) -> Snapshot | None:
        """Read the device-side statistics (one transfer per device), emit events and sinks."""
        if not self._attached:
            raise NumwatchError("Monitor.flush() before attach(): call monitor.attach() first")
        if not self.config.enabled:
            return None
        start = time.perf_counter()
        snapshot, events = self._guard.run("flush", self._collect) or (None, [])
        if snapshot is not None:
            self._snapshot = snapshot
            self._deliver(snapshot, events)
        # The flush's own cost is charged to the next window's overhead.
        self._window_steps = 0
        self._window_start = time.perf_counter()
        self._guard.overhead_seconds = self._window_start - start
        return snapshot

    def _collect(self) -> tuple[Snapshot, list[Event]]:
        ctx = self._ctx
        device_tensors: dict[str, torch.Tensor] = {}
        for probe in self._probes:
            device_tensors.update(probe.device_tensors())
        device_tensors.update(ctx.tracker.device_tensors())
        if isinstance(self._loss, torch.Tensor):
            device_tensors["loss"] = self._loss
        host = read_to_host(device_tensors)  # SYNC: once per flush

        step = ctx.step - 1
        records: list[MetricRecord] = []
        for probe in self._probes:
            records += self._guard.run(probe.component, probe.records, host) or []
        if self._loss is not None:
            loss = float(host["loss"]) if "loss" in host else float(self._loss)
            records.append(MetricRecord("loss", {}, loss))
        events = []
        origin = ctx.tracker.first_origin(host)
        if origin is not None:
            events.append(self._nonfinite_event(origin, step))
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
        for component in sorted({*_COMPONENTS, *self._guard.errors}):
            records.append(
                MetricRecord(
                    "monitor_errors_total",
                    {"component": component},
                    float(self._guard.errors[component]),
                )
            )
        for probe in self._probes:
            probe.reset()
        ctx.tracker.reset()
        return Snapshot(step, records, time=time.time(), rank=self.rank), events

    def _nonfinite_event(self, origin: NonfiniteOrigin, flush_step: int) -> Event:
        where = f"{origin.label} {origin.name!r}" if origin.label else "the loss"
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
            message=f"NaN/Inf first seen in the {subject} ({origin.phase}) at step {origin.step}",
            evidence={"phase": origin.phase, "flush_step": flush_step},
        )

    def _deliver(self, snapshot: Snapshot, events: Sequence[Event]) -> None:
        self.events.extend(events)
        for event in events:
            for callback in self._bus.callbacks_for(event):
                self._guard.run("callbacks", callback, event)
        for sink in self._sinks:
            self._guard.run("sinks", sink.emit, snapshot, events)

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
