"""Lightning: ``NumwatchCallback`` monitors a ``Trainer.fit`` with no change to the module.

>>> trainer = lightning.Trainer(callbacks=[NumwatchCallback(flush_every=10)])

- The monitor attaches at ``on_train_start`` to the LightningModule and detaches at
  ``on_train_end`` (or on an exception).
- Steps close in ``on_before_optimizer_step``: after backward (and after gradient accumulation),
  **before** Lightning clips gradients, so gradient statistics and the first non-finite
  gradient are the true, unclipped ones. One monitor step per optimizer step.
- The loss of the step is the sum of the losses Lightning passes to ``on_before_backward``
  (each divided by ``accumulate_grad_batches``, as Lightning does before backward): the mean of
  the step's micro-batch losses.
- ``training_step`` usually calls submodules rather than the LightningModule's ``forward``;
  the callback opens the forward that attention interception follows from
  ``on_train_batch_start`` to ``on_before_backward`` (``Monitor.begin_forward``).
- The trainer's optimizer is attached to the monitor after the first step closes (optimizer
  probe, skip_step, LR back-off). Lightning runs forward and backward *inside*
  ``optimizer.step(closure)``, where the optimizer's pre-hooks and the monitor's step wrapper
  would act before the step's gradients exist; the callback makes ``step`` run the closure
  first, so a skip decided on a step's gradients skips that very step.
- Stopping: ``request_stop(reason)`` (for rules, callbacks, or you), the event kinds in
  ``stop_on``, and the ``halt`` action (``NumwatchHalt``) set ``trainer.should_stop``; Lightning
  finishes the current step and ends the fit cleanly. The halt report stays in ``.halt``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from numwatch.config import MonitorConfig
from numwatch.errors import NumwatchHalt
from numwatch.integrations._driver import MonitorDriver
from numwatch.monitor import Monitor

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError as exc:
        raise ImportError(
            "numwatch.integrations.lightning needs Lightning: pip install 'numwatch[lightning]'"
        ) from exc

__all__ = ["NumwatchCallback"]


class NumwatchCallback(Callback):
    """A numwatch Monitor for the duration of ``Trainer.fit`` (see the module docstring)."""

    def __init__(
        self,
        config: MonitorConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        stop_on: Iterable[str] = (),
        **overrides: Any,
    ) -> None:
        super().__init__()
        self._driver = MonitorDriver(config, overrides, stop_on)
        self._trainer: Any = None
        self._optimizer_attached = False
        self._forward_open = False
        self._wrapped: tuple[torch.optim.Optimizer, Any, Any] | None = None

    @property
    def monitor(self) -> Monitor | None:
        """The monitor of the fit in progress or the last one (None before the first)."""
        return self._driver.monitor

    @property
    def halt(self) -> NumwatchHalt | None:
        """The ``NumwatchHalt`` that stopped the last fit, with its ``report``."""
        return self._driver.halt

    @property
    def stop_reason(self) -> str | None:
        return self._driver.stop_reason

    def request_stop(self, reason: str) -> None:
        """Stop the fit after the current step (``trainer.should_stop``)."""
        self._driver.request_stop(reason)
        if self._trainer is not None:
            self._trainer.should_stop = True

    # ------------------------------------------------------------------ Lightning hooks
    def on_train_start(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        self._trainer = trainer
        self._optimizer_attached = False
        self._driver.start(pl_module, None)

    def on_train_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        # training_step usually calls submodules, not the LightningModule's forward: open the
        # forward the attention probe follows by hand, up to the loss.
        monitor = self._driver.active
        if monitor is not None and not self._forward_open:
            monitor.begin_forward()
            self._forward_open = True

    def _end_forward(self) -> None:
        monitor = self._driver.active
        if monitor is not None and self._forward_open:
            monitor.end_forward()
        self._forward_open = False

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self._end_forward()
        loss = loss.detach()
        self._driver.loss = loss if self._driver.loss is None else self._driver.loss + loss

    def on_before_optimizer_step(
        self, trainer: Any, pl_module: Any, optimizer: torch.optim.Optimizer
    ) -> None:
        self._driver.close_step()
        monitor = self._driver.active
        if monitor is not None and not self._optimizer_attached:
            self._optimizer_attached = True
            if isinstance(optimizer, torch.optim.Optimizer):
                monitor.attach(optimizer)
                self._run_closure_first(optimizer)
        if self._driver.stop_reason is not None:
            trainer.should_stop = True

    def _run_closure_first(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step(closure)`` run the closure (forward, backward, this callback's
        step close, and so the monitor's decisions) before the step the monitor hooked or
        wrapped: a skip_step decided on this step's gradients then skips this step, and the
        closure always runs, as Lightning requires. Optimizers that call their closure several
        times (LBFGS) are left alone."""
        if isinstance(optimizer, torch.optim.LBFGS):
            return
        inner = optimizer.step

        def step(closure: Any = None, **kwargs: Any) -> Any:
            if closure is None:
                return inner(**kwargs)
            with torch.enable_grad():
                loss = closure()
            inner(**kwargs)
            return loss

        optimizer.step = step  # type: ignore[method-assign]
        self._wrapped = (optimizer, step, inner)

    def _unwrap(self) -> None:
        if self._wrapped is not None:
            optimizer, step, inner = self._wrapped
            if optimizer.__dict__.get("step") is step:
                if getattr(inner, "__self__", None) is optimizer:
                    del optimizer.step  # the class's method again
                else:
                    optimizer.step = inner  # the monitor's wrapper: its uninstall removes it
            self._wrapped = None

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._end_forward()  # a training_step that returned None never reached backward
        if self._driver.stop_reason is not None:
            trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_forward()
        self._unwrap()
        self._driver.finish()
        self._trainer = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)
