"""Weight probe: spectral norms of 2-D weights and of each attention head's W_Q and W_K.

The spectral norm of W_Q (per head) is what grew before the blow-up in arXiv 2510.04212, and
sigma(W_Q^h) * sigma(W_K^h) / sqrt(head_dim) bounds head h's logits for unit-norm inputs.
Warm-started power iteration (numwatch.kernels.power_iteration) refines the estimates a little
at every sampled step instead of paying for an SVD.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping

import torch
from torch import nn

from numwatch.config import WeightsConfig
from numwatch.distributed import ShardedPowerIteration, is_dtensor, weight_blocks
from numwatch.kernels.host_copy import to_device
from numwatch.kernels.power_iteration import WARMUP_ITERS, PowerIteration, qk_logit_bound
from numwatch.probes.base import ProbeContext, gathering_device
from numwatch.probes.qk_layout import QKLayout, find_qk_layout, reads_parameters
from numwatch.selection import _warn_unmatched, matches, parameter_state, select_parameters
from numwatch.snapshot import MetricRecord

log = logging.getLogger("numwatch")

__all__ = ["WeightProbe"]


def _measurable(w: torch.Tensor) -> bool:
    """A weight power iteration can read: floating, with values, strided. Others (an int8
    frozen base weight, a pruned Linear(d, 0)) are left out one by one."""
    return w.layout is torch.strided and w.is_floating_point() and w.numel() > 0


def _embedding_tables(model: nn.Module) -> set[int]:
    """ids of the weights of the model's embedding modules (chosen by type: names such as
    T5's ``shared`` say nothing, and globs like ``*tok*`` also caught ``token_mixer``)."""
    kinds = (nn.Embedding, nn.EmbeddingBag)
    return {id(m.weight) for m in model.modules() if isinstance(m, kinds)}


def _first_names(names: list[str]) -> str:
    """The first three of the names a warning leaves out."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _computed_weights(model: nn.Module) -> dict[int, str]:
    """ids of the parameters that a weight is computed from, each with that weight's name:
    the originals of torch.nn.utils.parametrize (weight_norm, spectral_norm, orthogonal), of
    the older hook-based weight_norm and spectral_norm, and of torch.nn.utils.prune (``weight =
    weight_orig * weight_mask`` at each forward). Their norms are not the weight's (a
    weight_norm magnitude is an (out, 1) column; a spectral_norm original is the weight before
    its division by sigma; a pruned original still holds the pruned entries), and reading the
    weight itself runs the parametrization, which spectral_norm's updates its own state by:
    they are left out."""
    from torch.nn.utils.parametrize import ParametrizationList
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    out: dict[int, str] = {}
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        plists = getattr(module, "parametrizations", None)
        if isinstance(plists, nn.ModuleDict):
            for name, plist in plists.items():
                if isinstance(plist, ParametrizationList):
                    out |= dict.fromkeys(map(id, plist.parameters()), prefix + name)
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, BasePruningMethod):  # the pruned tensor's name, a suffix
                name, suffixes = hook._tensor_name, ("_orig",)
            else:
                name = getattr(hook, "name", "")
                suffixes = {WeightNorm: ("_g", "_v"), SpectralNorm: ("_orig",)}.get(type(hook), ())
            for suffix in suffixes:
                source = getattr(module, name + suffix, None)
                if isinstance(source, nn.Parameter):
                    out[id(source)] = prefix + name
    return out


class WeightProbe:
    component = "weights"

    def __init__(
        self, model: nn.Module, cfg: WeightsConfig, ctx: ProbeContext, aggregate: bool = True
    ) -> None:
        """``aggregate``: collectives are allowed (distributed.aggregate); without them the
        sharded (FSDP2) weights, whose norms take an all-reduce per iteration, are left out."""
        self.cfg = cfg
        self.ctx = ctx
        self.model = model
        self._aggregate = aggregate
        self._pi: dict[torch.device, PowerIteration] = {}
        self._sigma: torch.Tensor | None = None  # (N,) float32, latest estimates
        self._age: torch.Tensor | None = None  # (N,) float32, PowerIteration.age of each
        self._fresh = False  # estimated since the last flush: only then are they reported
        self._meta_said: set[str] = set()  # meta weights already warned about
        self._select()

    def _select(self) -> None:
        """Choose the weights and attention layers, and what reads them. Again at a sampled
        step after the model's parameters changed (a module replaced after attach, or weights
        unfrozen or frozen: gradual unfreezing), before the weights are read: a Parameter kept
        from before would be reported under the name of its replacement."""
        model, cfg = self.model, self.cfg
        self._param_ids = parameter_state(model)
        tables = set() if cfg.embeddings else _embedding_tables(model)
        computed = _computed_weights(model)
        self.params = [
            (name, p)
            for name, p in select_parameters(model, cfg.params, cfg.exclude, "weights.params")
            if p.dim() == 2 and _measurable(p) and id(p) not in tables
        ]
        left_out = sorted({computed[id(p)] for _, p in self.params if id(p) in computed})
        if left_out:
            log.warning(
                "numwatch: weights: %d weight(s) computed from parametrizations or pruning "
                "masks are left out (%s): their originals' norms are not the weight's, and "
                "reading the weight would run the parametrization",
                len(left_out),
                _first_names(left_out),
            )
            self.params = [(name, p) for name, p in self.params if id(p) not in computed]
        self.layers: list[tuple[str, QKLayout]] = []
        if cfg.attention_heads:
            _warn_unmatched("weights.layers", cfg.layers, [n for n, _ in model.named_modules()])
            for name, module in model.named_modules():
                if name and matches(name, cfg.layers):
                    layout = find_qk_layout(module)
                    if layout is not None and not reads_parameters(module, layout):
                        log.warning(
                            "numwatch: the Q/K weights of %r are computed from "
                            "parametrizations: its per-head spectral norms are not measured",
                            name,
                        )
                    elif layout is not None and all(
                        _measurable(h.weight) for h in (layout.q[0], layout.k[0])
                    ):
                        self.layers.append((name, layout))
        if not self._aggregate:
            self._drop_sharded()
        # a layout whose heads interleave with other rows has no sharded block (MatrixBlock
        # splits a contiguous row range into heads)
        self.layers = [
            (name, lay) for name, lay in self.layers
            if not (_interleaved(lay) and is_dtensor(lay.q[0].weight))
        ]  # fmt: skip
        # FSDP2 (DTensor) weights: norms from the local shards, never gathered (distributed.py)
        self._blocks = weight_blocks(self.params, self.layers)
        self._sharded = ShardedPowerIteration(cfg.iters) if self._blocks else None
        # the weights whose storage the matrices view: the views are rebuilt when one moves
        self._sources = [p for _, p in self.params] + [
            h.weight for _, layout in self.layers for h in (layout.q[0], layout.k[0])
        ]
        self._views_key: tuple[int, ...] | None = None
        # the matrices by device, each group run by that device's power iteration, and where
        # the groups' concatenated estimates go back to the model's order (None: one group), on
        # the device that gathers them
        self._groups: list[tuple[torch.device, list[torch.Tensor]]] = []
        self._order: torch.Tensor | None = None
        # per matrix (each weight, then each layer's q and k heads): whether it has values
        self._present = [True] * (len(self.params) + 2 * len(self.layers))

    def _drop_sharded(self) -> None:
        sharded = [n for n, p in self.params if is_dtensor(p)]
        sharded += [n for n, lay in self.layers if is_dtensor(lay.q[0].weight)]
        if sharded:
            log.warning(
                "numwatch: weights: %d sharded (FSDP2) weights or layers are left out (%s): "
                "their spectral norms take an all-reduce across ranks, which "
                "distributed.aggregate=false rules out",
                len(sharded),
                _first_names(sharded),
            )
        self.params = [(n, p) for n, p in self.params if not is_dtensor(p)]
        self.layers = [(n, lay) for n, lay in self.layers if not is_dtensor(lay.q[0].weight)]

    def attach(self) -> None:
        """Nothing to hook: the probe reads the weights at step time."""

    def detach(self) -> None:
        """Nothing to remove."""

    def _matrix_groups(self) -> list[tuple[torch.device, list[torch.Tensor]]]:
        """The matrices by device (empty: nothing to measure yet), as views built and checked
        once per placement of the weights: building the head views every step cost more host
        time than the power iteration's launches. A model split over devices (pipeline stages,
        ``device_map``) gets one group per device, in order of first appearance."""
        key = tuple(map(torch.Tensor.data_ptr, self._sources))
        if key != self._views_key:
            out: list[torch.Tensor] = [p for _, p in self.params]
            for _, layout in self.layers:
                out += [layout.views("q"), layout.views("k")]
            # a meta weight (a model not yet materialized, a module offloaded to disk) has no
            # values: it alone is left out
            self._present = [not m.is_meta for m in out]
            names = [n for n, _ in self.params] + [n for n, _ in self.layers for _ in "qk"]
            meta = sorted({n for n, ok in zip(names, self._present, strict=True) if not ok})
            meta = [n for n in meta if n not in self._meta_said]
            self._meta_said.update(meta)
            if meta:
                log.warning(
                    "numwatch: weights: %d weight(s) or layer(s) on the meta device are not "
                    "measured (%s): they hold no values",
                    len(meta),
                    _first_names(meta),
                )
            groups: dict[torch.device, list[int]] = {}
            for i, m in enumerate(out):
                if self._present[i]:
                    groups.setdefault(m.device, []).append(i)
            self._groups = [(d, [out[i] for i in idx]) for d, idx in groups.items()]
            self._order = None
            if len(groups) > 1:
                # a 2-D weight has one estimate, a stack of head views one per head
                sizes = [1 if m.dim() == 2 else m.shape[0] for m in out]
                starts = list(itertools.accumulate(sizes, initial=0))
                # the model-order position of each estimate, in the groups' order (left-out
                # matrices leave gaps, which the argsort closes)
                concat = [
                    j for idx in groups.values() for i in idx for j in range(*starts[i : i + 2])
                ]
                target = gathering_device(groups)
                self._order = to_device(concat, torch.long, target).argsort()
            self._views_key = key
        return self._groups

    @torch.no_grad()
    def on_step(self) -> None:
        if self.ctx.step % self.cfg.every:
            return
        if parameter_state(self.model) != self._param_ids:  # host-side only
            self._select()
            self._pi.clear()
        self._fresh = True
        if self._sharded is not None:
            self._sigma, self._age = self._sharded.step(self._blocks), None
            return
        groups = self._matrix_groups()
        if len(self._pi) > len(groups):  # a device the model left: its iteration holds old views
            self._pi = {d: pi for d, pi in self._pi.items() if any(d == g for g, _ in groups)}
        sigmas, ages = [], []
        for device, matrices in groups:
            pi = self._pi.get(device)
            if pi is None:
                pi = self._pi[device] = PowerIteration(
                    iters=self.cfg.iters, backend=self.ctx.backend_for(device)
                )
            sigmas.append(pi.step(matrices))
            ages.append(pi.age)
        self._sigma, self._age = self._model_order(sigmas), self._model_order(ages)

    def _model_order(self, parts: list[torch.Tensor]) -> torch.Tensor | None:
        """The groups' ``(n_i,)`` tensors as one in model order (None: no group, every matrix
        on the meta device); of several devices gathered without a host sync."""
        if self._order is None:
            return parts[0] if parts else None
        target = self._order.device
        gathered = torch.cat([t.to(target, non_blocking=True) for t in parts])
        return gathered.index_select(0, self._order)

    def device_tensors(self) -> dict[str, torch.Tensor]:
        # A flush without a new estimate reports none: rules count observations, and the
        # same value repeated would satisfy "for N flushes" from one measurement.
        if not self._fresh or self._sigma is None:
            return {}
        age = {} if self._age is None else {"weights/age": self._age}
        return {"weights/sigma": self._sigma, **age}

    def records(self, host: Mapping[str, torch.Tensor]) -> list[MetricRecord]:
        if "weights/sigma" not in host:
            return []
        sigma = host["weights/sigma"].tolist()
        # An estimate restarted since its weight read 0 or NaN (a zero-initialized weight that
        # starts to train, a recovery from a NaN) is a lower bound still rising at one iteration
        # a step: it is not reported, and the next step warms up, as the first one did.
        ages = (
            host["weights/age"].tolist() if "weights/age" in host else [WARMUP_ITERS] * len(sigma)
        )
        rising = [0 < a < WARMUP_ITERS for a in ages]
        if any(rising):
            for pi in self._pi.values():
                pi.warm_up()
        values = iter(None if r else v for v, r in zip(sigma, rising, strict=True))
        present = iter(self._present)

        def take(n: int) -> list[float | None] | None:
            """The next matrix's ``n`` estimates (None: rising); None for one left out."""
            return [next(values) for _ in range(n)] if next(present) else None

        out = [
            MetricRecord("weight_spectral_norm", {"param": name}, est[0])
            for name, _ in self.params
            if (est := take(1)) is not None and est[0] is not None
        ]
        for layer, layout in self.layers:
            sq, sk = take(len(layout.q)), take(len(layout.k))
            if sq is None or sk is None:
                continue
            nq, nk = len(sq), len(sk)
            head_dim = layout.q[0].stop - layout.q[0].start
            for h in range(nq):
                labels = {"layer": layer, "head": str(h)}
                q, k = sq[h], sk[h // (nq // nk)]
                if q is not None:
                    out.append(MetricRecord("attn_q_spectral_norm", labels, q))
                if k is not None:
                    out.append(MetricRecord("attn_k_spectral_norm", labels, k))
                if q is not None and k is not None and not layout.qk_norm:
                    bound = qk_logit_bound(q, k, head_dim**-0.5)  # after a QK-norm: no bound
                    out.append(MetricRecord("attn_qk_logit_bound", labels, bound))
        return out

    def reset(self) -> None:
        """Estimates are kept: they are the state the next step warm-starts from."""
        self._fresh = False


def _interleaved(layout: QKLayout) -> bool:
    """Heads not one after another (GPT-BigCode's [q | k | v] per head)."""
    heads = layout.q
    return len(heads) > 1 and heads[1].start - heads[0].start != heads[0].stop - heads[0].start
