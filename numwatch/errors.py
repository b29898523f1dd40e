"""Exceptions numwatch raises on purpose (everything else is a bug or a probe failure)."""

from __future__ import annotations

__all__ = ["NumwatchConfigError", "NumwatchError"]


class NumwatchError(Exception):
    """Base class of numwatch's own errors."""


class NumwatchConfigError(NumwatchError, ValueError):
    """A configuration value is invalid; the message names the field, the value and the fix."""
