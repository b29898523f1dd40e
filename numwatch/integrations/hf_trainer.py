"""Hugging Face ``Trainer``: ``NumwatchTrainerCallback`` monitors ``trainer.train()``.

>>> trainer = Trainer(model, args, train_dataset=data, callbacks=[NumwatchTrainerCallback()])

- The monitor attaches at ``on_train_begin`` to the trainer's model and optimizer (the torch
  optimizer inside Accelerate's wrapper: optimizer probe, skip_step, LR back-off), with the
  wrapper's GradScaler (fp16: its overflow steps are ``scaler_overflow`` anomalies, not
  ``nonfinite`` events), and detaches at ``on_train_end``.
- Steps close in ``on_pre_optimizer_step``, the Trainer's only hook that sees final gradients:
  it runs **after** the Trainer clips them (``max_grad_norm``), so gradient statistics are of
  the clipped gradients the optimizer applies (``on_step_end`` sees none: they are zeroed).
  Clipping multiplies every gradient by NaN once one is NaN, so a non-finite event names the
  first parameter in backward order, not necessarily the origin; for the true unclipped
  statistics set ``max_grad_norm=0`` and clip yourself after ``monitor.step()``.
- The loss of the step is the training loss the Trainer logs, from the ``loss`` of the model's
  outputs over the step's micro-batches: their sum when the Trainer passed the model
  ``num_items_in_batch`` (each is then a share of the step's token-weighted mean), else their
  mean. Models without a ``loss`` in their outputs report none.
- Stopping: ``request_stop(reason)``, the event kinds in ``stop_on`` and the ``halt`` action
  (``NumwatchHalt``, kept in ``.halt``) set ``control.should_training_stop``; the Trainer
  finishes the current step and ends training cleanly.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from numwatch.config import MonitorConfig
from numwatch.errors import NumwatchHalt
from numwatch.hooks import UserHook
from numwatch.integrations._driver import MonitorDriver
from numwatch.monitor import Monitor

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError(
        "numwatch.integrations.hf_trainer needs transformers and accelerate: "
        "pip install 'numwatch[hf]'"
    ) from exc

__all__ = ["NumwatchTrainerCallback"]


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
        self._loss_hook: Any = None
        self._losses: list[torch.Tensor] = []  # the step's micro-batch losses
        self._shares = False  # whether they are shares of the step's loss (num_items_in_batch)

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
        if self._loss_hook is not None:
            # An earlier train() that raised (Ctrl-C, OOM) never reached on_train_end: end it
            # here, or its loss hook would count every loss twice from now on.
            self.on_train_end(args, state, control)
        self._losses = []
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)  # inside Accelerate's wrapper
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            torch_optimizer = None
        # fp16: the wrapper holds Accelerate's GradScaler, whose overflow steps it skips by design
        scaler = getattr(optimizer, "scaler", None) if torch_optimizer is not None else None
        self._driver.start(model, torch_optimizer, state.global_step, scaler)  # resumed: goes on
        self._loss_hook = model.register_forward_hook(
            UserHook(self._capture_loss), with_kwargs=True
        )

    def _capture_loss(self, module: Any, args: Any, kwargs: dict, output: Any) -> None:
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and module.training:
            self._losses.append(loss.detach())
            self._shares = kwargs.get("num_items_in_batch") is not None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        losses, self._losses = self._losses, []
        if losses:  # stacked on the device: no sync
            total = torch.stack(losses).float().sum()
            self._driver.loss = total if self._shares else total / len(losses)
        self._driver.close_step()
        if self._driver.stop_reason is not None:
            control.should_training_stop = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._driver.stop_reason is not None:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None
        self._driver.finish()
