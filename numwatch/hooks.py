"""Hooks numwatch puts on the user's modules and optimizers.

A module's hooks travel with it when it is copied or pickled (an EMA copy made with
``copy.deepcopy(model)``, ``torch.save(model)``). A bound method of a probe would take the whole
monitor along, its open log file and HTTP server included, and fail. A ``UserHook`` calls
through like the function it wraps; its copies are ``InertHook``s, which do nothing, so a copy
of a monitored model behaves as an unmonitored one. (Unpickling one needs numwatch importable.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["InertHook", "UserHook", "after_first_closure_call"]


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


def after_first_closure_call(
    args: tuple, kwargs: dict, then: Callable[[Any], None]
) -> tuple[tuple, dict] | None:
    """For an optimizer step pre-hook's ``(args, kwargs)`` (args: optimizer, closure?): where the
    step has a closure, the arguments with it replaced by one that calls ``then(loss)`` after its
    first call (that call makes the step's gradients; later ones, as LBFGS makes, probe other
    points); None where it has none."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        return None
    done = False

    def closure_then() -> Any:
        nonlocal done
        loss = closure()
        if not done:
            done = True
            then(loss)
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then}
    return (args[0], closure_then, *args[2:]), kwargs
