"""The actions a rule can take. Each is a small config class; ``run`` does one thing.

- ``swap_attention_kernel``: route the event's layer (or all layers) to the stabilized kernel.
- ``skip_step``: this step's optimizer update does not happen (step-level rules only).
- ``lr_backoff``: multiply the learning rate by ``factor`` for ``steps`` optimizer steps.
- ``qk_clip``: rescale the offending head's W_q and W_k rows so its max logit drops to ``tau``.
- ``snapshot``: save the offending tensors and the recent history to a directory (forensics).
- ``halt``: stop training with a report (raises ``NumwatchHalt``).
- ``callback``: call a user function ``fn(event, monitor)``.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from numwatch.actions.base import Action, ActionContext
from numwatch.errors import NumwatchConfigError, NumwatchError, NumwatchHalt
from numwatch.events import Event
from numwatch.probes.optimizer import numeric_lr
from numwatch.probes.qk_layout import QKLayout, find_qk_layout, reads_parameters
from numwatch.sinks.jsonl import json_safe

_log = logging.getLogger("numwatch")

__all__ = [
    "ACTIONS",
    "CallbackAction",
    "ForensicSnapshot",
    "Halt",
    "LrBackoff",
    "QKClip",
    "SkipStep",
    "SwapAttentionKernel",
    "build_action",
]


class SwapAttentionKernel(Action):
    type: Literal["swap_attention_kernel"] = "swap_attention_kernel"
    _unroutable: set[str] = PrivateAttr(default_factory=set)
    scope: Literal["layer", "all"] = Field(
        "layer",
        description="The event's layer only, or every attention layer (one already on a "
        "stabilized kernel keeps it, with its beta and split sum).",
    )
    beta: float = Field(2.0, gt=1.0, le=64.0, description="Stabilization factor of the kernel.")
    split_sum: bool = Field(
        False,
        description="Accumulate the kernel's P̄V in two parts by magnitude (unbiased next to "
        "attention sinks; see numwatch.kernels.flash_attention).",
    )

    def debounce_key(self, event: Event) -> tuple[tuple[str, str], ...]:
        return (("layer", event.labels.get("layer", "")),) if self.scope == "layer" else ()

    def run(self, ctx: ActionContext, event: Event) -> str | None:
        layer = event.labels.get("layer")
        target = layer if self.scope == "layer" and layer is not None else None
        current = ctx.attention_kernel(target or "")
        if (
            target is not None
            and current is not None
            and current.stabilized
            and (current.split_sum or not self.split_sum)
        ):
            return None  # already there (a split sum is never taken back to one sum)
        if target is not None and not ctx.attention_routable(target):
            if target not in self._unroutable:  # said once; no "routed" event for nothing
                self._unroutable.add(target)
                _log.warning(
                    "numwatch: swap_attention_kernel cannot route layer %r: its attention is "
                    "not an SDPA call (eager softmax, numwatch's kernel called directly, or "
                    "nn.MultiheadAttention)",
                    target,
                )
            return None
        # a layer the user put on the split sum keeps it (it is only ever an upgrade)
        split_sum = self.split_sum or (current is not None and current.split_sum)
        # all layers: those already stabilized keep their kernel (beta, split sum), routed
        # after the "*" route, which would otherwise override them
        kept = {} if target else ctx.attention_routing()
        ctx.swap_attention(target, beta=self.beta, split_sum=split_sum)
        for name, kernel in kept.items():
            if kernel is not None and kernel.stabilized:
                ctx.swap_attention(
                    name, beta=kernel.beta, split_sum=kernel.split_sum or self.split_sum
                )
        return (
            f"routed {'layer ' + repr(target) if target else 'all layers'} to the stabilized kernel"
        )


class SkipStep(Action):
    type: Literal["skip_step"] = "skip_step"
    min_interval_steps: int = 0

    def run(self, ctx: ActionContext, event: Event) -> str | None:
        control = ctx.optimizer_control
        if control is None:
            raise NumwatchError("skip_step needs the optimizer: monitor.attach(optimizer)")
        control.skip_current_step()
        return f"skipped the optimizer update of step {event.step}"


class LrBackoff(Action):
    """LR x ``factor`` for ``steps`` optimizer steps, one back-off per rule at a time.

    The LR is one for the whole model while a rule watches many series (every head of
    ``attn_max_logit``): the series firing in one flush, and the rule firing again while its
    back-off runs, would otherwise compound the factor (0.5**8 for 8 heads). So a firing
    replaces the rule's back-off still running: the window restarts (``steps`` optimizer steps
    from this firing), the factor stays. The debounce is per rule too, for the same reason.
    """

    type: Literal["lr_backoff"] = "lr_backoff"
    factor: float = Field(0.5, gt=0.0, lt=1.0, description="LR multiplier while backed off.")
    steps: int = Field(100, ge=1, description="Optimizer steps before the schedule's LR returns.")

    def debounce_key(self, event: Event) -> tuple[tuple[str, str], ...]:
        return (("rule", event.rule),)

    def run(self, ctx: ActionContext, event: Event) -> str | None:
        control = ctx.optimizer_control
        if control is None:
            raise NumwatchError("lr_backoff needs the optimizer: monitor.attach(optimizer)")
        if not any(numeric_lr(group.get("lr")) for group in control.optimizer.param_groups):
            raise NumwatchError(
                "lr_backoff: no param group of the optimizer has a numeric lr (lr=None: the "
                "optimizer computes its step size itself, as Adafactor with relative_step), so "
                "there is no LR to back off; give the optimizer an lr or drop this action"
            )
        control.back_off_lr(self.factor, self.steps, key=(id(self), event.rule))
        return f"LR x{self.factor:g} for {self.steps} steps"


def qk_clip(model: torch.nn.Module, layer: str, head: int, max_logit: float, tau: float) -> float:
    """Scale head ``head``'s W_q and W_k rows (and biases) of ``layer`` by sqrt(tau / max_logit)
    each, so that its logits shrink by tau / max_logit (Kimi K2's QK-clip). Returns the factor."""
    _check_logit(layer, head, max_logit)
    layout = _qk_layout(model, layer)
    ratio = tau / max_logit
    q, k = layout.q[head], layout.k_for(head)
    if len(layout.k) == len(layout.q):
        _scale_once([*q.local_views(), *k.local_views()], math.sqrt(ratio))
    else:  # a key head is shared by several query heads: clip the query side only
        q.scale_(ratio)
    return ratio


def _check_logit(layer: str, head: int | str, max_logit: float) -> None:
    if not (math.isfinite(max_logit) and max_logit > 0):
        raise NumwatchError(
            f"qk_clip: the max logit of {layer!r} head {head} is {max_logit}: a logit that "
            "overflowed (or is not a logit) gives no size to rescale against, and tau / inf "
            "would zero the head's W_q and W_k for good; the head is left as it is"
        )


def _qk_layout(model: torch.nn.Module, layer: str) -> QKLayout:
    module = model.get_submodule(layer)
    layout = find_qk_layout(module)
    if layout is None:
        raise NumwatchError(
            f"qk_clip: no known Q/K projection layout in {layer!r} ({type(module).__name__}); "
            "supported: q_proj/k_proj, query/key, q/k, fused qkv/c_attn/Wqkv, "
            "nn.MultiheadAttention"
        )
    if not reads_parameters(module, layout):
        raise NumwatchError(
            f"qk_clip: the Q/K weights of {layer!r} ({type(module).__name__}) are computed "
            "from parametrizations (weight_norm, spectral_norm, orthogonal...): rescaling the "
            "computed weight would not change the parameters the optimizer updates"
        )
    if layout.qk_norm:
        raise NumwatchError(
            f"qk_clip: {layer!r} ({type(module).__name__}) normalizes q and k per head after "
            "the projections (QK-norm), which undoes any rescale of W_q/W_k: the logits would "
            "not move while the weights shrank at every firing. Its logits are bounded by the "
            "norm's gains instead"
        )
    return layout


@torch.no_grad()
def _scale_once(views: list[torch.Tensor], factor: float) -> None:
    """Scale every element of ``views`` by ``factor`` once, however they alias each other.

    Tied W_q/W_k (one Parameter, or overlapping views) would otherwise be scaled once per side,
    shrinking the logits by ratio**2; writing values computed before any write makes a shared
    element factor * original whichever view writes it last.
    """
    scaled = [v * factor for v in views]
    for v, new in zip(views, scaled, strict=True):
        v.copy_(new)


class QKClip(Action):
    type: Literal["qk_clip"] = "qk_clip"
    tau: float = Field(100.0, gt=0, description="Target max logit after the clip.")
    min_interval_steps: int = 0

    def run(self, ctx: ActionContext, event: Event) -> str | None:
        layer, head, value = event.labels.get("layer"), event.labels.get("head"), event.value
        if layer is None or head is None or value is None or value <= self.tau:
            return None
        _check_logit(layer, head, value)  # refused where it is decided, not after the update
        clip = lambda: qk_clip(ctx.model, layer, int(head), value, self.tau)
        control = ctx.optimizer_control
        if control is not None:
            _qk_layout(ctx.model, layer)  # fails here, counted, rather than after the update
            # As Kimi K2: right after the optimizer update. A clip still pending (an update
            # withheld meanwhile) is replaced by this one, measured on the same weights: queued
            # twice, it would shrink the head's logits twice.
            control.after_next_step(clip, key=("qk_clip", layer, head))
            when = "after the next optimizer update"
        else:
            clip()
            when = "now"
        return f"QK-clip of {layer} head {head}: logits x{self.tau / value:.3g} {when}"


class ForensicSnapshot(Action):
    """Offending tensors and recent flushes, one ``.pt``/``.json`` pair per run.

    Several series of a rule fire in one flush (and every rank writes the same directory), so
    a name made of step and rule is not unique: it carries the series labels, and a counter
    when the name is taken; files are created exclusively, never overwritten.
    """

    type: Literal["snapshot"] = "snapshot"
    directory: str = Field(
        "numwatch-forensics", description="Where snapshot files go (~ and $VARIABLES expanded)."
    )

    @field_validator("directory")
    @classmethod
    def _expand(cls, directory: str) -> str:
        from numwatch.config import expand_path

        return expand_path(directory)

    max_bytes: int = Field(256 * 2**20, ge=0, description="Cap on the tensors saved per event.")
    flushes: int = Field(5, ge=0, description="Recent flushes saved with it.")

    def run(self, ctx: ActionContext, event: Event) -> str | None:
        tensors: dict[str, torch.Tensor] = {}
        budget = self.max_bytes
        for name, t in _offending_tensors(ctx, event):
            size = t.numel() * t.element_size()
            if size <= budget:
                tensors[name] = t.detach().to("cpu", copy=True)
                budget -= size
        history = [s.to_dict() for s in list(ctx.history)[-self.flushes :]] if self.flushes else []
        record = {"event": event.to_dict(), "tensors": sorted(tensors), "history": history}
        stem = self._claim(event)
        torch.save(tensors, f"{stem}.pt")
        with open(f"{stem}.json", "x") as f:
            json.dump(json_safe(record), f, default=str, allow_nan=False)  # as the JSONL log
        return f"saved {len(tensors)} tensors and {len(history)} flushes to {stem}.pt/.json"

    def _claim(self, event: Event) -> Path:
        """A stem no snapshot uses yet, claimed by creating its ``.pt`` file exclusively."""
        out = Path(self.directory)
        out.mkdir(parents=True, exist_ok=True)
        labels = "-".join(f"{k}={v}" for k, v in sorted(event.labels.items()))
        name = _UNSAFE.sub("_", "-".join(filter(None, [event.rule or event.kind, labels])))
        base = f"step{event.step:08d}-{name[:_MAX_NAME]}"
        stem, n = out / base, 0
        while True:
            if not Path(f"{stem}.json").exists():
                try:
                    open(f"{stem}.pt", "xb").close()
                    return stem
                except FileExistsError:
                    pass
            n += 1
            stem = out / f"{base}-{n}"


_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]+")  # runs of what a file name may not hold everywhere
_MAX_NAME = 150  # the name's share of a file name (at most 255 bytes on most filesystems)


def _offending_tensors(ctx: ActionContext, event: Event):
    """The event's parameter or module; a step-level event names none: its step's NaN/Inf
    origin's, read before skip_step clears the gradients (at the optimizer's step)."""
    labels = event.labels or ctx.nonfinite_origin() or {}
    p = ctx.parameter(labels["param"]) if "param" in labels else None
    if p is not None:
        yield labels["param"], p
        if p.grad is not None:
            yield labels["param"] + ".grad", p.grad
    for key in ("layer", "module"):
        if key in labels:
            module = ctx.model.get_submodule(labels[key])
            for name, p in module.named_parameters():
                yield f"{labels[key]}.{name}", p


class Halt(Action):
    type: Literal["halt"] = "halt"
    flushes: int = Field(5, ge=0, description="Recent flushes summarised in the report.")
    min_interval_steps: int = 0

    def run(self, ctx: ActionContext, event: Event) -> str | None:
        recent = list(ctx.history)[-self.flushes :] if self.flushes else []
        report = {
            "rule": event.rule,
            "kind": event.kind,
            "step": event.step,
            "metric": event.metric,
            "labels": event.labels,
            "value": event.value,
            "threshold": event.threshold,
            "message": event.message,
            "recent": [
                {"step": s.step, event.metric: s.get(event.metric, **event.labels)} for s in recent
            ],
        }
        raise NumwatchHalt(report)


class CallbackAction(Action):
    type: Literal["callback"] = "callback"
    target: str | Callable[..., Any] = Field(
        description="'package.module:function' or a callable, called as fn(event, monitor)."
    )
    min_interval_steps: int = 0
    _fn: Callable[..., Any] = PrivateAttr()

    @model_validator(mode="after")
    def _resolve(self) -> CallbackAction:
        """Resolve a 'module:function' target now: a misspelled one would otherwise surface
        only when the rule fires, hours into the run, as a counted action failure."""
        self._fn = _resolve_target(self.target) if isinstance(self.target, str) else self.target
        return self

    def run(self, ctx: ActionContext, event: Event) -> str | None:
        self._fn(event, ctx)
        return f"called {getattr(self._fn, '__qualname__', self._fn)}"


def _resolve_target(target: str) -> Callable[..., Any]:
    module, colon, name = target.partition(":")
    if not colon or not module or not name:
        raise ValueError(f"target {target!r}: expected 'package.module:function'")
    try:
        fn = functools.reduce(getattr, name.split("."), importlib.import_module(module))
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"target {target!r} does not resolve: {exc}") from None
    if not callable(fn):
        raise ValueError(f"target {target!r} is a {type(fn).__name__}, not a callable")
    return fn


ACTIONS: dict[str, type[Action]] = {
    cls.model_fields["type"].default: cls
    for cls in (
        SwapAttentionKernel,
        SkipStep,
        LrBackoff,
        QKClip,
        ForensicSnapshot,
        Halt,
        CallbackAction,
    )
}


def build_action(spec: str | dict[str, Any] | Action, where: str) -> Action:
    """An Action from a rule's ``actions`` entry; errors name the rule and the known types."""
    if isinstance(spec, Action):
        return spec
    data = {"type": spec} if isinstance(spec, str) else dict(spec)
    kind = data.get("type", "")
    cls = ACTIONS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise NumwatchConfigError(
            f"{where}: unknown action {data.get('type')!r}; known: {', '.join(sorted(ACTIONS))}"
        )
    try:
        return cls.model_validate(data)
    except ValidationError as exc:  # one line per problem, not pydantic's multi-line report
        problems = "; ".join(
            (f"{e['loc'][0]}: " if e["loc"] else "") + e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        )
        raise NumwatchConfigError(f"{where}: {data['type']}: {problems}") from None
    except Exception as exc:
        raise NumwatchConfigError(f"{where}: {exc}") from None
