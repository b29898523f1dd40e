"""What the Lightning and Hugging Face callbacks share: one Monitor per fit, steps closed by the
framework hook where gradients are final, the loss of the step, and stop requests.

A framework callback only decides *when*: it calls ``start`` at train start, ``close_step`` at
its pre-optimizer hook, ``should_stop`` where the framework reads its stop flag, and ``finish``
at the end. A ``NumwatchHalt`` raised by the monitor's ``halt`` action becomes a stop request
(the framework finishes the current step and stops cleanly) instead of an exception in the
middle of the framework's loop; the monitor detaches at once (its log is complete).
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from numwatch.config import MonitorConfig
from numwatch.distributed import get_world_size
from numwatch.errors import NumwatchConfigError, NumwatchHalt
from numwatch.events import EVENT_KINDS, Event
from numwatch.monitor import Monitor

_log = logging.getLogger("numwatch")


class MonitorDriver:
    def __init__(
        self,
        config: MonitorConfig | Mapping[str, Any] | str | os.PathLike[str] | None,
        overrides: dict[str, Any],
        stop_on: Iterable[str],
    ) -> None:
        self.config = config
        self.overrides = overrides
        if isinstance(stop_on, str):  # 'nonfinite' would stop on 'n', 'o', ...
            stop_on = (stop_on,)
        self.stop_on = tuple(stop_on)
        unknown = [k for k in self.stop_on if k != "*" and k not in EVENT_KINDS]
        if unknown:  # said now, not at the start of training (with the model hooked)
            raise NumwatchConfigError(
                f"stop_on: unknown event kind(s) {unknown}; known: {', '.join(EVENT_KINDS)} or '*'"
            )
        self.monitor: Monitor | None = None
        self.halt: NumwatchHalt | None = None
        self.stop_reason: str | None = None
        self.loss: torch.Tensor | float | None = None
        self._exit_hook = False
        self.distributed = False  # the fit runs on several ranks (decided at start)

    def start(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        first_step: int = 0,
        scaler: Any = None,
    ) -> Monitor:
        """A fresh monitor, attached. ``first_step``: the framework's global step (a fit resumed
        from a checkpoint goes on from it), where the configuration leaves ``first_step`` at 0.
        ``scaler``: the framework's GradScaler (fp16), whose overflow steps are then not
        ``nonfinite`` events (``Monitor.attach``)."""
        self.finish()  # a second fit on the same callback starts a fresh monitor
        self.halt, self.stop_reason, self.loss = None, None, None
        config = MonitorConfig.load(self.config, **self.overrides)
        if config.first_step == 0:
            config = config.model_copy(update={"first_step": int(first_step)})
        self.monitor = Monitor(model, config).attach(optimizer, scaler=scaler)
        self.distributed = get_world_size() > 1
        if not self._exit_hook:
            atexit.register(_finish_at_exit, weakref.ref(self))
            self._exit_hook = True
        for kind in self.stop_on:
            self.monitor.on(kind, self._stop_on_event)
        return self.monitor

    def _stop_on_event(self, event: Event) -> None:
        self.request_stop(f"{event.kind} event ({event.rule or 'no rule'}): {event.message}")

    @property
    def active(self) -> Monitor | None:
        """The monitor while it is attached (None before start and after finish)."""
        return self.monitor if self.monitor is not None and self.monitor.attached else None

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            _log.warning("numwatch: stopping training: %s", reason)
            self.stop_reason = reason

    def close_step(self) -> None:
        if self.monitor is None or not self.monitor.attached:
            return
        loss, self.loss = self.loss, None
        try:
            self.monitor.step(loss)
        except NumwatchHalt as halt:
            self.halt = halt
            self.request_stop(f"halt by rule {halt.report.get('rule', '?')!r}")
            # numwatch is done: the framework ends its step without it (a skip decided for
            # that step still withholds its update)
            self.finish(within_step=True)

    def finish(self, within_step: bool = False, flush: bool = True) -> None:
        """Detach; the monitor stays readable (``.events``, ``.snapshot()``) after training.
        ``flush=False``: without the final flush (``Monitor.detach``)."""
        self.loss = None  # a fit interrupted after backward: that loss belongs to no step
        if self.monitor is not None and self.monitor.attached:
            try:
                self.monitor.detach(within_step=within_step, flush=flush)
            except NumwatchHalt as halt:  # the final flush halted: record it, finish detaching
                self.halt = self.halt or halt
                self.monitor.detach(within_step=within_step)


def _finish_at_exit(ref: weakref.ref[MonitorDriver]) -> None:
    """A framework that raised out of its loop (Hugging Face's Trainer has no exception hook)
    left the monitor attached and the steps since its last flush unwritten: detach at exit,
    which writes them. Not in a distributed run, where the flush would wait for ranks that
    may be gone."""
    driver = ref()
    if driver is None or driver.active is None or driver.distributed:
        return  # (a destroyed process group at exit still was one: its flush is not global)
    try:
        driver.finish()
    except Exception:  # at exit: say it, never raise
        _log.exception("numwatch: detaching at exit failed")
