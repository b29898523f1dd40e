"""Which parameters and modules a probe watches: name globs and module class names."""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Iterable

from torch import nn

__all__ = ["matches", "matches_any", "select_modules", "select_parameters"]


def matches(name: str, include: Iterable[str], exclude: Iterable[str] = ()) -> bool:
    """True if ``name`` matches an include glob and no exclude glob."""
    return any(fnmatch.fnmatchcase(name, p) for p in include) and not any(
        fnmatch.fnmatchcase(name, p) for p in exclude
    )


def matches_any(names: Iterable[str], pattern: str) -> bool:
    """True if some name matches the glob ``pattern``."""
    return any(fnmatch.fnmatchcase(name, pattern) for name in names)


def select_parameters(
    model: nn.Module, include: Iterable[str], exclude: Iterable[str] = ()
) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters whose names match, in model.named_parameters() order."""
    include, exclude = list(include), list(exclude)
    return [
        (name, p)
        for name, p in model.named_parameters()
        if p.requires_grad and matches(name, include, exclude)
    ]


def select_modules(
    model: nn.Module,
    include: Iterable[str],
    exclude: Iterable[str] = (),
    types: Iterable[str] = (),
) -> list[tuple[str, nn.Module]]:
    """Submodules (never the root) whose names and class names match."""
    include, exclude, types = list(include), list(exclude), list(types)
    short = {t for t in types if "." not in t}
    classes = tuple(_resolve(t) for t in types if "." in t)
    out = []
    for name, module in model.named_modules():
        if not name or not matches(name, include, exclude):
            continue
        if types and type(module).__name__ not in short and not isinstance(module, classes):
            continue
        out.append((name, module))
    return out


def _resolve(dotted: str) -> type:
    module_name, _, attr = dotted.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError):
        raise ValueError(
            f"module type {dotted!r} cannot be imported; give a class name such as 'Linear' "
            "or an importable path such as 'torch.nn.Linear'"
        ) from None
    if not isinstance(cls, type):
        raise ValueError(f"module type {dotted!r} is not a class")
    return cls
