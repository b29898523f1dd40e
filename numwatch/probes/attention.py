"""Attention probe: finds every attention call in any model and measures it per (layer, head).

Interception is a ``TorchFunctionMode`` entered around the model's forward on sampled steps (or
on every step while some layer is routed to another kernel, see ``routes``). It sees
``F.scaled_dot_product_attention`` wherever it is called from (nanoGPT, ``nn.MultiheadAttention``
with ``need_weights=False``, Hugging Face ``attn_implementation="sdpa"``) and softmax over
materialized scores (eager attention: 4-D inputs over the last dim, or 3-D inputs inside
``nn.MultiheadAttention``), and eager ``flex_attention`` calls (numwatch.probes.flex). The layer
label is the ``named_modules()`` path of the innermost module whose ``forward`` is on the Python
stack at the call.

Outside sampled steps the mode is not entered at all: the model runs with zero interception.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from numwatch.config import AttentionConfig
from numwatch.errors import NumwatchError
from numwatch.hooks import UserHook, outside_graphs, single_graph
from numwatch.kernels import attention_stats as ats
from numwatch.kernels.flash_attention import (
    autocast_like_sdpa,
    count_fallbacks,
    flash_attention,
    fold_batch_dims,
)
from numwatch.probes import flex
from numwatch.probes.base import ProbeContext
from numwatch.selection import _warn_unmatched, matches, matches_within
from numwatch.snapshot import MetricRecord

__all__ = ["AttentionProbe", "SdpaCall"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SDPA_FUNCS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_SOFTMAX_FUNCS = {F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax}
_SDPA_PARAMS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_TENSOR_DIM = torch.Tensor.dim
try:  # the higher-order op Dynamo traces torch.utils.checkpoint.checkpoint as
    from torch._higher_order_ops.wrap import tag_activation_checkpoint as _CHECKPOINT_HOP
except ImportError:  # another torch
    _CHECKPOINT_HOP = None

log = logging.getLogger("numwatch")

# Why a sampled attention call is not measured (attn_unmeasured_calls_total's reasons).
_UNMEASURED_HINTS = {
    "flex_mods": "its flex_attention score_mod or mask_mod could not be evaluated on index "
    "tensors the way eager flex_attention evaluates them",
    "flex_inputs": "its flex_attention q and k differ in batch size or dtype",
}

# Why a routed layer's calls fall back to SDPA, and what lets them run the kernel.
_FALLBACK_HINTS = {
    "dropout": "their dropout_p > 0, which the kernel does not run (set the model's attention "
    "dropout to 0: Hugging Face's attn_pdrop or attention_dropout)",
    "dtype": "their inputs are not bf16 or fp16 (train in bf16, or under torch.autocast)",
    "arguments": "they pass SDPA arguments the kernel does not know",
}


@dataclass
class SdpaCall:
    """One SDPA call, arguments normalised to keywords (what a routed kernel receives)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> SdpaCall:
        named = dict(zip(("query", "key", "value", *_SDPA_PARAMS), args, strict=False))
        named.update(kwargs)
        q, k, v = named.pop("query"), named.pop("key"), named.pop("value")
        known = {p: named.pop(p) for p in _SDPA_PARAMS if p in named}
        return cls(q, k, v, **known, extra=named)


# Per-call results wait in a list until flush (a sampled step costs one append per call, not a
# merge); a layer's list is folded into one row set when it reaches this length.
_FOLD_AT = 64


@dataclass
class _LayerStats:
    heads: list[torch.Tensor]  # (H, N_HEAD_STATS) float64 per sampled call
    errors: list[torch.Tensor] = field(default_factory=list)  # (H, N_ERR_STATS) float64
    calls: int = 0

    def add(self, heads: torch.Tensor, errors: torch.Tensor | None) -> None:
        self.heads.append(heads)
        if errors is not None:
            self.errors.append(errors)
        self.calls += 1
        if len(self.heads) >= _FOLD_AT:
            self.heads = [merge_heads(self.heads)]
        if len(self.errors) >= _FOLD_AT:
            self.errors = [merge_errors(self.errors)]


def merge_heads(rows: list[torch.Tensor]) -> torch.Tensor:
    """Merge per-call (H, N_HEAD_STATS) rows: extremes by max/min, the rest by sum."""
    return rows[0] if len(rows) == 1 else ats.merge_head_rows(torch.stack(rows), 0)


def merge_errors(rows: list[torch.Tensor]) -> torch.Tensor:
    """Merge per-call (H, N_ERR_STATS) rows: every column adds."""
    return rows[0] if len(rows) == 1 else torch.stack(rows).sum(0)


@dataclass
class _Sampled:
    """An SDPA call's sampled batch elements, measured when the forward returns."""

    layer: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor | None  # None: no output error for this call
    mask: torch.Tensor | None
    is_causal: bool
    scale: float | None
    saturation: torch.dtype
    key: tuple  # calls with equal keys are measured together, layers stacked as heads


# Seed of the probe's own row-sampling generators: the global RNG stays the user's (dropout
# masks and every later draw are those of an unmonitored run).
_ROW_SEED = 0

# Bytes of held copies before the held calls are measured early: bounds the probe's memory
# whatever the model (a 7B model's sampled batch element is ~33 MB per tensor and layer).
_HOLD_BYTES = 256 * 2**20


def _call_route(
    route: Callable[[SdpaCall], torch.Tensor],
    func: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> tuple[torch.Tensor, Counter[str] | None]:
    """A routed call's output, and the calls it handed to SDPA by reason, the kernel's
    fallbacks (None: the call passes arguments of a newer SDPA than SdpaCall knows, which
    SDPA takes itself)."""
    call = SdpaCall.from_args(args, kwargs)
    if call.extra:
        return func(*args, **kwargs), None
    fell: Counter[str] = Counter()
    with count_fallbacks(fell):
        out = route(call)
    return out, fell


def _fallback_of(fell: Counter[str] | None) -> str | None:
    """Why a routed call went to SDPA (None: the kernel ran it)."""
    return "arguments" if fell is None else next(iter(fell), None)


# Probes by key, for what runs while Dynamo traces (_traced_locate, _note_traced): code run
# then takes constants only, never the probe itself.
_TRACING_PROBES: weakref.WeakValueDictionary[int, AttentionProbe] = weakref.WeakValueDictionary()
_probe_keys = itertools.count()


@torch._dynamo.assume_constant_result  # Dynamo calls it while tracing: its result is the graph's
def _traced_locate(probe_key: int) -> str:
    """``AttentionProbe.locate`` for a call Dynamo traces, whose frames are not Python's: the
    innermost module of the probe's model that is a traced frame's first argument (its
    method's ``self``; '' for none).
    The graph is guarded on that module's identity: Dynamo shares one graph among modules of
    one structure (blocks compiled one by one), whose layers may be routed apart."""
    probe = _TRACING_PROBES[probe_key]
    try:
        from torch._dynamo.guards import GuardBuilder, install_guard
        from torch._dynamo.source import ChainedSource, LocalSource
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.variables import CellVariable

        tx = InstructionTranslator.current_tx().output.current_tx  # the innermost frame
        while tx is not None:
            # a method's module is its first argument, whatever its name (``def forward(s,
            # x)``): eager finds it as nn.Module's call frame's ``self``, which Dynamo inlines
            code = tx.f_code
            var = tx.symbolic_locals.get(code.co_varnames[0]) if code.co_argcount else None
            if isinstance(var, CellVariable):  # a forward whose closures use self
                var = tx.output.side_effects.load_cell(var)
            name = probe.name_of(getattr(var, "value", None))
            if name is not None:
                root = var.source
                while isinstance(root, ChainedSource):
                    root = root.base
                # the frame's own module too: Dynamo then counts its recompile limit per
                # instance (a model of more blocks than the limit compiled block by block)
                sources = {var.source, root} if isinstance(root, LocalSource) else {var.source}
                install_guard(*(src.make_guard(GuardBuilder.ID_MATCH) for src in sources))
                return name
            tx = tx.parent
    except Exception as e:  # another torch's internals
        raise NumwatchError(
            "numwatch cannot tell which layer calls attention in a graph compiled with "
            f"fullgraph=True on torch {torch.__version__} ({type(e).__name__}: {e}); compile "
            "without fullgraph=True to route attention layers to numwatch's kernel"
        ) from e
    return ""


@torch._dynamo.assume_constant_result  # Dynamo calls it while tracing, never when graphs run
def _note_traced(probe_key: int, layer: str, routed: bool, reason: str | None) -> bool:
    """Note a layer's attention call in a graph Dynamo traces, and whether that graph runs it
    in numwatch's kernel (``reason``: why it falls back to SDPA instead). Noted by the traced
    code itself, the notes would be replayed on every run of the graph, and guarded: each
    layer seen first recompiled it."""
    probe = _TRACING_PROBES[probe_key]
    probe.layers_seen.add(layer)
    probe.sdpa_layers.add(layer)
    if routed:
        probe._graph_routes[layer] = reason
    else:
        probe._graph_routes.pop(layer, None)
    return True


@torch._dynamo.assume_constant_result  # Dynamo calls it while tracing, never when graphs run
def _note_checkpointed(probe_key: int) -> bool:
    """Note a block Dynamo traces through activation checkpointing with a layer in it routed
    ('' for a body of no module): said at the step's close (``_tell_checkpointed``). Dynamo
    hands the checkpoint's higher-order op to the routing mode, popped while the op traces its
    body (a mode pushed again there is a side effect the op refuses): the body's attention
    calls never reach the mode, and run native SDPA, unrouted and unsaid."""
    probe = _TRACING_PROBES[probe_key]
    block = ""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx().output.current_tx  # the mode's frame
        body = tx.symbolic_locals["args"].items[0]
        block = probe.name_of(getattr(body, "value", None)) or ""
    except Exception:  # another torch's internals: noted unnamed
        pass
    if block and not any(
        probe.route_for(n) is not None
        for n in probe._names.values()
        if n == block or n.startswith(block + ".")
    ):
        return False  # nothing routed in it
    probe._checkpointed.add(block)
    return True


@torch._dynamo.assume_constant_result  # fnmatch, which Dynamo cannot trace, of two constants
def _traced_within(layer: str, pattern: str) -> bool:
    return matches_within(layer, pattern)


class _Interceptor(TorchFunctionMode):
    def __init__(self, probe: AttentionProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # An eager flex_attention call's first Tensor.dim() (its 4-D check) comes from its own
        # frame; a compiled one is traced, where this branch is never taken (a frame read
        # would split the graph).
        if func is _TENSOR_DIM and not torch.compiler.is_compiling() and self.probe.sampling:
            self.probe.on_flex_entry(sys._getframe(1))
        elif func is flex.FLEX_HOP and torch.compiler.is_compiling():
            flex.tell_compiled()
        elif func is _CHECKPOINT_HOP and self.probe.routing:  # (eager checkpointing calls none)
            _note_checkpointed(self.probe._key)
        if func in _SDPA_FUNCS or func is flash_attention:
            # numwatch's own kernel, called by the model itself: observed, never routed
            routable = func is not flash_attention
            if single_graph():  # fullgraph=True: no call leaves the graph
                return self.probe.route_in_graph(func, args, kwargs, routable)
            return self.probe.on_sdpa(func, args, kwargs, routable=routable)
        if func is F.multi_head_attention_forward:
            # Ops inside MHA's forward run with this mode popped: measured from its arguments,
            # and its SDPA call cannot be routed.
            self.probe.on_mha(args, kwargs)
        if func in _SOFTMAX_FUNCS and self.probe.sampling:
            self.probe.on_softmax(args, kwargs)
        return func(*args, **kwargs)


class AttentionProbe:
    """Per-(layer, head) precursor statistics of attention, on sampled steps."""

    component = "attention"

    def __init__(self, model: nn.Module, cfg: AttentionConfig, ctx: ProbeContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.model = model
        self._names = {id(m): name for name, m in model.named_modules()}
        _warn_unmatched("attention.layers", cfg.layers, list(self._names.values()))
        self._foreign: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules of other models
        self._modules: dict[str, nn.Module] = {}  # layer name -> module, looked up once
        self._selected: dict[str, bool] = {}
        self._stats: dict[str, _LayerStats] = {}
        # layers measured from a softmax input (eager attention), and those of them found
        # shifted by their row maximum (see records)
        self._score_layers: set[str] = set()
        self._shifted_layers: set[str] = set()
        self._handles: list[Any] = []
        self._mode: _Interceptor | None = None
        self._held: list[_Sampled] = []
        self._held_bytes = 0
        # the held copy of each mask (the user's tensor, its version and the sampled slice's
        # shape and dtype -> (that tensor, the copy)): layers sharing one mask share its copy
        self._held_masks: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        self.unroutable: set[str] = set()  # routed MHA layers, told they cannot be
        self._depth = 0
        self._root_open = 0  # model forwards entered and not exited (the rest: begin_forward)
        self.sampling = False
        self.layers_seen: set[str] = set()
        # layers whose SDPA calls a route can take (not eager softmax, not numwatch's kernel
        # called by the model itself, not nn.MultiheadAttention)
        self.sdpa_layers: set[str] = set()
        # Layer glob -> kernel replacing SDPA there (None = native); the last match wins.
        self._routes: dict[str, Callable[[SdpaCall], torch.Tensor] | None] = {}
        self._route_cache: dict[str, Callable[[SdpaCall], torch.Tensor] | None] = {}
        # Routed layers' own entry hooks: a forward of theirs outside the model's (activation
        # checkpointing recomputes it in backward) must run the same kernel as the forward did.
        self._route_handles: dict[str, list[Any]] = {}
        self._route_hooked: set[str] = set()
        self._route_depth = 0
        self._route_mode: _Interceptor | None = None
        # Routed calls per layer, [calls, those numwatch's kernel ran] (the rest fell back to
        # SDPA): in the step in progress, and in the step closed last (kernel_share)
        self._routed_calls: dict[str, list[int]] = {}
        self._closed_routed_calls: dict[str, list[int]] = {}
        self._told_fallback: set[str] = set()
        # Graphs that may not break (fullgraph=True): the routing mode entered there and its
        # depth (_graph_enter), and, per layer routed there, why its calls fall back to SDPA
        # (None: they run numwatch's kernel), as traced; this probe's key for code run while
        # Dynamo traces (_TRACING_PROBES)
        self._graph_mode = _Interceptor(self)
        self._graph_depth = 0
        self._graph_routes: dict[str, str | None] = {}
        self._key = next(_probe_keys)
        _TRACING_PROBES[self._key] = self
        # Route patterns set since the last check against the layers seen calling SDPA (at the
        # close of a step whose forward the mode saw: _check_routes), those found to take none
        self._unchecked_routes: set[str] = set()
        self._told_unmatched: set[str] = set()
        self._forward_seen = False
        # flex_attention's code where the user imported it (looked up as sampled forwards start),
        # and the eager call seen at its entry and measured once it has returned (its output
        # is then a local of its frame): that frame, and the layer that made the call (None:
        # a layer left out)
        self._flex_code: CodeType | None = None
        self._flex_frame: FrameType | None = None
        self._flex_layer: str | None = None
        self._told_unmeasured: set[str] = set()
        # blocks traced through activation checkpointing with a routed layer in them, in the
        # step in progress (_note_checkpointed), and whether one was said (_tell_checkpointed)
        self._checkpointed: set[str] = set()
        self._told_checkpointed = False

    # ------------------------------------------------------------------ kernel routing
    def set_route(self, pattern: str, kernel: Callable[[SdpaCall], torch.Tensor] | None) -> None:
        """Send SDPA calls of layers matching ``pattern`` to ``kernel`` (None = native SDPA)."""
        self._routes.pop(pattern, None)
        self._routes[pattern] = kernel
        self._route_cache.clear()
        self._unchecked_routes.add(pattern)
        self.hook_routed_layers()

    def clear_routes(self) -> None:
        self._routes.clear()
        self._route_cache.clear()
        self._unchecked_routes.clear()
        self.hook_routed_layers()

    def _check_routes(self) -> None:
        """Say once of a route pattern that takes no layer seen calling SDPA: one that names a
        module without attention ('blocks.0.mlp'), or a layer whose attention is eager, would
        route nothing, silently. Checked after a forward, where the layers calling SDPA are
        known; a pattern for layers that run on some steps only may be said early."""
        takes = self.sdpa_layers | self.unroutable  # MHA layers are told of in on_mha
        for pattern in sorted(self._unchecked_routes - self._told_unmatched):
            if not any(matches_within(layer, pattern) for layer in takes):
                self._told_unmatched.add(pattern)
                log.warning(
                    "numwatch: layer pattern %r matches no layer that calls "
                    "F.scaled_dot_product_attention (those seen: %s); it routes nothing. A route "
                    "takes such layers by their own path or a parent module's (a block's)",
                    pattern,
                    ", ".join(repr(layer) for layer in sorted(self.sdpa_layers)[:4]) or "none",
                )
        self._unchecked_routes.clear()

    def hook_routed_layers(self) -> None:
        """Hook the layers that a route takes now (those seen calling SDPA), and no others.
        Only the difference changes: this runs inside a routed call too (a layer seen first
        there), where unhooking every layer dropped the running one's exit hook and left its
        mode on the stack for good."""
        want = {
            layer
            for layer in self.sdpa_layers
            if layer not in self.unroutable and self.route_for(layer) is not None
        }
        for layer in self._route_hooked - want:
            for h in self._route_handles.pop(layer, ()):
                h.remove()
        for layer in sorted(want - self._route_hooked):
            module = self._modules.get(layer) or self.model.get_submodule(layer)
            self._modules[layer] = module
            self._route_handles[layer] = [
                module.register_forward_pre_hook(UserHook(self._route_enter)),
                module.register_forward_hook(UserHook(self._route_exit), always_call=True),
            ]
        self._route_hooked = want

    def _unhook_routed_layers(self) -> None:
        for handles in self._route_handles.values():
            for h in handles:
                h.remove()
        self._route_handles.clear()
        self._route_hooked = set()
        self._drop_route_mode()

    def _drop_route_mode(self) -> None:
        """No routed call is open (detach, a model forward starting): a routing mode left
        entered (a KeyboardInterrupt in a layer called alone skips its exit hook, and nothing
        unwinds the stack there) would intercept, and sample, every later call twice."""
        self._route_depth = 0
        self._pop_route_mode()

    @outside_graphs
    def _route_enter(self, _module: nn.Module, _inputs: Any) -> None:
        # Inside the model's forward the mode is entered already; outside it (a recompute in
        # backward, a layer called alone) only routing, never sampling: a recompute is not a
        # second call.
        if self._depth:
            return
        self._drop_stale_route_mode()
        if not (self._route_depth or self.routing):
            return
        self._route_depth += 1
        if self._route_depth == 1:
            self._route_mode = _Interceptor(self)
            self._route_mode.__enter__()

    @outside_graphs
    def _route_exit(self, _module: nn.Module, _inputs: Any, _output: Any) -> None:
        if self._depth or self._route_depth == 0:
            return
        self._route_depth -= 1
        if self._route_depth == 0:
            self._pop_route_mode()

    def _drop_stale_route_mode(self) -> None:
        """A KeyboardInterrupt in a recompute skips the exit hook, and the autograd engine
        unwinds the mode stack itself: the mode it held is gone, forget it."""
        mode = self._route_mode
        if mode is not None and mode not in torch.overrides._get_current_function_mode_stack():
            self._route_mode, self._route_depth = None, 0

    def _pop_route_mode(self) -> None:
        """Pop the routing mode only from the top of the stack: never another mode."""
        mode, self._route_mode = self._route_mode, None
        stack = torch.overrides._get_current_function_mode_stack()
        if mode is not None and stack and stack[-1] is mode:
            mode.__exit__(None, None, None)

    @property
    def routing(self) -> bool:
        """Whether forwards need the mode to route: a route is set. A route that names a
        layer whose attention cannot be swapped (nn.MultiheadAttention, by its path: the
        default rules' swaps do) needs none, once that layer was seen: the mode turns torch's
        nested-tensor fast path of nn.TransformerEncoder off. A glob may take layers not seen
        yet (one that runs on some steps only, a decoder in generate()), so it keeps it."""
        return any(
            kernel is not None and (pattern not in self.unroutable or _is_glob(pattern))
            for pattern, kernel in self._routes.items()
        )

    def route_for(self, layer: str) -> Callable[[SdpaCall], torch.Tensor] | None:
        if layer not in self._route_cache:
            self._route_cache[layer] = self._matching_route(layer, matches_within)
        return self._route_cache[layer]

    def _matching_route(
        self, layer: str, within: Callable[[str, str], bool]
    ) -> Callable[[SdpaCall], torch.Tensor] | None:
        """The route of the last pattern set that takes ``layer`` (None: no route)."""
        for pattern in reversed(list(self._routes)):
            if within(layer, pattern):
                return self._routes[pattern]
        return None

    # ------------------------------------------------------------------ mode around forward
    def attach(self) -> None:
        # The entry runs before and the exit after every hook the model already has, so none of
        # them can skip the entry and still get the exit (an always_call hook runs even when a
        # pre-hook raised).
        self._handles = []
        for root in self._roots():
            self._handles += [
                root.register_forward_pre_hook(UserHook(self._enter), prepend=True),
                root.register_forward_hook(UserHook(self._exit), always_call=True),
            ]

    def _roots(self) -> list[nn.Module]:
        """The model, and an encoder-decoder's encoder: generate() runs it through
        ``get_encoder()``, outside the model's forward (inside it, its entry only nests)."""
        roots = [self.model]
        get_encoder = getattr(self.model, "get_encoder", None)
        if callable(get_encoder):
            try:
                encoder = get_encoder()
            except Exception:  # a decoder-only model's get_encoder may refuse: no encoder
                encoder = None
            if isinstance(encoder, nn.Module) and encoder is not self.model:
                roots.append(encoder)
        return roots

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._unhook_routed_layers()
        self._abandon_forward()

    def on_step(self) -> None:
        """The calls of a forward still open belong to the step that closes; a model forward
        still open never reached its exit (a forward opened by ``begin_forward`` is the
        caller's to close)."""
        if self._held or self._flex_frame is not None:
            with torch._C.DisableTorchFunction():  # the mode may still be entered
                self._measure_flex()
                self._measure_held()
        if self._root_open or self._graph_depth:
            self._abandon_forward()
        self._closed_routed_calls, self._routed_calls = self._routed_calls, {}
        if self._checkpointed:
            self._tell_checkpointed()
        for layer, reason in self._graph_routes.items():
            if reason is not None:  # (a graph cannot log)
                self._tell_fallback(layer, reason)
        if self._forward_seen and self._unchecked_routes:
            self._check_routes()
        self._forward_seen = False

    def _tell_checkpointed(self) -> None:
        """Say once that a block traced through activation checkpointing ran native SDPA for
        its routed layers: none of its layers had a routed call in the step (a trace that
        fell back to eager, e.g. a graph break in the body, routed them as eager does)."""
        blocks, self._checkpointed = self._checkpointed, set()
        for block in sorted(blocks):
            if self._told_checkpointed:
                return
            if any(
                not block or layer == block or layer.startswith(block + ".")
                for layer in self._closed_routed_calls
            ):
                continue
            self._told_checkpointed = True
            log.warning(
                "numwatch: torch.compile traced %s through activation checkpointing "
                "(torch.utils.checkpoint), where numwatch cannot route attention: its routed "
                "layers run native SDPA in the compiled graph, not numwatch's kernel, and "
                "attn_kernel_stabilized does not count them. Run routed layers without "
                "checkpointing under torch.compile, or eagerly, to route them",
                f"block {block!r}" if block else "a checkpointed block",
            )

    def _abandon_forward(self) -> None:
        # A forward that never reached its exit (a KeyboardInterrupt, or an exception in a
        # compiled forward: torch runs always_call hooks for neither) left the mode entered;
        # every later forward would only nest inside it, intercepted and sampled.
        self._depth = self._root_open = 0
        self._leave()
        self._flex_frame = None
        self._drop_graph_mode()
        self._held.clear()
        self._held_masks.clear()
        self._held_bytes = 0

    def _graph_enter(self, _module: nn.Module, _inputs: Any) -> None:
        """``_enter`` where no graph may break (fullgraph=True): nothing is sampled, but where a
        route is set the routing mode is entered, so that routed layers run numwatch's kernel
        in the graph (``route_in_graph``). Dynamo traces this: inlined into the model's graph,
        the mode only shapes that graph; compiled as a frame of its own (the root hooks of a
        model compiled whole), the frame pushes the mode when it runs, and ``_graph_exit``'s
        pops it. Reading the routes guards it: a swap or restore recompiles it."""
        if self.routing:
            self._graph_depth += 1
            if self._graph_depth == 1:
                self._graph_mode.__enter__()

    def _graph_exit(self, _module: nn.Module, _inputs: Any, _output: Any) -> None:
        if self._graph_depth:
            self._graph_depth -= 1
            if self._graph_depth == 0:
                self._graph_mode.__exit__(None, None, None)

    def _drop_graph_mode(self) -> None:
        """Pop the routing mode that an entry compiled as a frame of its own pushed, where its
        exit never ran compiled (a forward that failed to compile runs its exit hook outside
        Dynamo, where it is ``_exit``): it would stay entered for good."""
        depth, self._graph_depth = self._graph_depth, 0
        stack = torch.overrides._get_current_function_mode_stack()
        if depth and stack and stack[-1] is self._graph_mode:
            self._graph_mode.__exit__(None, None, None)

    # The mode is entered and left outside compiled graphs (tests/test_compile.py).
    @outside_graphs(in_graph=_graph_enter)
    def _enter(self, _module: nn.Module, _inputs: Any) -> None:
        self._root_open += 1
        self.begin_forward()

    @outside_graphs(in_graph=_graph_exit)
    def _exit(self, _module: nn.Module, _inputs: Any, _output: Any) -> None:
        self._root_open = max(self._root_open - 1, 0)
        self.end_forward()

    def begin_forward(self) -> None:
        """Start intercepting (on sampled steps, or while routing); nested calls nest."""
        self._depth += 1
        if self._depth > 1:
            return
        if self._route_depth:  # no layer call is open outside a model forward that starts
            self._drop_route_mode()
        self.sampling = (
            self.cfg.enabled
            and self.ctx.step % self.cfg.every == 0
            # validation: eval mode, or no_grad / inference_mode with the model in train mode
            and ((self.model.training and torch.is_grad_enabled()) or not self.cfg.training_only)
        )
        if self.sampling:
            self._flex_code = flex.entry_code()
        if self.sampling or self.routing:
            self._mode = _Interceptor(self)
            self._mode.__enter__()
            self._forward_seen = True

    def end_forward(self) -> None:
        """Undo ``begin_forward``; an exit without an entry (a pre-hook before it raised, or a
        stray ``Monitor.end_forward``) has nothing to undo."""
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            self._leave()
            self._measure_flex()
            if self._held:
                self._measure_held()

    def _leave(self) -> None:
        mode, self._mode = self._mode, None
        self.sampling = False
        if mode is not None:
            mode.__exit__(None, None, None)

    # ------------------------------------------------------------------ calls
    def locate(self) -> tuple[str, nn.Module | None]:
        """Innermost module of this model whose method is on the Python stack."""
        frame = sys._getframe(2)
        while frame is not None:
            obj = frame.f_locals.get("self")
            name = self.name_of(obj)
            if name is not None:
                return name, obj
            frame = frame.f_back
        return "", None

    def name_of(self, obj: Any) -> str | None:
        """``obj``'s path in the model, None where it is no module of it."""
        if not isinstance(obj, nn.Module):
            return None
        name = self._names.get(id(obj))
        if name is None and obj not in self._foreign:  # added after attach?
            self._names = {id(m): n for n, m in self.model.named_modules()}
            name = self._names.get(id(obj))
            if name is None:
                self._foreign.add(obj)
        return name

    def _wanted(self, layer: str) -> bool:
        hit = self._selected.get(layer)
        if hit is None:
            hit = self._selected[layer] = matches(layer, self.cfg.layers, self.cfg.exclude)
        return hit

    # Attention calls run outside compiled graphs: a routed kernel or the statistics kernels
    # inside Dynamo's trace fail (Triton's interpreter) or would be traced op by op.
    @torch.compiler.disable
    def on_sdpa(
        self, func: Callable[..., Any], args: tuple, kwargs: dict, routable: bool = True
    ) -> torch.Tensor:
        layer, _ = self.locate()
        self.layers_seen.add(layer)
        if routable:
            self.sdpa_layers.add(layer)
        route = self.route_for(layer) if routable else None
        if route is not None and layer not in self._route_hooked:  # routed, first seen now
            self.hook_routed_layers()
        if route is not None:
            out = self._run_routed(layer, route, func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self.sampling and self.cfg.sdpa and self._wanted(layer) and not _transformed(out):
            self.ctx.guard.run(self.component, self._observe_sdpa, layer, args, kwargs, out)
        return out

    def _run_routed(
        self,
        layer: str,
        route: Callable[[SdpaCall], torch.Tensor],
        func: Callable[..., Any],
        args: tuple,
        kwargs: dict,
    ) -> torch.Tensor:
        """A routed call, counted by whether the kernel ran it: a call it cannot run (the kernel
        decides from the arguments: no host sync) goes to SDPA, and a layer whose calls do is
        said once, or its route would seem to stabilize it."""
        out, fell = _call_route(route, func, args, kwargs)
        if fell is not None:
            self.ctx.kernel_fallbacks.update(fell)
        reason = _fallback_of(fell)
        counts = self._routed_calls.setdefault(layer, [0, 0])
        counts[0] += 1
        if reason is None:
            counts[1] += 1
        else:
            self._tell_fallback(layer, reason)
        return out

    def _tell_fallback(self, layer: str, reason: str) -> None:
        if layer not in self._told_fallback:
            self._told_fallback.add(layer)
            log.warning(
                "numwatch: layer %r is routed to numwatch's attention kernel, but its calls fall "
                "back to native SDPA: %s; attn_kernel_stabilized counts the calls the kernel ran",
                layer,
                _FALLBACK_HINTS.get(reason, f"reason {reason!r} (attn_kernel_fallbacks_total)"),
            )

    def route_in_graph(
        self, func: Callable[..., Any], args: tuple, kwargs: dict, routable: bool
    ) -> torch.Tensor:
        """An attention call in a graph that may not break (fullgraph=True): never observed; a
        routed one runs numwatch's kernel inside the graph (its custom ops). Calls are not
        counted there: Dynamo replays a count kept in Python on every run of the graph, each
        value a new guard, which recompiled it every step. What the graph runs is noted per
        layer instead, when traced (``_graph_routes``, read by ``kernel_share``)."""
        if not (routable and self.routing):
            return func(*args, **kwargs)
        layer = _traced_locate(self._key)
        route = self._traced_route(layer)
        if route is None:
            _note_traced(self._key, layer, False, None)
            return func(*args, **kwargs)
        out, fell = _call_route(route, func, args, kwargs)
        _note_traced(self._key, layer, True, _fallback_of(fell))
        return out

    def _traced_route(self, layer: str) -> Callable[[SdpaCall], torch.Tensor] | None:
        """``route_for`` for a call Dynamo traces: the patterns are read there (they guard the
        graph: a swap or restore recompiles it), and matched while it traces."""
        return self._matching_route(layer, _traced_within)

    def kernel_share(self, layer: str) -> float | None:
        """The share of ``layer``'s routed calls in the step closed last that numwatch's kernel
        ran (the rest fell back to SDPA); None where the layer had no routed call."""
        calls, ran = self._closed_routed_calls.get(layer, (0, 0))
        if calls:
            return ran / calls
        if layer in self._graph_routes:  # routed in a compiled graph, whose calls it runs
            return 0.0 if self._graph_routes[layer] else 1.0
        return None

    @outside_graphs
    def on_softmax(self, args: tuple, kwargs: dict) -> None:
        if not self.cfg.eager_softmax:
            return
        x = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or _transformed(x):
            return
        if dim not in (-1, x.dim() - 1):
            return
        if x.dim() == 3:
            layer, module = self.locate()
            if not isinstance(module, nn.MultiheadAttention):
                return
            x = x.reshape(-1, module.num_heads, *x.shape[1:])  # (B*H, L, S) -> (B, H, L, S)
        elif x.dim() == 4:
            layer, _ = self.locate()
        else:
            return
        if self._wanted(layer):
            self.ctx.guard.run(self.component, self._observe_scores, layer, x)

    def on_flex_entry(self, frame: FrameType) -> None:
        """``frame`` made a Tensor.dim() call: where it runs flex_attention, an eager call has
        started, so the one before it has returned and is measured now; this one will be once
        it has returned too (at the next call or the forward's end), its output a local then."""
        if frame.f_code is not self._flex_code or frame is self._flex_frame:
            return
        self._measure_flex()
        layer, _ = self.locate()
        self.layers_seen.add(layer)
        self._flex_frame = frame
        self._flex_layer = layer if self._wanted(layer) else None

    @outside_graphs
    def on_mha(self, args: tuple, kwargs: dict) -> None:
        layer, _ = self.locate()
        self.layers_seen.add(layer)
        if self.route_for(layer) is not None and layer not in self.unroutable:
            # torch runs MHA's attention inside multi_head_attention_forward, out of any
            # mode's reach: a swap cannot apply there (said once; attn_kernel_stabilized is 0)
            self.unroutable.add(layer)
            log.warning(
                "numwatch: layer %r is nn.MultiheadAttention, whose attention runs inside "
                "torch's multi_head_attention_forward: its kernel cannot be swapped",
                layer,
            )
        query = args[0] if args else kwargs.get("query")
        if self.sampling and self._wanted(layer) and not _transformed(query):
            self.ctx.guard.run(self.component, self._observe_mha, layer, args, kwargs)

    # ------------------------------------------------------------------ statistics
    def _saturation_dtype(self, x: torch.Tensor) -> torch.dtype:
        if self.cfg.saturation_dtype != "auto":
            return _DTYPES[self.cfg.saturation_dtype]
        kind = x.device.type
        if x.dtype == torch.float32 and torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
        return x.dtype if x.dtype in _DTYPES.values() else torch.float32

    def _n_batch(self, B: int) -> int:
        """Batch elements sampled per call: the first ``attention.batch`` (0 = all)."""
        return self.cfg.batch if 0 < self.cfg.batch < B else B

    def _rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """Query rows sampled per call (None = all)."""
        Tq = x.shape[-2]
        if self.cfg.rows and self.cfg.rows < Tq:
            gen = self._generators.get(x.device)
            if gen is None:
                gen = self._generators[x.device] = torch.Generator(x.device).manual_seed(_ROW_SEED)
            return torch.randperm(Tq, device=x.device, generator=gen)[: self.cfg.rows]
        return None

    def _samples(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        n = self._n_batch(x.shape[0])
        batch = torch.arange(n, device=x.device) if n < x.shape[0] else None
        return batch, self._rows(x)

    @torch.no_grad()
    def _observe_sdpa(self, layer: str, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        """Hold copies of the call's sampled batch elements until the forward returns (or
        ``_HOLD_BYTES`` are held); then calls of the same shape are measured in one go, their
        layers stacked as heads (a GPT-2 layer measured alone cost ~2 ms of host time).
        Copies, not views: a view would keep the whole batch's tensors alive, which autograd
        does not always do (no_grad evaluation, frozen layers, the output).
        No output error with ``dropout_p > 0``: the recomputation has no dropout, so the error
        would measure dropout noise (the score statistics do not depend on dropout)."""
        call = SdpaCall.from_args(args, kwargs)
        q, k, v = call.q.detach(), call.k.detach(), call.v.detach()
        if q.dim() == k.dim() == v.dim() == 3:  # unbatched (H, T, D): one batch element
            q, k, v = q[None], k[None], v[None]
            out = out[None] if isinstance(out, torch.Tensor) else out
        mask, n = call.attn_mask, None
        if q.dim() == k.dim() == v.dim() > 4:  # (B, ..., H, T, D): windowed attention
            n = self._n_batch(max(q.shape[0], k.shape[0], v.shape[0]))
            q, k, v, out, mask = _fold_batch_dims(q, k, v, out, mask, n)
            n = q.shape[0]
        if not q.dim() == k.dim() == v.dim() == 4:
            raise ValueError(
                "attention statistics measure SDPA calls with (B, ..., H, T, D) or unbatched "
                f"(H, T, D) q, k, v of one rank; got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}"
            )
        q, k, v = _broadcast_like_sdpa(q, k, v)
        if not _measured(q) or k.shape[2] == 0:  # no keys: no score to measure
            return
        groups = self._packed_gqa_groups(layer, q, k, call.is_causal)
        if groups:  # back to (B, heads, 1, D): the rows of one key head are query heads
            q = q.reshape(q.shape[0], -1, 1, q.shape[-1])
            if isinstance(out, torch.Tensor):
                out = out.reshape(out.shape[0], -1, 1, out.shape[-1])
            if mask is not None and mask.dim() == 4 and mask.shape[-2] == groups:
                mask = mask.reshape(mask.shape[0], -1, 1, mask.shape[-1])
        n = self._n_batch(q.shape[0]) if n is None else n
        if mask is not None and mask.dim() == 4 and mask.shape[0] == q.shape[0]:
            mask = mask[:n]
        with_error = (
            self.cfg.output_error
            and not call.dropout_p
            and isinstance(out, torch.Tensor)
            and out.shape[:-1] == q.shape[:-1]
        )
        saturation = self._saturation_dtype(q)
        # What the kernel computed with: under autocast SDPA casts its inputs (and a float mask)
        q, k, v, mask = autocast_like_sdpa(q[:n], k[:n], v[:n], mask)
        mask = None if mask is None else self._held_mask(call.attn_mask, mask)
        # A mask with one entry per head cannot follow heads stacked across layers.
        stackable = mask is None or mask.dim() < 3 or mask.shape[-3] == 1
        key = (
            tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype,
            q.device, bool(call.is_causal), call.scale, saturation, with_error,
            mask if stackable else object(),  # the held copy itself: id-hashed
            None if mask is None else mask.dtype, out.dtype if with_error else None,
        )  # fmt: skip
        held = [t.clone() for t in ((q, k, v, out.detach()[:n]) if with_error else (q, k, v))]
        out_n = held[3] if with_error else None
        sampled = _Sampled(
            layer, held[0], held[1], held[2], out_n, mask, bool(call.is_causal), call.scale,
            saturation, key,
        )  # fmt: skip
        self._held.append(sampled)
        self._held_bytes += sum(t.numel() * t.element_size() for t in held)
        if self._held_bytes >= _HOLD_BYTES:
            self._measure_held()

    def _held_mask(self, given: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A copy of the call's (sampled) mask, one per version of the user's tensor: a mask
        buffer refilled in place for the next layer (causal, then a sliding window) measured
        the earlier layers with its last contents."""
        try:
            version = given._version
        except RuntimeError:  # an inference tensor keeps no version: a copy of its own
            version = object()
        cache = (id(given), version, tuple(mask.shape), mask.dtype)
        found = self._held_masks.get(cache)
        if found is None or found[0] is not given:
            base = mask  # a broadcast dimension (stride 0) is copied once, not materialized
            for d in range(mask.dim()):
                if mask.stride(d) == 0 and mask.shape[d] > 1:
                    base = base.narrow(d, 0, 1)
            base = base.clone()
            found = self._held_masks[cache] = (given, base.expand(mask.shape))
            self._held_bytes += base.numel() * base.element_size()
        return found[1]

    def _packed_gqa_groups(
        self, layer: str, q: torch.Tensor, k: torch.Tensor, is_causal: bool
    ) -> int:
        """Query heads per key head when ``q`` is a one-token GQA query that Hugging Face's
        SDPA attention packed as (B, key heads, group, D) (``pack_gqa``, decoding with a mask),
        else 0. Measured as it comes, its rows would be query heads and its heads key heads, and
        the layer's head count would change within a window (generate's prefill, then decode)."""
        module = self._modules.get(layer)
        if module is None:
            module = self._modules[layer] = self.model.get_submodule(layer)
        g = getattr(module, "num_key_value_groups", 1)
        heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
        packed = (
            isinstance(g, int) and g > 1 and not is_causal and q.shape[1] == k.shape[1]
            and q.shape[2] == g and heads == q.shape[1] * g
        )  # fmt: skip
        return g if packed else 0

    @torch.no_grad()
    def _measure_held(self) -> None:
        held, self._held = self._held, []
        self._held_masks.clear()
        self._held_bytes = 0
        groups: dict[tuple, list[_Sampled]] = {}
        for call in held:
            groups.setdefault(call.key, []).append(call)
        for group in groups.values():  # a failing group costs only its own layers
            self.ctx.guard.run(self.component, self._measure_group, group)

    def _measure_group(self, group: list[_Sampled]) -> None:
        first = group[0]
        L, H = len(group), first.q.shape[1]

        def stacked(name: str) -> torch.Tensor:
            parts = [getattr(c, name) for c in group]
            return parts[0] if L == 1 else torch.cat(parts, 1)

        q, k = stacked("q"), stacked("k")
        rows = self._rows(q)
        backend = self.ctx.backend_for(q.device)
        heads = ats.attention_head_stats(
            q,
            k,
            attn_mask=first.mask,
            is_causal=first.is_causal,
            scale=first.scale,
            rows=rows,
            saturation_dtype=first.saturation,
            entropy=self.cfg.entropy,
            backend=backend,
        ).reshape(L, H, -1)
        errors: list[torch.Tensor | None] = [None] * L
        if first.out is not None and ats.output_error_in_one_launch(
            q.device, first.mask, rows, backend
        ):  # no scores in memory: the layers go as heads of one launch
            err = ats.attention_output_error(
                q, k, stacked("v"), stacked("out"), is_causal=first.is_causal,
                scale=first.scale, backend=backend,
            )  # fmt: skip
            errors = list(err.reshape(L, H, -1))
        elif first.out is not None:
            # the fp32 recomputation materializes scores: layer by layer keeps its memory bound
            errors = [
                ats.attention_output_error(
                    c.q,
                    c.k,
                    c.v,
                    c.out,
                    attn_mask=c.mask,
                    is_causal=c.is_causal,
                    scale=c.scale,
                    rows=rows,
                    backend=backend,
                )
                for c in group
            ]
        for i, c in enumerate(group):
            self._accumulate(c.layer, heads[i], errors[i])

    def _measure_flex(self) -> None:
        frame, self._flex_frame = self._flex_frame, None
        if frame is not None and self._flex_layer is not None:
            self.ctx.guard.run(self.component, self._observe_flex, self._flex_layer, frame.f_locals)

    @torch.no_grad()
    def _observe_flex(self, layer: str, call: Mapping[str, Any]) -> None:
        """An eager flex_attention call, from the locals of its returned frame (``out`` its
        output; absent where it raised: nothing to measure). Its q, k, v and output are the
        user's tensors, read after the call: in training flex_attention's backward keeps them,
        so nothing changes them in place before they are read here.
        Scores as flex computes them: fp32 S with ``score_mod`` and ``mask_mod`` applied (see
        numwatch.probes.flex), in the dtype of its output (the autocast dtype under autocast)."""
        q, k, v, out = (call.get(n) for n in ("query", "key", "value", "out"))
        tensors = (q, k, v, out)
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
            return
        if _transformed(q) or not _measured(out) or k.shape[2] == 0:
            return
        q, k, v, out = (t.detach() for t in tensors)
        if k.shape[0] == 1 < q.shape[0]:  # keys and values shared by the batch
            k, v = k.expand(q.shape[0], *k.shape[1:]), v.expand(q.shape[0], *v.shape[1:])
        if k.shape[0] != q.shape[0] or k.dtype != q.dtype:
            self._unmeasured(
                "flex_inputs", layer, f"q {q.dtype} {tuple(q.shape)}, k {k.dtype} {tuple(k.shape)}"
            )
            return
        dtype = out.dtype  # what flex computed in
        q, k, v = (t.to(dtype) for t in (q, k, v))
        B, Hq, Tq, _ = q.shape
        auto = self.cfg.saturation_dtype == "auto"
        block_mask = call.get("block_mask")
        try:
            modify = flex.score_modify(
                call.get("score_mod"), getattr(block_mask, "mask_mod", None), Hq, k.shape[2],
                q.device,
            )  # fmt: skip
            batch, rows = self._samples(q)
            backend = self.ctx.backend_for(q.device)
            heads = ats.attention_head_stats(
                q, k, scale=call.get("scale"), rows=rows, batch=batch,
                saturation_dtype=dtype if auto else _DTYPES[self.cfg.saturation_dtype],
                entropy=self.cfg.entropy, backend=backend, modify=modify,
            )  # fmt: skip
            errors = None
            if self.cfg.output_error and out.shape[:3] == (B, Hq, Tq):
                errors = ats.attention_output_error(
                    q, k, v, out, scale=call.get("scale"), rows=rows, batch=batch,
                    backend=backend, modify=modify,
                )  # fmt: skip
        except flex.ModFailed as exc:
            self._unmeasured("flex_mods", layer, str(exc))
            return
        self._accumulate(layer, heads, errors)

    def _unmeasured(self, reason: str, layer: str, detail: str) -> None:
        """A sampled attention call the statistics cannot take: counted, said once per reason
        (without it a layer shows no attn_* series, which reads as nothing to see)."""
        self.ctx.attn_unmeasured[reason] += 1
        if reason not in self._told_unmeasured:
            self._told_unmeasured.add(reason)
            log.warning(
                "numwatch: layer %r: %s (%s); its attention is not measured, and "
                "attn_unmeasured_calls_total{reason=%r} counts such calls",
                layer, _UNMEASURED_HINTS[reason], detail, reason,
            )  # fmt: skip

    @torch.no_grad()
    def _observe_mha(self, layer: str, args: tuple, kwargs: dict) -> None:
        """Q and K as nn.MultiheadAttention builds them, in SDPA layout and mask convention:
        with ``add_bias_kv`` a learned key after the sequence, with ``static_k`` the given
        keys, with ``add_zero_attn`` a zero key last, the masks widened to leave them visible
        (F.multi_head_attention_forward's order)."""
        a = _MHA_SIGNATURE.bind(*args, **kwargs).arguments
        H = a["num_heads"]
        query, key = a["query"], a["key"]  # (L, N, E), (S, N, E)
        if not _measured(query):
            return
        E = query.shape[-1]
        if a.get("use_separate_proj_weight"):
            wq, wk = a["q_proj_weight"], a["k_proj_weight"]
        else:
            wq, wk = a["in_proj_weight"][:E], a["in_proj_weight"][E : 2 * E]
        bias = a.get("in_proj_bias")
        bq, bk = (None, None) if bias is None else (bias[:E], bias[E : 2 * E])

        def heads(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            y = F.linear(x, w, b)  # (T, N, E)
            if y.dim() == 2:  # unbatched input
                y = y.unsqueeze(1)
            return y.reshape(y.shape[0], y.shape[1], H, E // H).permute(1, 2, 0, 3)  # (N, H, T, hd)

        q = heads(query, wq, bq)
        N, _, L, hd = q.shape
        static_k = a.get("static_k")
        k = heads(key, wk, bk) if static_k is None else static_k.reshape(N, H, -1, hd)
        extra = []  # keys after the sequence, visible to every query
        if a.get("bias_k") is not None:
            extra.append(a["bias_k"].reshape(1, H, 1, hd).expand(N, -1, -1, -1))
        if a.get("add_zero_attn"):
            extra.append(k.new_zeros(N, H, 1, hd))
        mask, pad = a.get("attn_mask"), a.get("key_padding_mask")
        if extra:
            k = torch.cat([k, *extra], dim=2)
            mask = None if mask is None else F.pad(mask, (0, len(extra)))
            pad = None if pad is None else F.pad(pad, (0, len(extra)))
        S = k.shape[2]
        keep = None  # MHA masks say True = masked; SDPA's say True = keep
        if mask is not None:
            mask = mask.view(N, H, L, S) if mask.dim() == 3 else mask.view(1, 1, L, S)
            keep = ~mask if mask.dtype == torch.bool else mask
        if pad is not None:
            pad = pad.view(N, 1, 1, S)
            pad = ~pad if pad.dtype == torch.bool else pad
            if keep is None:
                keep = pad
            elif keep.dtype == torch.bool and pad.dtype == torch.bool:
                keep = keep & pad
            else:
                keep = _additive(keep, q.dtype) + _additive(pad, q.dtype)
        batch, rows = self._samples(q)
        heads_stats = ats.attention_head_stats(
            q,
            k,
            attn_mask=keep,
            is_causal=bool(a.get("is_causal")) and mask is None,
            rows=rows,
            batch=batch,
            saturation_dtype=self._saturation_dtype(q),
            entropy=self.cfg.entropy,
            backend=self.ctx.backend_for(q.device),
        )
        self._accumulate(layer, heads_stats, None)

    @torch.no_grad()
    def _observe_scores(self, layer: str, scores: torch.Tensor) -> None:
        if not _measured(scores) or scores.shape[-1] == 0:
            return
        batch, rows = self._samples(scores)
        heads = ats.score_head_stats(
            scores.detach(),
            rows=rows,
            batch=batch,
            saturation_dtype=self._saturation_dtype(scores),
            entropy=self.cfg.entropy,
        )
        self._score_layers.add(layer)
        self._accumulate(layer, heads, None)

    def _accumulate(self, layer: str, heads: torch.Tensor, errors: torch.Tensor | None) -> None:
        st = self._stats.get(layer)
        if st is None or st.heads[0].shape != heads.shape or st.heads[0].device != heads.device:
            st = self._stats[layer] = _LayerStats([])  # the layer changed shape: start over
        st.add(heads, errors)

    # ------------------------------------------------------------------ flush
    def device_tensors(self) -> dict[str, torch.Tensor]:
        self._measure_flex()
        if self._held:
            self._measure_held()
        out = {}
        for layer, st in self._stats.items():
            heads = out[f"attn/{layer}/heads"] = merge_heads(st.heads)
            # a device value too: summed over ranks like the heads' counts (a fill, no sync)
            out[f"attn/{layer}/calls"] = torch.full(
                (), float(st.calls), dtype=torch.float64, device=heads.device
            )
            if st.errors:
                out[f"attn/{layer}/errors"] = merge_errors(st.errors)
        return out

    def records(self, host: Mapping[str, torch.Tensor]) -> list[MetricRecord]:
        # After cross-rank aggregation ``host`` also holds layers that ran on other ranks only
        # (a data-dependent branch): their statistics are global, so they are recorded here too.
        seen = {k[len("attn/") : -len("/heads")] for k in host if _is_heads_key(k)}
        others = sorted(seen - set(self._stats))
        out = []
        for layer in [*self._stats, *others]:
            key = f"attn/{layer}/heads"
            if key not in host:
                continue
            calls = host.get(f"attn/{layer}/calls")
            out.append(MetricRecord("attn_calls", {"layer": layer}, float(calls or 0.0)))
            heads = host[key].tolist()
            errors = host.get(f"attn/{layer}/errors")
            errors = errors.tolist() if errors is not None else None
            logits = not (layer in self._score_layers and self._shifted(layer, heads))
            for h, row in enumerate(heads):
                out += _head_records(
                    layer, h, row, errors[h] if errors else None, entropy=self.cfg.entropy,
                    logits=logits,
                )  # fmt: skip
        return out

    def _shifted(self, layer: str, heads: list[list[float]]) -> bool:
        """Whether a layer's softmax input has its maximum at exactly 0 in every sampled row:
        eager attention that subtracts the row maximum before the softmax (GPT-OSS, for its
        sinks). Its "logits" are then S - max(S): attn_max_logit read 0 whatever the logits
        did, and the logit rules could never fire. They are left out, said once per layer (a
        layer whose logits all are 0, a zero-initialized W_q, reads the same)."""
        rows = sum(row[ats.ROWS] for row in heads)
        if not rows or any(row[ats.ROWS] and row[ats.MAX_LOGIT] != 0.0 for row in heads):
            return False
        if layer not in self._shifted_layers:
            self._shifted_layers.add(layer)
            log.warning(
                "numwatch: layer %r: the softmax input's maximum is 0 in every row, as where a "
                "model subtracts the row maximum before the softmax (eager GPT-OSS): its "
                "attn_max_logit and attn_min_logit would not be logits, and are left out",
                layer,
            )
        return True

    def reset(self) -> None:
        self._stats.clear()


def _is_heads_key(key: str) -> bool:
    return key.startswith("attn/") and key.endswith("/heads")


def _fold_batch_dims(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Any, mask: torch.Tensor | None, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, torch.Tensor | None]:
    """A (B, ..., H, T, D) call (windowed attention: B, windows, H, T, D) as the 4-D call of its
    first n batch elements, each with all of its windows: the leading dims broadcast as SDPA
    broadcasts them, then fold into one. Copies of the sampled elements only."""
    lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    lead = (min(n, lead[0]), *lead[1:])

    def fold(t: torch.Tensor) -> torch.Tensor:  # a tensor of fewer dims has no batch dim
        return fold_batch_dims(t[:n] if t.dim() == len(lead) + 3 else t, lead)

    out = fold(out) if isinstance(out, torch.Tensor) else out
    return fold(q), fold(k), fold(v), out, None if mask is None or mask.dim() < 4 else fold(mask)


def _broadcast_like_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch dim of 1 (K/V shared by the batch), or one query head against several K/V heads,
    broadcast as SDPA broadcasts them: expanded views (the held copies are of sampled rows)."""
    B = max(q.shape[0], k.shape[0], v.shape[0])
    Hq, Hk = q.shape[1], k.shape[1]
    if Hq == 1 < Hk:
        q = q.expand(B, Hk, *q.shape[2:])
    if v.shape[1] == 1 < Hk:
        v = v.expand(B, Hk, *v.shape[2:])
    return tuple(t.expand(B, *t.shape[1:]) for t in (q, k, v))  # type: ignore[return-value]


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _transformed(t: Any) -> bool:
    """A tensor of a torch.func transform (vmap, grad: per-sample gradients through the model):
    the transform's own. Its batched values escape the transform if held for the flush (vmap
    asserts there), and its call is not the step's training forward: left out."""
    return isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t)


def _measured(x: torch.Tensor) -> bool:
    """Whether attention in x's dtype is measured: the statistics are defined for bf16, fp16
    and fp32 attention (fp32 scores, their thresholds); float64 attention is left unmeasured
    rather than measured after rounding to fp32."""
    return x.dtype in _DTYPES.values()


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)


def _head_records(
    layer: str,
    head: int,
    row: list[float],
    err: list[float] | None,
    *,
    entropy: bool,
    logits: bool = True,
) -> list[MetricRecord]:
    labels = {"layer": layer, "head": str(head)}
    n = row[ats.ROWS]
    values = {
        "attn_rows": n,
        "attn_repeated_max_rows": row[ats.REPEATED_MAX_ROWS],
        "attn_tie_entries": row[ats.TIE_ENTRIES],
        "attn_saturated_rows": row[ats.SATURATED_ROWS],
        "attn_saturated_entries": row[ats.SATURATED_ENTRIES],
        "attn_repeated_max_fraction": row[ats.REPEATED_MAX_ROWS] / n if n else 0.0,
        "attn_saturated_fraction": row[ats.SATURATED_ROWS] / n if n else 0.0,
    }
    if logits:
        values["attn_max_logit"] = row[ats.MAX_LOGIT]
        values["attn_min_logit"] = row[ats.MIN_LOGIT]
    if entropy:
        values["attn_entropy_mean"] = row[ats.ENTROPY_SUM] / n if n else math.nan
        values["attn_entropy_min"] = row[ats.ENTROPY_MIN]
    if err is not None:
        abs_sum, count = err[ats.ERR_ABS_SUM], err[ats.ERR_COUNT]
        values["attn_output_bias"] = err[ats.ERR_SUM] / abs_sum if abs_sum else 0.0
        systematic = err[ats.ERR_EXCESS_COHERENT_SUM]
        values["attn_output_systematic_error"] = systematic / abs_sum if abs_sum else 0.0
        values["attn_output_error_rms"] = math.sqrt(err[ats.ERR_SQ_SUM] / count) if count else 0.0
    return [MetricRecord(name, labels, v) for name, v in values.items()]
