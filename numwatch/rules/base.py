"""What every rule shares: the metric it reads, a label filter, and per-series history.

A rule sees one value per series (a metric name plus one label set) per flush and says whether
that series fires now. Rules never touch the model: what happens next is the actions' business.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr

from numwatch.counts import NoBoolCounts
from numwatch.selection import matches

__all__ = ["Finding", "Rule", "SeriesKey", "require_history"]

SeriesKey = tuple[tuple[str, str], ...]


@dataclass
class Finding:
    """A rule's verdict on one series at one flush."""

    value: float
    threshold: float | None
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)


class Rule(NoBoolCounts):
    """Base of every rule; subclasses add parameters and ``check``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: str = Field(description="Unique rule name (label `rule` of events_total).")
    metric: str = Field(description="Metric the rule reads, e.g. 'attn_max_logit'.")
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Label filter: label name -> glob the value must match (e.g. layer: '*.attn').",
    )
    kind: Literal["precursor", "spike", "anomaly", "nonfinite"] = Field(
        "precursor", description="Event kind the rule emits."
    )
    severity: Literal["info", "warning", "critical"] = Field("warning")
    actions: list[str | dict[str, Any]] = Field(
        default_factory=list,
        description="Actions run when the rule fires: names ('swap_attention_kernel') or dicts "
        "with a 'type' and the action's settings.",
    )
    cooldown: int = Field(
        0, ge=0, description="Flushes after firing during which the same series stays quiet."
    )
    window: int = Field(50, ge=1, description="Flushes of history kept per series.")
    enabled: bool = True

    _history: dict[SeriesKey, deque[float]] = PrivateAttr(default_factory=dict)
    _quiet_until: dict[SeriesKey, int] = PrivateAttr(default_factory=dict)
    _flushes: int = PrivateAttr(0)

    @property
    def skips_steps(self) -> bool:
        """Whether one of its actions is skip_step, which needs a decision every step."""
        return any(
            (a if isinstance(a, str) else a.get("type")) == "skip_step" for a in self.actions
        )

    def wants(self, name: str, labels: Mapping[str, str]) -> bool:
        if name != self.metric:
            return False
        return all(matches(str(labels.get(k, "")), [glob]) for k, glob in self.labels.items())

    def observe(self, key: SeriesKey, value: float) -> Finding | None:
        """Add this flush's value of one series; a Finding if the rule fires for it."""
        fired = self.observe_all([(key, value)])
        return fired[0][1] if fired else None

    def observe_all(self, series: Iterable[tuple[SeriesKey, float]]) -> list[tuple[int, Finding]]:
        """``observe`` over a flush's series of this rule, as (position, Finding) of those that
        fire: the rule's state is looked up once (pydantic private attributes are slow to
        reach), not once per series."""
        histories, quiet, flushes = self._history, self._quiet_until, self._flushes
        check, maxlen, cooldown = self.check, self.window + 1, self.cooldown
        fired = []
        for i, (key, value) in enumerate(series):
            history = histories.get(key)
            if history is None:
                history = histories[key] = deque(maxlen=maxlen)
            finding = check(history, value)
            history.append(value)
            if finding is not None and flushes >= quiet.get(key, 0):
                quiet[key] = flushes + 1 + cooldown
                fired.append((i, finding))
        return fired

    def end_flush(self) -> None:
        self._flushes += 1

    def check(self, history: deque[float], value: float) -> Finding | None:
        """``history`` holds earlier values of the series (oldest first), not ``value``."""
        raise NotImplementedError


def require_history(rule: Rule, field: str, needed: int, kept: int) -> None:
    """Reject settings under which ``rule`` could never fire (silent for ever): ``field`` needs
    ``needed`` earlier values of a series, and the rule keeps at most ``kept``."""
    if needed > kept:
        raise ValueError(
            f"{field}={getattr(rule, field)} needs {needed} earlier values of a series, but "
            f"window={rule.window} keeps {kept}: the rule could never fire; raise window or lower "
            f"{field}"
        )
