"""Hugging Face ``Trainer``: ``NumwatchTrainerCallback`` monitors ``trainer.train()``.

>>> trainer = Trainer(model, args, train_dataset=data, callbacks=[NumwatchTrainerCallback()])

- The monitor attaches at ``on_train_begin`` to the trainer's model and optimizer (the torch
  optimizer inside Accelerate's wrapper: optimizer probe, skip_step, LR back-off), with the
  wrapper's GradScaler (fp16: its overflow steps are ``scaler_overflow`` anomalies, not
  ``nonfinite`` events), and detaches at ``on_train_end``. A step skip_step withholds is a
  skipped optimizer step for the Trainer (``optimizer_step_was_skipped``), as an overflow is:
  the LR schedule does not advance over it.
- Steps close in ``on_pre_optimizer_step``, the Trainer's only hook that sees final gradients:
  it runs **after** the Trainer clips them (``max_grad_norm``), so gradient statistics are of
  the clipped gradients the optimizer applies (``on_step_end`` sees none: they are zeroed).
  Clipping multiplies every gradient by NaN once one is NaN, so a non-finite event names the
  first parameter in backward order, not necessarily the origin; for the true unclipped
  statistics set ``max_grad_norm=0`` and clip yourself after ``monitor.step()``.
- The loss of the step is the training loss the Trainer logs: the sum of what its
  ``training_step`` returns for the step's micro-batches (the value the Trainer accumulates
  for its log: scaled for gradient accumulation and, under ``average_tokens_across_devices``,
  by the number of ranks, whose mean the monitor takes), wherever the loss is computed (the
  model, ``label_smoothing_factor``, ``compute_loss_func``, an overridden ``compute_loss``, a
  ``(loss, logits)`` tuple). A NaN/Inf loss is recorded as is (``logging_nan_inf_filter``
  replaces it only in the Trainer's log).
- Stopping: ``request_stop(reason)``, the event kinds in ``stop_on`` and the ``halt`` action
  (``NumwatchHalt``, kept in ``.halt``) set ``control.should_training_stop``; the Trainer
  finishes the current step and ends training cleanly.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from numwatch.config import MonitorConfig
from numwatch.errors import NumwatchHalt
from numwatch.integrations._driver import MonitorDriver
from numwatch.monitor import Monitor

try:
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers import Trainer, TrainerCallback
except ImportError as exc:
    raise ImportError(
        "numwatch.integrations.hf_trainer needs transformers and accelerate: "
        "pip install 'numwatch[hf]'"
    ) from exc

__all__ = ["NumwatchTrainerCallback"]

_log = logging.getLogger("numwatch")


class NumwatchTrainerCallback(TrainerCallback):
    """A numwatch Monitor for the duration of ``Trainer.train`` (see the module docstring)."""

    def __init__(
        self,
        config: MonitorConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        stop_on: Iterable[str] = (),
        **overrides: Any,
    ) -> None:
        self._driver = MonitorDriver(config, overrides, stop_on)
        self._loss_of: _LossOf | None = None  # the wrapped training_step of the Trainer
        self._losses: list[torch.Tensor] = []  # what training_step returned in this step

    @property
    def monitor(self) -> Monitor | None:
        """The monitor of the training in progress or the last one (None before the first)."""
        return self._driver.monitor

    @property
    def halt(self) -> NumwatchHalt | None:
        """The ``NumwatchHalt`` that stopped the last training, with its ``report``."""
        return self._driver.halt

    @property
    def stop_reason(self) -> str | None:
        return self._driver.stop_reason

    def request_stop(self, reason: str) -> None:
        """Stop training after the current step (``control.should_training_stop``)."""
        self._driver.request_stop(reason)

    # ------------------------------------------------------------------ Trainer hooks
    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kw
    ) -> None:
        if self._loss_of is not None:
            # An earlier train() that raised (Ctrl-C, OOM) never reached on_train_end: end it
            # here, or its wrapper would count every loss twice from now on.
            self.on_train_end(args, state, control)
        self._losses = []
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)  # inside Accelerate's wrapper
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            torch_optimizer = None
        # fp16: the wrapper holds Accelerate's GradScaler, whose overflow steps it skips by design
        scaler = getattr(optimizer, "scaler", None) if torch_optimizer is not None else None
        if torch_optimizer is not None and isinstance(optimizer, AcceleratedOptimizer):
            torch_optimizer = optimizer  # attach() unwraps it, knowing whose steps run the inner's
        self._driver.start(model, torch_optimizer, state.global_step, scaler)  # resumed: goes on
        trainer = _calling_trainer()
        if trainer is not None:
            self._loss_of = _LossOf(trainer, self._losses)
        else:
            _log.warning(
                "numwatch: NumwatchTrainerCallback runs outside a transformers Trainer's train(): "
                "no loss is recorded"
            )

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._losses:  # stacked on the device: no sync
            self._driver.loss = torch.stack(self._losses).float().sum()
            self._losses.clear()
        self._driver.close_step()
        if self._driver.stop_reason is not None:
            control.should_training_stop = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._driver.stop_reason is not None:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._loss_of is not None:
            self._loss_of.undo()
            self._loss_of = None
        self._driver.finish()


class _LossOf:
    """Put in place of ``trainer.training_step``: calls it and keeps the loss it returns (the
    value the Trainer adds to the loss it logs) in ``losses``; ``undo`` puts it back."""

    def __init__(self, trainer: Trainer, losses: list[torch.Tensor]) -> None:
        self.trainer = trainer
        self.losses = losses
        self.own = trainer.__dict__.get("training_step")  # set on the instance, or None
        self.inner = trainer.training_step
        trainer.training_step = self

    def undo(self) -> None:
        if self.trainer.__dict__.get("training_step") is not self:
            return  # replaced since by someone else: theirs now
        if self.own is None:
            del self.trainer.training_step  # the class's method again
        else:
            self.trainer.training_step = self.own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        loss = self.inner(*args, **kwargs)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.losses.append(loss.detach().reshape(()))
        return loss


def _calling_trainer() -> Trainer | None:
    """The Trainer whose ``train()`` runs this callback hook, found up the call stack: the
    Trainer hands its callbacks the model and optimizer, never itself."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None
