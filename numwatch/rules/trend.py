"""Trend: least-squares slope of ln(value) per flush over a window (e.g. spectral-norm growth)."""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

from pydantic import Field

from numwatch.rules.base import Finding, Rule

__all__ = ["TrendRule", "log_slope"]


def log_slope(values: list[float]) -> tuple[float, float]:
    """(slope of ln v per index, R^2) of positive ``values``."""
    ys = [math.log(v) for v in values]
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    sxx = sum((i - mx) ** 2 for i in range(n))
    sxy = sum((i - mx) * (y - my) for i, y in enumerate(ys))
    syy = sum((y - my) ** 2 for y in ys)
    slope = sxy / sxx
    r2 = sxy * sxy / (sxx * syy) if syy > 0 else 1.0
    return slope, r2


class TrendRule(Rule):
    type: Literal["trend"] = "trend"
    kind: Literal["precursor", "spike", "anomaly", "nonfinite"] = "precursor"
    window: int = Field(20, ge=3, description="Flushes in the fitted window (this one included).")
    min_slope: float = Field(
        description="Fire when ln(value) grows faster than this per flush (0.01 = 1%/flush)."
    )
    min_r2: float = Field(0.8, ge=0, le=1, description="Fit quality needed (steady growth).")
    min_value: float = Field(
        0.0, ge=0, description="Only fire once the value itself is at least this large."
    )

    def check(self, history: deque[float], value: float) -> Finding | None:
        values = [*list(history)[-(self.window - 1) :], value]
        if (
            value < self.min_value
            or len(values) < self.window
            or any(not (v > 0 and math.isfinite(v)) for v in values)
        ):
            return None
        slope, r2 = log_slope(values)
        if slope <= self.min_slope or r2 < self.min_r2:
            return None
        return Finding(
            value,
            self.min_slope,
            f"{self.metric} grows {math.expm1(slope):.1%} per flush over {self.window} flushes",
            {"slope": slope, "r2": r2},
        )
