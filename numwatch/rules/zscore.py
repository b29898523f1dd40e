"""Z-score spike over a rolling window (OLMo's n-sigma) or an EMA of mean and variance (ZClip)."""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

from pydantic import Field, model_validator

from numwatch.rules.base import Finding, Rule, require_history

__all__ = ["ZScoreRule", "zscore"]


def zscore(
    past: list[float], value: float, *, ema: float | None = None
) -> tuple[float, float, float]:
    """(z, mean, std) of ``value`` against ``past`` (rolling window, or EMA with weight ``ema``)."""
    if ema is None:
        # Scaled sums: statistics.pstdev squared the raw deviations, which overflowed (and
        # raised) for a value past ~1e154 in the window (a float64 loss).
        n = len(past)
        mean = math.fsum(v / n for v in past)
        dev = [v - mean for v in past]
        scale = max(map(abs, dev)) or 1.0
        std = scale * math.sqrt(math.fsum((d / scale) ** 2 for d in dev) / n)
    else:
        mean, var = past[0], 0.0
        for v in past[1:]:
            d = v - mean
            mean += ema * d
            var = (1 - ema) * (var + ema * d * d)
        std = math.sqrt(var)
    std = max(std, 1e-12 * max(1.0, abs(mean)))
    return (value - mean) / std, mean, std


class ZScoreRule(Rule):
    type: Literal["zscore"] = "zscore"
    kind: Literal["precursor", "spike", "anomaly", "nonfinite"] = "spike"
    sigma: float = Field(
        6.0, gt=0, description="Std-devs above the rolling mean counted as a spike."
    )
    min_history: int = Field(20, ge=2, description="Flushes needed before the rule can fire.")
    ema: float | None = Field(
        None, gt=0, lt=1, description="EMA weight (ZClip style); None = plain rolling window."
    )
    direction: Literal["up", "both"] = Field("up", description="Spikes up only, or both ways.")

    @model_validator(mode="after")
    def _fits_window(self) -> ZScoreRule:
        require_history(self, "min_history", self.min_history, self.window)
        return self

    def check(self, history: deque[float], value: float) -> Finding | None:
        past = [v for v in list(history)[-self.window :] if math.isfinite(v)]
        if len(past) < self.min_history or not math.isfinite(value):
            return None
        z, mean, std = zscore(past, value, ema=self.ema)
        if not (z > self.sigma or (self.direction == "both" and z < -self.sigma)):
            return None
        return Finding(
            value,
            mean + self.sigma * std if z > 0 else mean - self.sigma * std,  # the bound crossed
            f"{self.metric} = {value:.4g} is {z:.1f} sigma from its mean {mean:.4g}",
            {"z": z, "mean": mean, "std": std},
        )
