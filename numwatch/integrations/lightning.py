"""Lightning: ``NumwatchCallback`` monitors a ``Trainer.fit`` with no change to the module.

>>> trainer = lightning.Trainer(callbacks=[NumwatchCallback(flush_every=10)])

- The monitor attaches at ``on_train_start`` to the LightningModule and detaches at
  ``on_train_end`` (or on an exception: in a distributed run, without its final flush, whose
  collectives the other ranks would not join).
- Steps close in ``on_before_optimizer_step``: after backward (and after gradient accumulation),
  **before** Lightning clips gradients, so gradient statistics and the first non-finite
  gradient are the true, unclipped ones. One monitor step per optimizer step.
- The loss of the step is the sum of the losses Lightning passes to ``on_before_backward``
  (each divided by ``accumulate_grad_batches``, as Lightning does before backward, and under
  ``precision="16-mixed"`` by the loss scale it was multiplied by), rescaled where the step had
  fewer micro-batches (the epoch's last, partial window): the mean of the step's micro-batch
  losses. Only those up to the step's close count: an optimizer that calls the closure again
  (LBFGS's line search) reports the loss of its first call, the one at the step's start whose
  gradients the statistics are of (what ``LBFGS.step`` returns; Lightning's ``outputs["loss"]``
  is the last call's).
- ``training_step`` usually calls submodules rather than the LightningModule's ``forward``;
  the callback opens the forward that attention interception follows from
  ``on_train_batch_start`` to ``on_before_backward`` (``Monitor.begin_forward``).
- The trainer's first optimizer is attached to the monitor at ``on_train_start`` (optimizer
  probe, skip_step, LR back-off; so a NaN in the very first step can be skipped), with the
  precision plugin's GradScaler (``precision="16-mixed"``: its overflow steps are
  ``scaler_overflow`` anomalies, not ``nonfinite`` events). Lightning runs forward and
  backward *inside* ``optimizer.step(closure)``, where the optimizer's pre-hooks and the
  monitor's step wrapper would act before the step's gradients exist; the callback makes
  ``step`` run the closure first, so a skip decided on a step's gradients skips that very step,
  then hands the optimizer the closure, its first call answered by that evaluation (an
  optimizer that calls it again, LBFGS or SAM, evaluates it anew: training is unchanged).
- Several optimizers (manual optimization, e.g. a GAN's two): one monitor step per batch,
  closed at the batch's first optimizer step; its loss is the sum of the batch's backward
  losses before it. A skip_step decided for the step withholds every optimizer's update of
  that batch (the others follow the attached one's decision); the optimizer probe and LR
  back-off act on the first optimizer only.
- Stopping: ``request_stop(reason)`` (for rules, callbacks, or you), the event kinds in
  ``stop_on``, and the ``halt`` action (``NumwatchHalt``) set ``trainer.should_stop``; Lightning
  finishes the current step and ends the fit cleanly. The halt report stays in ``.halt``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from numwatch.actions.optimizer_control import clear_gradients
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
        self._step_closed = False  # this batch's monitor step is closed
        self._skips_before = 0  # skip decisions before this batch (the followers compare)
        self._backwards = 0  # backward passes since the last step close (micro-batches)
        self._wrapped: list[tuple[torch.optim.Optimizer, Any, Any]] = []
        self._scaler: Any = None  # the precision plugin's GradScaler, if any

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
        self._backwards = 0
        # precision="16-mixed": the plugin's GradScaler, whose overflow steps it skips by design
        self._scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        optimizers = [o for o in getattr(trainer, "optimizers", []) or []]
        first_step = _batches_stepped(trainer, len(optimizers))
        self._driver.start(pl_module, None, first_step, scaler=self._scaler)
        if optimizers and all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            self._attach_optimizers(optimizers)

    def _attach_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        monitor = self._driver.active
        self._optimizer_attached = True
        if monitor is None:
            return
        monitor.attach(optimizers[0], scaler=self._scaler)
        self._run_closure_first(optimizers[0])
        for optimizer in optimizers[1:]:
            self._follow_skips(optimizer)

    def on_train_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        # training_step usually calls submodules, not the LightningModule's forward: open the
        # forward the attention probe follows by hand, up to the loss.
        monitor = self._driver.active
        self._step_closed = False
        control = monitor.optimizer_control if monitor is not None else None
        self._skips_before = control.skips_decided if control is not None else 0
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
        if self._step_closed:  # a closure called again (LBFGS), or after the batch's first step
            return
        loss = loss.detach()
        scale = getattr(self._scaler, "_scale", None)  # the scale scaler.scale() just applied
        if isinstance(scale, torch.Tensor) and self._scaler.is_enabled():
            loss = loss.float() / scale.to(loss.device)  # 16-mixed passes the scaled loss
        self._driver.loss = loss if self._driver.loss is None else self._driver.loss + loss
        self._backwards += 1

    def on_before_optimizer_step(
        self, trainer: Any, pl_module: Any, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self._step_closed:  # one monitor step per batch, whatever the optimizers
            self._step_closed = True
            backwards, self._backwards = self._backwards, 0
            accumulate, loss = trainer.accumulate_grad_batches, self._driver.loss
            # the epoch's last window may hold fewer batches: Lightning divided each of their
            # losses by accumulate_grad_batches all the same
            if (
                loss is not None
                and pl_module.automatic_optimization
                and 0 < backwards != accumulate
            ):
                self._driver.loss = loss * (accumulate / backwards)
            self._driver.close_step()
        if not self._optimizer_attached:  # optimizers made after on_train_start
            self._optimizer_attached = True
            if isinstance(optimizer, torch.optim.Optimizer):
                self._attach_optimizers([optimizer])
        if self._driver.stop_reason is not None:
            trainer.should_stop = True

    def _run_closure_first(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step(closure)`` run the closure (forward, backward, this callback's
        step close, and so the monitor's decisions) before the step the monitor hooked or
        wrapped: a skip_step decided on this step's gradients then skips this step. The step
        still gets the closure, its first call answered by that evaluation: an optimizer that
        calls it again (LBFGS's line search, SAM's perturbed point) evaluates it anew."""
        inner = optimizer.step

        def step(closure: Any = None, **kwargs: Any) -> Any:
            if closure is None:
                return inner(**kwargs)
            with torch.enable_grad():
                loss = closure()
            return inner(closure=_evaluated_first(closure, loss), **kwargs)

        self._wrap(optimizer, step, inner)

    def _follow_skips(self, optimizer: torch.optim.Optimizer) -> None:
        """Another optimizer of the step: its closure first too, then no update (gradients
        cleared) where the monitor decided to skip this batch's step."""
        inner = optimizer.step

        def step(closure: Any = None, **kwargs: Any) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            monitor = self._driver.monitor
            control = monitor.optimizer_control if monitor is not None else None
            if control is not None and control.skips_decided > self._skips_before:
                clear_gradients(optimizer)
                return loss
            if closure is not None:
                kwargs["closure"] = _evaluated_first(closure, loss)
            return inner(**kwargs)

        self._wrap(optimizer, step, inner)

    def _wrap(self, optimizer: torch.optim.Optimizer, step: Any, inner: Any) -> None:
        # An LR scheduler built before marks the step it wrapped: keep the mark, or it warns
        # that optimizer.step() was overridden after it.
        if getattr(inner, "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True
        optimizer.step = step  # type: ignore[method-assign]
        self._wrapped.append((optimizer, step, inner))

    def _unwrap(self) -> None:
        for optimizer, step, inner in self._wrapped:
            if optimizer.__dict__.get("step") is step:
                if getattr(inner, "__self__", None) is optimizer:
                    del optimizer.step  # the class's method again
                else:
                    optimizer.step = inner  # the monitor's wrapper: its uninstall removes it
        self._wrapped = []

    def on_validation_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        # validation_step calls submodules too: with attention.training_only false its
        # attention is measured inside the forward opened here (no training step: no_grad)
        monitor = self._driver.active
        if monitor is not None and not self._forward_open:
            monitor.begin_forward()
            self._forward_open = True

    def on_validation_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._end_forward()

    on_test_batch_start = on_predict_batch_start = on_validation_batch_start
    on_test_batch_end = on_predict_batch_end = on_validation_batch_end

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._end_forward()  # a training_step that returned None never reached backward
        if self._driver.stop_reason is not None:
            trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._end(flush=True)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # In a distributed run the failing rank often gets here alone (the others wait in a
        # collective of the step): the final flush, a collective too, would hang or abort (gloo)
        # and hide this exception. Detach locally, without it.
        self._end(flush=not self._driver.distributed)

    def _end(self, flush: bool) -> None:
        self._end_forward()
        self._unwrap()
        self._driver.finish(flush=flush)
        self._trainer = None


def _evaluated_first(closure: Callable[[], Any], loss: Any) -> Callable[[], Any]:
    """``closure``, whose first call returns ``loss``, the evaluation already made (its
    gradients are in ``.grad``); later calls evaluate it again."""
    first = [loss]

    def closure_again() -> Any:
        return first.pop() if first else closure()

    return closure_again


def _batches_stepped(trainer: Any, n_optimizers: int) -> int:
    """The monitor steps a fit resumed from a checkpoint goes on from: one per batch that
    stepped. ``global_step`` counts optimizer steps, several per batch with several optimizers
    (manual optimization), where Lightning's own count of batches is read instead."""
    if n_optimizers > 1:
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        batches = getattr(loop, "_batches_that_stepped", None)
        if isinstance(batches, int):
            return batches
    return int(trainer.global_step)
