"""A pause of Python's cyclic garbage collector around the flush.

A flush builds thousands of short-lived records (tracked tuples: a GPT-2 flush makes ~7,000).
Allocated with the collector on, they trigger young collections while still alive, get
promoted, and push the process toward full collections, which scan every object of a training
process (~140 ms for a GPT-2 run on a CPU, where training alone never triggers one). Paused,
they die by reference counting before any collection sees them. The previous state is restored,
so a user who disabled the collector keeps it disabled.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]


@contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
