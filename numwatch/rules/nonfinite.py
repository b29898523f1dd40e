"""Non-finite: fires at once when a NaN/Inf appears (the origin the monitor tracked)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Literal

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

    def check(self, history: deque[float], value: float) -> Finding | None:
        if math.isfinite(value):
            return None
        if self.metric == "nonfinite":  # the step's gradient norm plus its loss
            return Finding(value, None, f"NaN/Inf in the step's gradients or loss ({value})")
        return Finding(value, None, f"non-finite {self.metric} ({value})")

    def adopt(self, events: Sequence[Event]) -> list[Event]:
        """The monitor's ``nonfinite`` events of one flush this rule fires on: those whose
        labels (``param`` or ``module``) its ``labels`` select and, unless its ``metric`` is
        ``nonfinite`` (any origin), whose metric is its own (``activation_nonfinite``,
        ``grad_nonfinite`` or ``loss``: where the NaN/Inf began); none during its cooldown."""
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
