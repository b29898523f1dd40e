"""Growth against a rolling baseline: value / baseline above a factor (EMA or window median)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Literal

from pydantic import Field, model_validator

from numwatch.rules.base import Finding, Rule, require_history

__all__ = ["GrowthRule"]


class GrowthRule(Rule):
    type: Literal["growth"] = "growth"
    factor: float = Field(gt=1.0, description="Fire when value > factor x baseline.")
    baseline: Literal["median", "ema"] = Field("median", description="Baseline statistic.")
    alpha: float = Field(0.1, gt=0.0, le=1.0, description="EMA weight of the newest value.")
    min_history: int = Field(5, ge=1, description="Flushes needed before the rule can fire.")

    @model_validator(mode="after")
    def _fits_window(self) -> GrowthRule:
        require_history(self, "min_history", self.min_history, self.window + 1)
        return self

    def check(self, history: deque[float], value: float) -> Finding | None:
        past = [v for v in history if math.isfinite(v)]
        if len(past) < self.min_history or not math.isfinite(value):
            return None
        if self.baseline == "median":
            base = statistics.median(past[-self.window :])
        else:
            base = past[0]
            for v in past[1:]:
                base += self.alpha * (v - base)
        if base <= 0 or value <= self.factor * base:
            return None
        return Finding(
            value,
            self.factor * base,
            f"{self.metric} = {value:.4g} is {value / base:.1f}x its {self.baseline} {base:.4g}",
            {"baseline": base, "ratio": value / base},
        )
