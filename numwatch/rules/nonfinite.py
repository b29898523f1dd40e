"""Non-finite: fires at once when a NaN/Inf appears (the origin the monitor tracked)."""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

from numwatch.rules.base import Finding, Rule

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
