"""The monitor must never break training: every probe/sink call goes through a Guard.

A Guard counts failures per component (exported as ``monitor_errors_total{component}``), logs
the first traceback of each component once, and keeps training going, unless strict mode asks it
to re-raise. It also accumulates the host time spent inside monitor code
(``monitor_overhead_seconds``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from numwatch.errors import NumwatchHalt

__all__ = ["Guard"]

log = logging.getLogger("numwatch")
T = TypeVar("T")


class Guard:
    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.errors: Counter[str] = Counter()
        self.last_error: dict[str, str] = {}  # component -> its latest failure, one line
        self.overhead_seconds = 0.0
        self._reported: set[str] = set()
        self._depth = 0  # nested runs are timed once, by the outermost

    def run(self, component: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """Call ``fn``; on an exception count it under ``component`` and return None."""
        start = time.perf_counter()
        self._depth += 1
        try:
            return fn(*args, **kwargs)
        except NumwatchHalt:
            raise
        except Exception as exc:
            if self.strict:
                raise
            self.errors[component] += 1
            self.last_error[component] = f"{type(exc).__name__}: {exc}"[:300]
            if component not in self._reported:
                self._reported.add(component)
                log.exception(
                    "numwatch: %s failed; training continues, further failures of this "
                    "component are only counted (metric monitor_errors_total{component=%r}); "
                    "pass strict=True to raise instead",
                    component,
                    component,
                )
            return None
        finally:
            self._depth -= 1
            if not self._depth:
                self.overhead_seconds += time.perf_counter() - start
