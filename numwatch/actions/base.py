"""What every action shares: a type name, a debounce, and the context it acts through.

Actions run at step boundaries (a flush, or the step-level check before an optimizer update),
in the same order on every rank. They never compute statistics; they read the event that
triggered them and act on the model, the optimizer or the monitor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from pydantic import ConfigDict, Field, PrivateAttr
from torch import nn

from numwatch.counts import NoBoolCounts
from numwatch.events import Event
from numwatch.snapshot import Snapshot

if TYPE_CHECKING:
    from numwatch.actions.optimizer_control import OptimizerControl

__all__ = ["Action", "ActionContext"]


class ActionContext(Protocol):
    """The monitor as actions see it."""

    model: nn.Module

    @property
    def steps(self) -> int: ...

    @property
    def optimizer_control(self) -> OptimizerControl | None: ...

    @property
    def history(self) -> Sequence[Snapshot]: ...

    def swap_attention(self, layers: Any = None, **kwargs: Any) -> None: ...

    def restore_attention(self, layers: Any = None) -> None: ...

    def attention_kernel(self, layer: str) -> Any: ...

    def attention_routing(self) -> dict[str, Any]: ...

    def attention_routable(self, layer: str) -> bool: ...

    def parameter(self, label: str) -> torch.Tensor | None: ...

    def nonfinite_origin(self) -> dict[str, str] | None: ...


class Action(NoBoolCounts):
    """Base of every action; subclasses set ``type`` and implement ``run``."""

    model_config = ConfigDict(extra="forbid")

    type: str
    min_interval_steps: int = Field(
        50,
        ge=0,
        description="Debounce: the same action on the same series runs at most once per this "
        "many steps (no swap storms).",
    )
    _last_run: dict[tuple[tuple[str, str], ...], int] = PrivateAttr(default_factory=dict)

    def maybe_run(self, ctx: ActionContext, event: Event) -> str | None:
        """Run unless debounced; returns what was done (for the 'action' event) or None."""
        key = self.debounce_key(event)
        last = self._last_run.get(key)
        if last is not None and event.step - last < self.min_interval_steps:
            return None
        done = self.run(ctx, event)
        if done is not None:
            self._last_run[key] = event.step
        return done

    def debounce_key(self, event: Event) -> tuple[tuple[str, str], ...]:
        """What 'the same series' means for this action (default: all the event's labels)."""
        return tuple(sorted(event.labels.items()))

    def run(self, ctx: ActionContext, event: Event) -> str | None:
        raise NotImplementedError
