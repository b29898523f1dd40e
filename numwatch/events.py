"""Typed event records and their delivery to user callbacks.

Probes and rules create events; the monitor appends them to ``Monitor.events``, hands them to the
callbacks registered with ``Monitor.on(kind, fn)`` and to every sink at the flush that found them.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Literal

__all__ = ["EVENT_KINDS", "Event", "EventBus"]

EVENT_KINDS = ("nonfinite", "precursor", "spike", "anomaly", "action")
Severity = Literal["info", "warning", "critical"]


@dataclasses.dataclass(frozen=True)
class Event:
    """Something the monitor found (or did) at a step; plain data, JSON-serialisable."""

    kind: str
    step: int
    message: str
    severity: Severity = "warning"
    rule: str = ""
    metric: str = ""
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    value: float | None = None
    threshold: float | None = None
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    time: float = dataclasses.field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class EventBus:
    """Callbacks by event kind ('*' receives every kind)."""

    def __init__(self) -> None:
        self._callbacks: dict[str, list[Callable[[Event], Any]]] = defaultdict(list)

    def on(self, kind: str, callback: Callable[[Event], Any]) -> None:
        if kind != "*" and kind not in EVENT_KINDS:
            raise ValueError(
                f"unknown event kind {kind!r}; known kinds: {', '.join(EVENT_KINDS)}, '*'"
            )
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        self._callbacks[kind].append(callback)

    def callbacks_for(self, event: Event) -> list[Callable[[Event], Any]]:
        return [*self._callbacks.get(event.kind, ()), *self._callbacks.get("*", ())]
