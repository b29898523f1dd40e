"""Absolute threshold, optionally held for several consecutive flushes."""

from __future__ import annotations

import math
import operator
from collections import deque
from itertools import islice
from typing import Literal

from pydantic import Field, model_validator

from numwatch.rules.base import Finding, Rule, require_history

__all__ = ["ThresholdRule"]

_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


class ThresholdRule(Rule):
    type: Literal["threshold"] = "threshold"
    threshold: float = Field(description="Value the metric is compared with.")
    op: Literal[">", ">=", "<", "<=", "abs>"] = Field(">", description="Comparison.")
    for_flushes: int = Field(1, ge=1, description="Consecutive flushes the condition must hold.")

    def _holds(self, v: float) -> bool:
        if math.isnan(v):
            return False
        if self.op == "abs>":
            return abs(v) > self.threshold
        return _OPS[self.op](v, self.threshold)

    @model_validator(mode="after")
    def _fits_window(self) -> ThresholdRule:
        require_history(self, "for_flushes", self.for_flushes - 1, self.window + 1)
        return self

    def check(self, history: deque[float], value: float) -> Finding | None:
        n = self.for_flushes
        if not self._holds(value) or len(history) < n - 1:  # the usual case, decided at once
            return None
        recent = [*islice(history, len(history) - (n - 1), None), value]
        if not all(self._holds(v) for v in recent):
            return None
        held = f" for {self.for_flushes} flushes" if self.for_flushes > 1 else ""
        return Finding(
            value,
            self.threshold,
            f"{self.metric} = {value:.4g} {self.op} {self.threshold:g}{held}",
            {"recent": recent},
        )
