"""Persistence of a signed quantity: the same sign, above a magnitude, for N flushes in a row.

Rounding noise flips sign from flush to flush; the biased rounding of arXiv 2510.04212 does not.
A sign run of length N under a fair coin has probability 2^(1-N), so N = 5 gives a 6% chance per
series for pure noise, and the magnitude floor removes the small, noisy ratios.
"""

from __future__ import annotations

import math
from collections import deque
from itertools import islice
from typing import Literal

from pydantic import Field, model_validator

from numwatch.rules.base import Finding, Rule, require_history

__all__ = ["PersistenceRule"]


class PersistenceRule(Rule):
    type: Literal["persistence"] = "persistence"
    flushes: int = Field(5, ge=2, description="Consecutive flushes of one sign needed.")
    min_abs: float = Field(0.5, ge=0, description="Each of them at least this large in magnitude.")

    @model_validator(mode="after")
    def _fits_window(self) -> PersistenceRule:
        require_history(self, "flushes", self.flushes - 1, self.window + 1)
        return self

    def check(self, history: deque[float], value: float) -> Finding | None:
        n = self.flushes
        if not abs(value) >= self.min_abs or len(history) < n - 1:  # NaN fails the first test
            return None
        recent = [*islice(history, len(history) - (n - 1), None), value]
        if any(not math.isfinite(v) for v in recent):
            return None
        if not all(abs(v) >= self.min_abs and v != 0 for v in recent):  # 0 has no sign
            return None
        signs = {math.copysign(1.0, v) for v in recent}
        if len(signs) != 1:
            return None
        sign = "negative" if signs == {-1.0} else "positive"
        return Finding(
            value,
            self.min_abs,
            f"{self.metric} stayed {sign} (|v| >= {self.min_abs:g}) for {self.flushes} flushes",
            {"recent": recent, "p_noise": 2.0 ** (1 - self.flushes)},
        )
