"""Exceptions numwatch raises on purpose (everything else is a bug or a probe failure)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["LogInUse", "NumwatchConfigError", "NumwatchError", "NumwatchHalt"]


class NumwatchError(Exception):
    """Base class of numwatch's own errors."""


class NumwatchConfigError(NumwatchError, ValueError):
    """A configuration value is invalid; the message names the field, the value and the fix."""


class LogInUse(NumwatchConfigError):
    """The JSONL log path is another attached monitor's, in this process or another one."""


class NumwatchHalt(NumwatchError):
    """Raised by the ``halt`` action; ``report`` says which rule fired, where, and the history.

    It is the one exception the monitor's guard never swallows: halting is the point.
    """

    def __init__(self, report: dict[str, Any]) -> None:
        self.report = report
        super().__init__(json.dumps(report, indent=2, default=str))
