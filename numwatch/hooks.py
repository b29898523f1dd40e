"""Hooks numwatch puts on the user's modules and optimizers.

A module's hooks travel with it when it is copied or pickled (an EMA copy made with
``copy.deepcopy(model)``, ``torch.save(model)``). A bound method of a probe would take the whole
monitor along, its open log file and HTTP server included, and fail. A ``UserHook`` calls
through like the function it wraps; its copies are ``InertHook``s, which do nothing, so a copy
of a monitored model behaves as an unmonitored one. (Unpickling one needs numwatch importable.)
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["InertHook", "UserHook"]


class InertHook:
    """What a copied or unpickled module holds in place of a numwatch hook."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __repr__(self) -> str:
        return "InertHook()"


class UserHook(functools.partial):
    """``UserHook(fn)`` calls ``fn`` (a partial: called at C speed); copies are inert."""

    def __deepcopy__(self, memo: dict) -> InertHook:
        return InertHook()

    def __reduce__(self) -> tuple:
        return (InertHook, ())
