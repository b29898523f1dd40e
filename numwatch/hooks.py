"""Hooks numwatch puts on the user's modules and optimizers.

A module's hooks travel with it when it is copied or pickled (an EMA copy made with
``copy.deepcopy(model)``, ``torch.save(model)``). A bound method of a probe would take the whole
monitor along, its open log file and HTTP server included, and fail. A ``UserHook`` calls
through like the function it wraps; its copies are ``InertHook``s, which do nothing, so a copy
of a monitored model behaves as an unmonitored one. (Unpickling one needs numwatch importable.)
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "InertHook",
    "UserHook",
    "after_first_closure_call",
    "outside_graphs",
    "remove_step_pre_hook",
    "running_step_pre_hook",
    "settle_step_hooks",
    "single_graph",
    "warn_compiled",
]

log = logging.getLogger("numwatch")


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


def outside_graphs(
    fn: Callable[..., Any] | None = None, *, in_graph: Callable[..., Any] | None = None
) -> Callable[..., Any]:
    """``fn``, a hook, run outside compiled graphs: ``torch.compiler.disable``d, so a compile
    that may split its graph (the default) runs it eagerly between two graphs. A compile that
    may not (``fullgraph=True``) skips it instead, and that graph runs unobserved: refused, the
    graph break crashed the user's forward. There ``in_graph``, where given, runs in its place,
    traced by Dynamo (it must trace without a break). As a decorator with only ``in_graph``:
    ``@outside_graphs(in_graph=f)``."""
    if fn is None:
        return functools.partial(outside_graphs, in_graph=in_graph)
    disabled = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> Any:
        if single_graph():
            return None if in_graph is None else in_graph(*args, **kwargs)
        return disabled(*args, **kwargs)

    # Dynamo inlines this wrapper into the graph it traces (to read single_graph()), but never
    # compiles it as a frame of its own: run after the graph break, it was compiled anew for
    # every module type it met, up to Dynamo's recompile limit.
    torch._dynamo.eval_frame.skip_code(hook.__code__)
    return hook


def single_graph() -> bool:
    """Whether Dynamo is tracing a graph that may not break now (``fullgraph=True``, or
    ``torch._dynamo.error_on_graph_break``); False in eager mode, at the cost of one call."""
    return torch.compiler.is_compiling() and _one_graph()


@torch._dynamo.assume_constant_result  # called while tracing, its result a constant
def _one_graph() -> bool:
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        one = bool(tx.one_graph or tx.error_on_graph_break)
    except Exception:  # another torch's internals: tracing as before (the break is refused)
        return False
    global _told_one_graph
    if one and not _told_one_graph:
        _told_one_graph = True
        log.warning(
            "numwatch: torch.compile(fullgraph=True) traces numwatch's hooks, which run "
            "outside compiled graphs only where a graph may break: in such a graph they are "
            "skipped, so the activations and attention it computes are not measured (gradients, "
            "weights, optimizer updates and the loss are); compile without fullgraph=True to "
            "measure them"
        )
    return one


_told_one_graph = False  # the warning above: once per process


def warn_compiled(model: Any) -> None:
    """Warn at attach when Dynamo holds compiled graphs of a forward of ``model``'s module
    classes (``torch.compile`` or ``module.compile()`` ran before): a graph traced before the
    hooks were added runs without them, since Dynamo does not guard on module hooks, also for
    another instance of the class (a model compiled earlier in the process).

    A forward's code is often shared: transformers wraps ``forward`` in decorators whose one
    wrapper serves every model class, and a subclass runs its base's. So each code along the
    ``__wrapped__`` chain is read, and a graph whose guards tie its ``self`` to another class
    is not counted (compiling a BERT made a never-compiled GPT-2 warn, and the advised
    ``torch._dynamo.reset()`` would have thrown away the BERT's graphs)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries
    except ImportError:  # another torch: no way to tell
        return
    instances: dict[type, set[int]] = {}
    for m in model.modules():
        instances.setdefault(type(m), set()).add(id(m))
    compiled = sorted(
        cls.__name__
        for cls, ids in instances.items()
        if any(
            _may_run_for(entry, code, cls, ids)
            for code in _forward_codes(cls)
            for entry in cache_entries(code)
        )
    )
    if compiled:
        log.warning(
            "numwatch: torch.compile compiled %s before attach(): a compiled graph does not see "
            "hooks added after it was traced (Dynamo does not guard on module hooks), so where "
            "the model runs those graphs the activation probe measures only on steps the "
            "attention probe samples (none with it off); attach before the first compiled "
            "forward, or call torch._dynamo.reset() after attach()",
            ", ".join(f"{name}.forward" for name in compiled),
        )


def _forward_codes(cls: type) -> list[Any]:
    """The code objects of ``cls.forward`` and of each function it wraps (``__wrapped__``)."""
    codes, fn, seen = [], getattr(cls, "forward", None), set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        code = getattr(fn, "__code__", None)
        if code is not None:
            codes.append(code)
        fn = getattr(fn, "__wrapped__", None)
    return codes


# A guard on a frame's first argument: its type's id (TYPE_MATCH) or its own (ID_MATCH).
_SELF_GUARD = re.compile(r"___check_(type|obj)_id\(L\['\w+'\], (\d+)\)")


def _may_run_for(entry: Any, code: Any, cls: type, ids: set[int]) -> bool:
    """Whether a Dynamo cache entry of ``code`` may run for the instances of ``cls`` whose ids
    are ``ids``: False only where its guards require the frame's first
    argument to be of another type, or another object; True where they cannot be read."""
    if not code.co_argcount:
        return True  # (*args, **kwargs): its self is not a local of its own
    first = code.co_varnames[0]
    try:
        managers = entry.guard_manager.root.get_child_managers()
        parts = [
            part
            for manager in managers
            if manager.get_source() == f"L['{first}']"
            for guard in manager.get_leaf_guards()
            for part in guard.verbose_code_parts()
        ]
    except Exception:  # another torch's guard internals: counted, as before
        return True
    for part in parts:
        found = _SELF_GUARD.match(part)
        if found:
            wanted = int(found[2])
            return wanted == id(cls) if found[1] == "type" else wanted in ids
    return True


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


# Optimizer step pre-hooks of numwatch's running now (torch is iterating the pre-hook dict).
_running_pre_hooks = [0]


def running_step_pre_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn``, an optimizer step pre-hook, as running while it runs (a detach from inside
    it must not remove pre-hooks then: see ``remove_step_pre_hook``)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _running_pre_hooks[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _running_pre_hooks[0] -= 1

    return wrapper


def remove_step_pre_hook(optimizer: Any, handle: Any) -> None:
    """Remove an optimizer step hook; a pre-hook also from inside one (a callback that detaches
    during the step close it runs). torch iterates the pre-hooks as it calls them: removing one
    there made a later pre-hook's turn raise "OrderedDict mutated during iteration", and the
    update was lost. Inside, the hook is replaced in place by an ``InertHook`` (same key: no
    mutation) and removed by a post-hook of the step (see ``settle_step_hooks``)."""
    hooks = handle.hooks_dict_ref()
    if hooks is None or handle.id not in hooks:
        return
    pre_hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    if not _running_pre_hooks[0] or hooks is not pre_hooks:
        handle.remove()  # (a post-hook: that dict is not being iterated now)
        return
    hooks[handle.id] = InertHook()
    pending = _deferred.setdefault(id(optimizer), [])
    if not pending:

        def remove_after_step(*_: Any) -> None:
            for h in _deferred.pop(id(optimizer), ()):
                h.remove()
            post = cleanup.hooks_dict_ref()
            if post is not None and next(reversed(post), None) == cleanup.id:
                cleanup.remove()  # the last post-hook: the loop ends without another turn
                _cleanups.pop(id(optimizer), None)
            elif post is not None:  # another post-hook comes after: removed at the next attach
                post[cleanup.id] = InertHook()

        cleanup = optimizer.register_step_post_hook(remove_after_step)
        _cleanups[id(optimizer)] = cleanup
    pending.append(handle)


def settle_step_hooks(optimizer: Any) -> None:
    """Remove what a detach inside a step left for later (outside any step: attach calls it),
    also when that step never reached its post-hooks (an exception after the pre-hooks)."""
    for h in _deferred.pop(id(optimizer), ()):
        h.remove()
    cleanup = _cleanups.pop(id(optimizer), None)
    if cleanup is not None:
        cleanup.remove()


# id(optimizer) -> its pre-hook handles (inert now) waiting to be removed outside a step, and
# the post-hook that removes them
_deferred: dict[int, list[Any]] = {}
_cleanups: dict[int, Any] = {}
