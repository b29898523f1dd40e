"""Where an attention layer keeps each head's query and key projection rows.

Shared by the per-head spectral norms (weights probe) and QK-clip (actions): both need the rows
of W_q and W_k that produce head h, whatever the model calls them. Known layouts: separate
``q_proj``/``k_proj`` Linears (Llama, Mistral, most of transformers; Qwen3-Next's and Qwen3.5's
gated ``q_proj`` of [query | gate] rows per head), one fused Linear
``qkv``/``c_attn``/``Wqkv`` of 3*d outputs (nanoGPT), GPT-2's transposed Conv1D ``c_attn``,
GPT-BigCode's per-head ``[q | k | v]`` ``c_attn``, BERT's ``query``/``key`` and T5's ``q``/``k``,
and ``nn.MultiheadAttention``'s ``in_proj_weight`` or separate ``q/k_proj_weight``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger("numwatch")

__all__ = ["HeadSlice", "QKLayout", "find_qk_layout", "reads_parameters"]


@dataclass(frozen=True)
class HeadSlice:
    """Rows [start, stop) of a projection along ``dim`` (0 = Linear rows, 1 = Conv1D columns)."""

    weight: nn.Parameter
    bias: torch.Tensor | None  # a Parameter, or a view of one (a [q | k | v] bias)
    dim: int
    start: int
    stop: int

    def views(self) -> list[torch.Tensor]:
        """The head's weight rows (columns for Conv1D) and bias entries, as views."""
        w = self.weight.narrow(self.dim, self.start, self.stop - self.start)
        return [w] if self.bias is None else [w, self.bias[self.start : self.stop]]

    def matrix(self) -> torch.Tensor:
        """The head's projection as a (head_dim, d_model) view."""
        w = self.views()[0]
        return w if self.dim == 0 else w.t()

    def local_views(self) -> list[torch.Tensor]:
        """``views()`` of the elements this process holds, to write in place: of an FSDP2 weight
        (a DTensor sharded on dim 0), the head's rows in the local shard (every rank writes its
        own), where narrowing the DTensor makes a redistributed copy and a write is lost."""
        from numwatch.distributed import is_dtensor

        if not is_dtensor(self.weight):
            return self.views()
        out = [_local_part(self.weight, self.dim, self.start, self.stop)]
        if self.bias is not None:
            out.append(_local_part(self.bias, 0, self.start, self.stop))
        return out

    @torch.no_grad()
    def scale_(self, factor: float) -> None:
        for view in self.local_views():
            view.mul_(factor)


def _local_part(t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) along ``dim`` of a DTensor's local shard (rows sharded on dim 0,
    as ``distributed._local_rows`` reads them), as a view; empty where none are here."""
    from numwatch.distributed import _local_rows

    local, lo, _ = _local_rows(t)
    if dim != 0:  # every rank holds all columns of its rows
        return local.narrow(dim, start, stop - start)
    first, last = max(lo, start), min(lo + local.shape[0], stop)
    return local.narrow(0, first - lo, max(last - first, 0)) if last > first else local[:0]


@dataclass(frozen=True)
class QKLayout:
    q: list[HeadSlice]  # one per query head
    k: list[HeadSlice]  # one per key/value head
    # A norm of q and k per head after the projections (QK-norm: Qwen3, Gemma 3, OLMo 2): it
    # undoes any rescale of W_q/W_k, so sigma_q sigma_k / sqrt(d) bounds no logit and QK-clip
    # cannot clip one.
    qk_norm: bool = False

    def views(self, side: str) -> torch.Tensor:
        """All heads of one side ('q' or 'k') as one strided (heads, head_dim, d) or
        (heads, d, head_dim) view, the batch ``PowerIteration`` takes. A view of the weight's
        detached alias: a view of the Parameter itself holds a reference to it, and
        torch.utils.swap_tensors (``model.to``, ``load_state_dict``) refuses a Parameter
        referenced elsewhere."""
        from numwatch.kernels.power_iteration import head_views

        heads = self.q if side == "q" else self.k
        first = heads[0]
        hd = first.stop - first.start
        stride = heads[1].start - first.start if len(heads) > 1 else hd
        weight = first.weight.detach()
        if stride != hd:  # heads interleaved with other rows (GPT-BigCode: [q | k | v] per head)
            w, (s0, s1) = weight, weight.stride()
            step = s0 if first.dim == 0 else s1
            size = (len(heads), hd, w.shape[1]) if first.dim == 0 else (len(heads), w.shape[0], hd)
            inner = (s0, s1)
            return w.as_strided(
                size, (stride * step, *inner), w.storage_offset() + first.start * step
            )
        block = weight.narrow(first.dim, first.start, heads[-1].stop - first.start)
        return head_views(block, len(heads), out_dim=first.dim)

    def k_for(self, q_head: int) -> HeadSlice:
        """The key head that query head ``q_head`` attends with (GQA/MQA groups)."""
        return self.k[q_head // (len(self.q) // len(self.k))]


# Names of the key/value head count (HF, Meta, gemma_pytorch, litgpt).
_KV_HEAD_NAMES = (
    "num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_query_groups", "kv_heads",
)  # fmt: skip
# Gated attention (Qwen3-Next, Qwen3.5): q_proj holds [query | gate] rows per head, the output
# gate after the attention.
_GATED_Q = ("Qwen3NextAttention", "Qwen3_5Attention", "Qwen3_5MoeAttention")
# Children that normalize q and k per head after the projections (QK-norm).
_QK_NORM_NAMES = ("q_norm", "k_norm", "qk_norm", "q_layernorm", "k_layernorm",
                  "query_layernorm", "key_layernorm", "q_ln", "k_ln")  # fmt: skip


def _heads_of(module: nn.Module) -> tuple[int | None, int | None]:
    cfg = getattr(module, "config", None)
    for owner in (module, cfg):
        if owner is None:
            continue
        for name in ("num_heads", "n_heads", "n_head", "num_attention_heads"):
            h = getattr(owner, name, None)
            if isinstance(h, int):
                kv = next(
                    (
                        getattr(owner, n)
                        for n in _KV_HEAD_NAMES
                        if isinstance(getattr(owner, n, None), int)
                    ),
                    None,
                )
                return h, kv if kv else h
    return None, None


def _slices(weight: nn.Parameter, bias: torch.Tensor | None, dim: int, offset: int, heads: int,
            head_dim: int) -> list[HeadSlice]:  # fmt: skip
    return [
        HeadSlice(weight, bias, dim, offset + h * head_dim, offset + (h + 1) * head_dim)
        for h in range(heads)
    ]


def find_qk_layout(module: nn.Module, n_heads: int | None = None) -> QKLayout | None:
    """The QK layout of an attention module, or None if it is not a known one.

    ``n_heads`` overrides what the module's attributes (num_heads, n_head, config...) say.
    Projections that do not split into whole heads (none at all, or a remainder; key heads
    that do not divide the query heads) are not a known layout: their slices would be wrong.
    """
    layout = _find(module, n_heads)
    if layout is not None and any(_normalizes(getattr(module, n, None)) for n in _QK_NORM_NAMES):
        return QKLayout(layout.q, layout.k, qk_norm=True)
    return layout


def reads_parameters(module: nn.Module, layout: QKLayout) -> bool:
    """Whether the layout's Q and K weights are the module's own parameters. A parametrized
    projection (torch.nn.utils.parametrize: weight_norm, spectral_norm, orthogonal; or the
    older hook-based weight_norm) computes ``.weight`` from other tensors: a layout of that
    tensor would read a copy frozen when it was found, and a rescale of it would move
    nothing."""
    params = {id(p) for p in module.parameters()}
    return all(id(h.weight) in params for h in (layout.q[0], layout.k[0]))


def _normalizes(child: object) -> bool:
    """A module under a QK-norm name that does something: models with QK-norm off keep an
    ``nn.Identity`` (or None) there."""
    return isinstance(child, nn.Module) and not isinstance(child, nn.Identity)


def _find(module: nn.Module, n_heads: int | None) -> QKLayout | None:
    heads, kv_heads = _heads_of(module)
    heads = n_heads or heads
    kv_heads = kv_heads if n_heads is None else n_heads
    if not heads:
        return None
    if type(module).__name__.startswith("CodeGen"):  # (mp, [q | v | k]) blocks in its qkv_proj
        return None
    for q_name, k_name in (("q_proj", "k_proj"), ("query", "key"), ("q", "k")):  # HF, BERT, T5
        q_proj, k_proj = getattr(module, q_name, None), getattr(module, k_name, None)
        if isinstance(q_proj, nn.Linear) and isinstance(k_proj, nn.Linear):
            break
    if isinstance(q_proj, nn.Linear) and isinstance(k_proj, nn.Linear):
        rows = q_proj.out_features // heads  # q_proj rows per query head
        parts = 2 if type(module).__name__ in _GATED_Q else 1
        hd = rows // parts
        if _wrong_head_dim(module, hd):
            log.warning(
                "numwatch: the q_proj of a %s has %d rows per head and its head_dim is %d (a "
                "gate or other rows in the projection?): its per-head Q/K layout is unknown, no "
                "per-head norms are measured or clipped",
                type(module).__name__,
                rows,
                module.head_dim,
            )
            return None
        kvh = k_proj.out_features // hd if hd else 0
        whole = rows * heads == q_proj.out_features and hd * parts == rows
        if not kvh or not whole or hd * kvh != k_proj.out_features or heads % kvh:
            return None
        w, b = q_proj.weight, q_proj.bias
        return QKLayout(
            [HeadSlice(w, b, 0, rows * h, rows * h + hd) for h in range(heads)],
            _slices(k_proj.weight, k_proj.bias, 0, 0, kvh, hd),
        )
    if isinstance(module, nn.MultiheadAttention):
        d = module.embed_dim
        hd = d // heads
        if module.in_proj_weight is not None:
            w, b = module.in_proj_weight, module.in_proj_bias
            return QKLayout(_slices(w, b, 0, 0, heads, hd), _slices(w, b, 0, d, heads, hd))
        b = module.in_proj_bias  # kdim/vdim != embed_dim: two weights, one [q | k | v] bias
        return QKLayout(
            _slices(module.q_proj_weight, None if b is None else b[:d], 0, 0, heads, hd),
            _slices(module.k_proj_weight, None if b is None else b[d : 2 * d], 0, 0, heads, hd),
        )
    cross_q = getattr(module, "q_attn", None)  # GPT-2 cross-attention: q apart, c_attn = [k | v]
    if isinstance(cross_q, nn.Linear):  # GPT-BigCode's: its c_attn splits otherwise
        return None
    if cross_q is not None and isinstance(getattr(cross_q, "weight", None), nn.Parameter):
        kv = getattr(module, "c_attn", None)
        hd = cross_q.weight.shape[1] // heads
        if kv is None or hd * heads != cross_q.weight.shape[1] or _wrong_head_dim(module, hd):
            return None
        return QKLayout(
            _slices(cross_q.weight, cross_q.bias, 1, 0, heads, hd),
            _slices(kv.weight, kv.bias, 1, 0, heads, hd),
        )
    fused = getattr(module, "c_attn", None)
    if getattr(module, "multi_query", None) is False and isinstance(fused, nn.Linear):
        # GPT-BigCode without MQA: c_attn's output is viewed (heads, 3 * head_dim), [q | k | v]
        # per head
        hd = fused.out_features // (3 * heads)
        if not hd or 3 * hd * heads != fused.out_features or _wrong_head_dim(module, hd):
            return None
        w, b = fused.weight, fused.bias
        return QKLayout(
            [HeadSlice(w, b, 0, 3 * hd * h, 3 * hd * h + hd) for h in range(heads)],
            [HeadSlice(w, b, 0, 3 * hd * h + hd, 3 * hd * h + 2 * hd) for h in range(heads)],
        )
    for name in ("qkv", "c_attn", "Wqkv", "qkv_proj"):  # [q heads | k heads | v heads] layout
        fused = getattr(module, name, None)
        if fused is None:
            continue
        weight = getattr(fused, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            continue
        bias = getattr(fused, "bias", None)
        kvh = kv_heads or heads
        dim = _output_dim(module, fused, weight, heads + 2 * kvh)
        if dim is None:
            continue
        out = weight.shape[dim]
        hd = out // (heads + 2 * kvh)
        if not hd or heads % kvh or hd * (heads + 2 * kvh) != out or _wrong_head_dim(module, hd):
            continue
        return QKLayout(
            _slices(weight, bias, dim, 0, heads, hd),
            _slices(weight, bias, dim, heads * hd, kvh, hd),
        )
    return None


def _output_dim(module: nn.Module, proj: nn.Module, weight: torch.Tensor, parts: int) -> int | None:
    """The dim of a fused projection's weight that holds its outputs: 0 for ``nn.Linear``'s
    (out, in), 1 for GPT-2's ``Conv1D`` (in, out). Told by the module that owns the weight (an
    adapter such as LoRA wraps a Linear and shows its weight as its own), else by the one dim
    that splits into ``parts`` whole heads; None, with a warning, when neither tells: slicing
    the wrong dim gives every head a wrong norm and QK-clip would scale the wrong entries."""
    owner = next((m for m in proj.modules() if m._parameters.get("weight") is weight), None)
    if isinstance(owner, nn.Linear):
        return 0
    if type(owner).__name__ == "Conv1D" and getattr(owner, "nf", None) == weight.shape[1]:
        return 1
    fits = [
        d for d in (0, 1)
        if weight.shape[d] % parts == 0 and not _wrong_head_dim(module, weight.shape[d] // parts)
    ]  # fmt: skip
    if len(fits) == 1:
        return fits[0]
    if fits:
        log.warning(
            "numwatch: the fused Q/K/V weight %s of a %s (%s) splits into heads along both dims: "
            "its per-head Q/K layout is unknown, no per-head norms are measured or clipped",
            tuple(weight.shape),
            type(module).__name__,
            type(proj).__name__,
        )
    return None


def _wrong_head_dim(module: nn.Module, hd: int) -> bool:
    """The module states its head dim and ``hd`` is another: the slicing assumed a wrong layout
    (key heads under a name not known here, a projection of other parts)."""
    stated = getattr(module, "head_dim", None)
    return isinstance(stated, int) and stated != hd
