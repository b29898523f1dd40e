"""Which parameters and modules a probe watches: name globs and module class names."""

from __future__ import annotations

import fnmatch
import importlib
import logging
from collections.abc import Iterable

from torch import nn

log = logging.getLogger("numwatch")

__all__ = [
    "matches",
    "matches_any",
    "matches_within",
    "parameter_state",
    "select_modules",
    "select_parameters",
]


def matches(name: str, include: Iterable[str], exclude: Iterable[str] = ()) -> bool:
    """True if ``name`` matches an include glob and no exclude glob."""
    return any(fnmatch.fnmatchcase(name, p) for p in include) and not any(
        fnmatch.fnmatchcase(name, p) for p in exclude
    )


def matches_any(names: Iterable[str], pattern: str) -> bool:
    """True if some name matches the glob ``pattern``."""
    return any(fnmatch.fnmatchcase(name, pattern) for name in names)


def matches_within(name: str, pattern: str) -> bool:
    """True if the glob ``pattern`` matches the module path ``name`` or the path of a module
    containing it: 'blocks.0' matches 'blocks.0.attn' (never 'blocks.01.attn')."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")


def select_parameters(
    model: nn.Module,
    include: Iterable[str],
    exclude: Iterable[str] = (),
    setting: str | None = None,
) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters whose names match, in model.named_parameters() order. With
    ``setting`` (its config name), an include glob that matches no parameter is said once."""
    include, exclude = list(include), list(exclude)
    named = list(model.named_parameters())
    if setting is not None:
        _warn_unmatched(setting, include, [name for name, _ in named])
    return [(name, p) for name, p in named if p.requires_grad and matches(name, include, exclude)]


def parameter_state(model: nn.Module) -> tuple[tuple[int, bool], ...]:
    """Which Parameters the model holds and which are trainable (``select_parameters``'s
    inputs besides the globs): a probe selects again when it changed."""
    return tuple((id(p), p.requires_grad) for p in model.parameters())


def _warn_unmatched(setting: str, patterns: list[str], names: list[str]) -> None:
    """A glob or class name that matches nothing is most likely a typo: its probe would
    watch nothing, silently."""
    for p in patterns:
        if p != "*" and not matches_any(names, p):
            log.warning(
                "numwatch: %s entry %r matches nothing in the model (e.g. %r); it selects nothing",
                setting,
                p,
                names[-1] if names else "",
            )


def select_modules(
    model: nn.Module,
    include: Iterable[str],
    exclude: Iterable[str] = (),
    types: Iterable[str] = (),
    setting: str | None = None,
    types_setting: str | None = None,
) -> list[tuple[str, nn.Module]]:
    """Submodules (never the root) whose names and class names match. A class name matches a
    subclass too, as a dotted path does (isinstance). With ``setting`` (the globs' config name)
    and ``types_setting`` (the classes'), a glob or class that matches nothing is said once."""
    include, exclude, types = list(include), list(exclude), list(types)
    short = {t for t in types if "." not in t}
    classes = tuple(_resolve(t) for t in types if "." in t)
    named = [(name, m) for name, m in model.named_modules() if name]
    if setting is not None:
        _warn_unmatched(setting, include, [name for name, _ in named])
    if types_setting is not None:
        seen = {c.__name__ for _, m in named for c in type(m).__mro__}
        unmatched = sorted(short - seen) + [
            f"{c.__module__}.{c.__qualname__}"
            for c in classes
            if not any(isinstance(m, c) for _, m in named)
        ]
        for t in unmatched:
            log.warning("numwatch: %s class %r is no module class of the model", types_setting, t)
    out = []
    for name, module in named:
        if not matches(name, include, exclude):
            continue
        if (
            types
            and not isinstance(module, classes)
            and not any(c.__name__ in short for c in type(module).__mro__)
        ):
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
