"""What every sink implements: it sees a flush's snapshot and events, never the monitor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from numwatch.events import Event
from numwatch.snapshot import Snapshot

__all__ = ["Sink"]


@runtime_checkable
class Sink(Protocol):
    """A sink may also define ``emit_events(events)``: at detach, it receives the events no
    flush carried (what the last flush's actions did); sinks without it never see them."""

    name: str

    def emit(self, snapshot: Snapshot, events: Sequence[Event]) -> None: ...

    def close(self) -> None: ...
