"""Non-finite: fires at once when a NaN/Inf appears (the origin the monitor tracked)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Literal

from pydantic import PrivateAttr

from numwatch.events import Event
from numwatch.rules.base import Finding, Rule
from numwatch.selection import matches

__all__ = ["NonfiniteRule"]


class NonfiniteRule(Rule):
    """Turns the monitor's NaN/Inf origin into a rule with actions (e.g. skip_step).

    At flush it adopts the ``nonfinite`` event the monitor built (which names the first module or
    parameter); evaluated per step (when an action such as skip_step needs a decision before the
    optimizer update) it reads the step's global gradient norm and loss, which are NaN/Inf as
    soon as any gradient element or the loss is.
    """

    type: Literal["nonfinite"] = "nonfinite"
    metric: str = "nonfinite"
    kind: Literal["precursor", "spike", "anomaly", "nonfinite"] = "nonfinite"
    severity: Literal["info", "warning", "critical"] = "critical"
    # ``at_flush`` of a rule on the loss: it adopts origins only in a window whose loss was NaN/Inf
    _on_window_loss: bool = PrivateAttr(False)

    def at_flush(self) -> NonfiniteRule:
        """This rule, with skip_step, as judged at flush (replay; a dry run): live it decides
        every step from the step's metric and owns every origin of the window it fired in. On
        ``grad_norm`` it adopts every origin (grad_norm is no origin's metric, and a NaN from
        any origin reaches it); on ``loss``, every origin of a window whose loss was NaN/Inf (a
        NaN only in a gradient leaves that step's loss finite: the live rule does not fire)."""
        if self.metric == "nonfinite":
            return self
        judged = self.model_copy(update={"metric": "nonfinite"})
        judged._on_window_loss = self.metric == "loss"
        return judged

    def check(self, history: deque[float], value: float) -> Finding | None:
        if math.isfinite(value):
            return None
        if self.metric == "nonfinite":  # the step's gradient norm plus its loss
            return Finding(value, None, f"NaN/Inf in the step's gradients or loss ({value})")
        return Finding(value, None, f"non-finite {self.metric} ({value})")

    def adopt(self, events: Sequence[Event], window_loss: float | None = None) -> list[Event]:
        """The monitor's ``nonfinite`` events of one flush this rule fires on: those whose
        labels (``param`` or ``module``) its ``labels`` select and, unless its ``metric`` is
        ``nonfinite`` (any origin), whose metric is its own (``activation_nonfinite``,
        ``grad_nonfinite`` or ``loss``: where the NaN/Inf began); none during its cooldown.
        ``window_loss``: the flush's ``loss_mean``, NaN/Inf iff a step's loss was (read by the
        ``at_flush`` form of a rule on the loss)."""
        if self._on_window_loss and (window_loss is None or math.isfinite(window_loss)):
            return []
        picked = self.own(events)
        if not picked or self._flushes < self._quiet_until.get((), 0):
            return []
        self._quiet_until[()] = self._flushes + 1 + self.cooldown
        return picked

    def own(self, events: Sequence[Event], every_origin: bool = False) -> list[Event]:
        """``adopt``'s events, whatever the cooldown, which it leaves as it was. A rule deciding
        every step (``every_origin``) owns every origin of the window it fired in: its metric
        (grad_norm, loss, nonfinite) is the step's, which a NaN reaches from any origin."""
        mine = {"rule": self.name, "kind": self.kind, "severity": self.severity}
        return [
            Event(**{**e.to_dict(), **mine})
            for e in events
            if (every_origin or self.metric == "nonfinite" or e.metric == self.metric)
            and all(matches(str(e.labels.get(k, "")), [glob]) for k, glob in self.labels.items())
        ]
