"""Prometheus exporter: the latest flushed snapshot, over HTTP and through a private registry.

The training thread only hands over a reference to the flushed ``Snapshot`` (host floats; the
monitor never changes one after the flush) and the events' counts; the HTTP thread turns it into
metric families and renders the text exposition on the first scrape after a flush, and serves
those bytes until the next flush. Nothing here touches a tensor, so a scrape never waits for,
or synchronizes with, the device. The same families are a ``Collector`` on the private
``PrometheusSink.registry`` (never the global one) for other ways of exposing them. What stays
the same from flush to flush (record order, head grouping, label text) is kept and only checked,
so a first scrape mostly reduces heads and formats values (bench/bench_scrape.py).

Exposition (README, 'Prometheus'): every snapshot metric ``m`` becomes ``numwatch_m``; names
ending in ``_total`` are counters, everything else a gauge (window values: the last flush's).
Per-head attention series (records with a ``head`` label) are reduced by default to one series
per layer holding the worst head's value, plus ``numwatch_worst_head{layer, metric}``, the index
of that head; ``heads="top_k"`` keeps the k worst heads of each layer, ``heads="all"`` every head.
"""

from __future__ import annotations

import errno
import fnmatch
import gc
import heapq
import logging
import math
import os
import re
import socket
import threading
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain, groupby, repeat
from operator import itemgetter
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, Literal, NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from numwatch.errors import NumwatchError
from numwatch.events import Event
from numwatch.snapshot import MetricRecord, Snapshot, series_key

if TYPE_CHECKING:
    from numwatch.config import PrometheusSinkConfig

__all__ = [
    "DOCUMENTED_METRICS",
    "HEAD_REDUCTIONS",
    "PrometheusSink",
    "SnapshotCollector",
    "metric_help",
]

PREFIX = "numwatch_"
_log = logging.getLogger("numwatch")
HeadMode = Literal["layer", "top_k", "all"]

# How the heads of one layer reduce to the layer's series: the value of the worst head, where
# "worst" is the largest value ("max"), the smallest ("min") or the largest magnitude, sign kept
# ("absmax"). Per-head metrics not listed here reduce with "max". A NaN head is always the
# worst: it means non-finite inputs.
HEAD_REDUCTIONS: dict[str, str] = {
    "attn_rows": "max",
    "attn_repeated_max_rows": "max",
    "attn_repeated_max_fraction": "max",
    "attn_tie_entries": "max",
    "attn_saturated_rows": "max",
    "attn_saturated_fraction": "max",
    "attn_saturated_entries": "max",
    "attn_max_logit": "max",
    "attn_min_logit": "min",
    "attn_entropy_mean": "min",
    "attn_entropy_min": "min",
    "attn_output_bias": "absmax",
    "attn_output_systematic_error": "max",
    "attn_output_error_rms": "max",
    "attn_q_spectral_norm": "max",
    "attn_k_spectral_norm": "max",
    "attn_qk_logit_bound": "max",
}
# Every head of a layer sees the same rows: a worst head would be arbitrary.
_NO_WORST_HEAD = frozenset({"attn_rows"})

_TENSOR_STATS = {
    "numel": "elements observed in the flush window",
    "absmax": "largest |value| of the finite elements",
    "min": "smallest finite element",
    "max": "largest finite element",
    "mean": "mean of the finite elements",
    "rms": "root mean square of the finite elements",
    "nan": "NaN elements",
    "posinf": "+Inf elements",
    "neginf": "-Inf elements",
    "nonfinite": "NaN and Inf elements",
    "zeros": "elements exactly zero",
    "zero_fraction": "fraction of elements exactly zero",
    "subnormal": "elements subnormal in the tensor's dtype",
    "underflow_fraction": "fraction of non-zero finite elements below the smallest normal of "
    "underflow_dtype",
    "headroom": "absmax over the largest finite value of the dtype (1 = at overflow)",
}
_HELP = {
    "grad_norm": "Global L2 norm of the last step's gradients (NaN if any element is non-finite).",
    "grad_norm_max": "Largest global gradient L2 norm of the flush window.",
    "loss": "Last loss passed to Monitor.step().",
    "loss_max": "Largest loss of the flush window's steps (of any rank's).",
    "loss_mean": "Mean loss of the flush window's steps.",
    "step_seconds": "Wall time per training step over the flush window.",
    "monitor_overhead_seconds": "Host time per step spent in numwatch over the flush window.",
    "monitor_errors_total": "Failures of components since the monitor was made (training goes on).",
    "attn_calls": "Attention calls measured in the flush window.",
    "attn_kernel_stabilized": "Share of the layer's calls in the step that ran the stabilized "
    "kernel (0: native, or every call fell back to SDPA).",
    "attn_kernel_mode": "For the numwatch kernel mode a routed layer runs (label mode), the share "
    "of its calls in the step that ran it.",
    "attn_kernel_fallbacks_total": "Calls routed to numwatch's kernel that fell back to SDPA.",
    "attn_unmeasured_calls_total": "Sampled attention calls the probe could not measure.",
    "attn_rows": "Softmax rows measured (sampled, not fully masked).",
    "attn_repeated_max_rows": "Rows whose maximum logit is attained at least twice.",
    "attn_repeated_max_fraction": "attn_repeated_max_rows / attn_rows.",
    "attn_tie_entries": "Entries equal to their row maximum, summed over rows.",
    "attn_saturated_rows": "Rows with two or more entries whose exp(S - max) rounds to 1 in the "
    "kernel's P dtype.",
    "attn_saturated_fraction": "attn_saturated_rows / attn_rows.",
    "attn_saturated_entries": "Entries rounding to 1, summed over saturated rows.",
    "attn_max_logit": "Largest attention logit.",
    "attn_min_logit": "Smallest finite attention logit.",
    "attn_entropy_mean": "Mean softmax-row entropy (nats).",
    "attn_entropy_min": "Smallest softmax-row entropy (nats).",
    "attn_output_bias": "Signed error bias of the attention output vs fp32: mean(err)/mean|err|.",
    "attn_output_systematic_error": "Attention output error beyond correct rounding that keeps one "
    "sign per output dim across rows, relative to the whole error (about 1: systematic; 0: none).",
    "attn_output_error_rms": "RMS error of the attention output vs an fp32 recomputation.",
    "attn_q_spectral_norm": "Spectral norm of the head's W_Q block (power iteration).",
    "attn_k_spectral_norm": "Spectral norm of the head's W_K block (power iteration).",
    "attn_qk_logit_bound": "sigma(W_Q) sigma(W_K) / sqrt(head_dim): bound on |logit| per unit-norm "
    "input.",
    "weight_spectral_norm": "Spectral norm of the 2-D parameter (warm-started power iteration).",
    "events_total": "Events the monitor found since it was made, by kind and rule.",
    "mitigation_skipped_steps_total": "Optimizer steps skipped by the skip_step action.",
    "mitigation_lr_factor": "Factor the lr_backoff action applies to the learning rate now.",
    "optimizer_update_ratio": "||update|| / ||weight|| of the parameter's latest sampled update.",
    "optimizer_absorbed_fraction": "Elements left unchanged although their gradient was non-zero "
    "(updates below half an ulp of the weight), latest sampled update.",
    "optimizer_lr": "Learning rate of the param group.",
    "loss_scale": "The GradScaler's loss scale.",
    "loss_scale_drops_total": "Times the GradScaler's loss scale fell (overflow steps).",
}


# Every metric name the tables above describe (metric_help's own text, not its fallback).
DOCUMENTED_METRICS = frozenset(
    [*_HELP, *(f"{prefix}_{stat}" for prefix in ("grad", "activation") for stat in _TENSOR_STATS)]
)


def metric_help(name: str, heads: HeadMode | None = None) -> str:
    """HELP text of snapshot metric ``name`` (no numwatch_ prefix); ``heads`` for a per-head
    metric says how its heads were reduced."""
    text = _HELP.get(name)
    if text is None:
        prefix, _, stat = name.partition("_")
        subject = {
            "grad": "Gradient of the parameter",
            "activation": "Forward output of the module",
        }
        if prefix in subject and stat in _TENSOR_STATS:
            text = f"{subject[prefix]}: {_TENSOR_STATS[stat]} (flush window)."
        else:
            text = f"numwatch metric {name} (README, 'Metric reference')."
    if heads in ("layer", "top_k"):
        how = {"max": "largest", "min": "smallest", "absmax": "largest magnitude"}
        worst = how[HEAD_REDUCTIONS.get(name, "max")]
        text += f" Per layer: the head with the {worst} value"
        text += "." if heads == "layer" else ", top k heads."
    return text


_SPECIAL = {"nan": "NaN", "inf": "+Inf", "-inf": "-Inf"}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _escape(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


class _Family:
    """One metric family of the exposition: the records it shows, labels without const ones."""

    __slots__ = ("help", "name", "records", "type")

    def __init__(self, name: str, typ: str, help: str, records: list[Any]) -> None:
        self.name = PREFIX + name  # the sample name; a counter's ends in _total
        self.type = typ
        self.help = help
        self.records = records


def _sampled(name: str) -> bool:
    """A metric of a probe that samples (it can be missing from a flush between samples), as
    opposed to one whose absence is its value (attn_kernel_mode: no layer routed)."""
    if name.startswith("attn_kernel_"):
        return False
    return name.startswith(_SAMPLED_PREFIXES)


_SAMPLED_PREFIXES = ("attn_", "activation_", "grad_", "weight_spectral_norm",
                     "optimizer_update_ratio", "optimizer_absorbed_fraction")  # fmt: skip
# Measured in rotation (optimizer.max_bytes): a sample holds a share of the parameters.
_ROTATED = frozenset({"optimizer_update_ratio", "optimizer_absorbed_fraction"})


class _Rotation:
    """When a rotated series' turn may still come. A parameter is measured once per rotation,
    but turns move: chunks of a byte budget differ in size, a parameter without a gradient on
    a step is passed over, and a rotation grows when parameters start to train. So a series is
    held for the longest gap seen between two measurements of any series, plus one sample;
    and every series is held while the rotation is still growing (a series appeared less than
    as many samples ago as series are known). Its own last gap was no bound: a parameter
    trained every step vanished for six flushes after an unfreezing, and now and then when
    another one trained on some steps only."""

    def __init__(self) -> None:
        self.sample = 0
        self.last: dict[tuple[tuple[str, str], ...], int] = {}  # series -> its last sample
        self.longest = 0  # the longest gap between two measurements of one series
        self.new_at = 0  # the sample a series was first measured at, latest

    def sampled(self, fresh: set[tuple[tuple[str, str], ...]]) -> None:
        self.sample += 1
        for key in fresh:
            last = self.last.get(key)
            if last is None:
                self.new_at = self.sample
            else:
                self.longest = max(self.longest, self.sample - last)
            self.last[key] = self.sample

    def holds(self, key: tuple[tuple[str, str], ...]) -> bool:
        since = self.sample - self.last.get(key, self.sample)
        return since <= self.longest + 1 or self.sample - self.new_at < len(self.last)


class SnapshotCollector(Collector):
    """A Collector for a private ``CollectorRegistry``: the latest snapshot as metric families.

    ``update`` (training thread) swaps one reference. The HTTP thread builds the families of a
    snapshot once (``collect`` returns them as prometheus_client ``Metric`` objects) and renders
    its text exposition once (``exposition``); later scrapes of the same flush reuse both.
    """

    def __init__(
        self,
        *,
        heads: HeadMode = "layer",
        top_k: int = 4,
        include: Sequence[str] = ("*",),
        exclude: Sequence[str] = (),
        const_labels: dict[str, str] | None = None,
        run_name: str = "",
        known_events: Iterable[tuple[str, str]] = (),
    ) -> None:
        """``known_events``: the (kind, rule) pairs the configured rules can emit, served as
        0 from the start: a counter series that appears at 1 loses its first increase to
        ``increase()`` and ``rate()``, and panels show "No data" on a healthy run."""
        if heads not in ("layer", "top_k", "all"):
            raise ValueError(f"heads must be 'layer', 'top_k' or 'all', got {heads!r}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.heads: HeadMode = heads
        self.top_k = top_k
        self.include = tuple(include)
        self.exclude = tuple(exclude)
        self.const_labels = {k: str(v) for k, v in (const_labels or {}).items()}
        self.run_name = run_name
        self._known_events = tuple(dict.fromkeys(known_events))
        self._events: Counter[tuple[str, str]] = Counter()
        # rotated metric -> when its series are measured
        self._rotation: dict[str, _Rotation] = {}
        self._state: tuple[Snapshot | None, dict[tuple[str, str], int]] = (None, {})
        self._families: tuple[object, list[_Family]] = (object(), [])
        self._text: tuple[object, bytes] = (object(), b"")
        self._lock = threading.RLock()  # concurrent scrapes build a snapshot's output once
        self._selected: dict[str, bool] = {}
        # names of the last snapshot's records, and per name a gather of its positions
        self._plan: tuple[list[str], list[tuple[str, Callable[..., Any], int]], set[str]] | None
        self._plan = None
        self._layout = _HeadLayout()
        # family name -> (label dicts, rendered line prefixes) of the last render
        self._prefixes: dict[str, tuple[list[Mapping[str, str]], list[str]]] = {}

    def update(self, snapshot: Snapshot, events: Sequence[Event] = ()) -> None:
        """Serve ``snapshot`` from now on and count ``events`` (one reference swap).

        A metric the snapshot does not carry at all (a probe that samples less often than the
        monitor flushes: attention, activations, gradients, spectral norms, updates) keeps the
        series of the last snapshot that had it, and so does each parameter's update measured in
        rotation (a share of the parameters per sample) until its turn comes again: a scrape
        between two samples would otherwise find the series gone, Prometheus would mark them
        stale, and an alert with ``for:`` could never hold. A metric sampled this flush is
        served as sampled (a parameter frozen since has no gradient series, and its update
        series goes once a whole rotation passed it by)."""
        for event in events:
            self._events[(event.kind, event.rule)] += 1
        served = self._state[0]
        names, labels, values = snapshot.columns()
        have = set(names)
        held = [] if served is None else [
            r for r in served if r.name not in have and _sampled(r.name)
        ]  # fmt: skip
        for name in _ROTATED & have:
            held += self._rotation_held(name, snapshot, served)
        if held:
            records = [*zip(names, labels, values, strict=True), *held]
            snapshot = Snapshot(snapshot.step, records, time=snapshot.time, rank=snapshot.rank)
        self._state = (snapshot, dict(self._events))

    def _rotation_held(
        self, name: str, snapshot: Snapshot, served: Snapshot | None
    ) -> list[MetricRecord]:
        """The served series of rotated metric ``name`` that this sample did not measure and
        whose turn may still come (``_Rotation.holds``)."""
        rotation = self._rotation.setdefault(name, _Rotation())
        fresh = {series_key(r.labels) for r in snapshot.series(name)}
        rotation.sampled(fresh)
        held = []
        for r in served.series(name) if served is not None else ():
            key = series_key(r.labels)
            if key in fresh:
                continue
            if rotation.holds(key):
                held.append(r)
            else:
                rotation.last.pop(key, None)
        return held

    def describe(self) -> list[Metric]:
        """No fixed names: the registry must not call collect() when this is registered."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The latest snapshot as prometheus_client metric families."""
        const = self.const_labels
        for fam in self._current()[1]:
            # prometheus_client names a counter family without its _total suffix
            family = fam.name.removesuffix("_total") if fam.type == "counter" else fam.name
            metric = Metric(family, fam.help, fam.type)
            for record in fam.records:
                metric.add_sample(fam.name, {**const, **record.labels}, record.value)
            yield metric

    def exposition(self) -> bytes:
        """The latest snapshot in the Prometheus text format 0.0.4 (rendered once per flush)."""
        with self._lock:
            state, families = self._current()
            if self._text[0] is not state:
                self._text = (state, self._render(families))
            return self._text[1]

    # ------------------------------------------------------------------ building
    def _current(self) -> tuple[object, list[_Family]]:
        state = self._state
        with self._lock:
            if self._families[0] is not state:
                self._families = (state, self._build(*state))
            return self._families

    def _wanted(self, name: str) -> bool:
        chosen = self._selected.get(name)
        if chosen is None:
            chosen = any(fnmatch.fnmatchcase(name, p) for p in self.include) and not any(
                fnmatch.fnmatchcase(name, p) for p in self.exclude
            )
            self._selected[name] = chosen
        return chosen

    def _build(
        self, snapshot: Snapshot | None, events: dict[tuple[str, str], int]
    ) -> list[_Family]:
        run = MetricRecord("run_info", {"run": self.run_name}, 1.0)
        families = [_Family("run_info", "gauge", "The run this process trains (value 1).", [run])]
        if snapshot is None:
            return families
        families.append(
            _Family(
                "step",
                "gauge",
                "Last training step of the latest flush.",
                [MetricRecord("step", {}, float(snapshot.step))],
            )
        )
        families.append(
            _Family(
                "flush_timestamp_seconds",
                "gauge",
                "Unix time of the latest flush.",
                [MetricRecord("flush_timestamp_seconds", {}, snapshot.time)],
            )
        )
        by_name, present = self._group_by_name(list(snapshot))
        worst_heads: list[Any] = []
        for name, records in by_name.items():
            reduced = "head" in records[0].labels and self.heads != "all"
            if "head" in records[0].labels:
                records, worst = _reduce_heads(name, records, self.heads, self.top_k, self._layout)
                worst_heads += worst
            name = _sanitize(name)
            if name == "events_total":  # the monitor's counts
                records = self._with_known_events(records)
            typ = "counter" if name.endswith("_total") else "gauge"
            text = metric_help(name, self.heads if reduced else None)
            families.append(_Family(name, typ, text, records))
        if worst_heads and self._wanted("worst_head"):
            text = "Index of the worst head of the layer for the metric named in label 'metric'."
            families.append(_Family("worst_head", "gauge", text, worst_heads))
        if "events_total" not in present and self._wanted("events_total"):
            counts = [
                MetricRecord("events_total", {"kind": kind, "rule": rule}, float(n))
                for (kind, rule), n in sorted(events.items())
            ]
            counts = self._with_known_events(counts)
            families.append(_Family("events_total", "counter", metric_help("events_total"), counts))
        return families

    def _with_known_events(self, records: list[MetricRecord]) -> list[MetricRecord]:
        """events_total ``records`` plus, at 0, the known (kind, rule) pairs yet to fire."""
        seen = {(r.labels.get("kind"), r.labels.get("rule")) for r in records}
        return records + [
            MetricRecord("events_total", {"kind": kind, "rule": rule}, 0.0)
            for kind, rule in self._known_events
            if (kind, rule) not in seen
        ]

    def _group_by_name(self, records: list[MetricRecord]) -> tuple[dict[str, list], set[str]]:
        """Records of the exported metrics by name, in order, and every name present. Each
        name's positions are kept and reused while the sequence of names is that of the
        previous flush: C-level gathers then."""
        names = [r.name for r in records]  # (a comprehension beats map(attrgetter) on 3.11+)
        if self._plan is None or self._plan[0] != names:
            positions: dict[str, list[int]] = defaultdict(list)
            for i, name in enumerate(names):
                positions[name].append(i)
            gathers = [
                (name, itemgetter(*index), len(index))
                for name, index in positions.items()
                if self._wanted(name)
            ]
            self._plan = (names, gathers, set(positions))
        by_name = {
            name: list(get(records)) if n > 1 else [get(records)] for name, get, n in self._plan[1]
        }
        return by_name, self._plan[2]

    def _render(self, families: list[_Family]) -> bytes:
        """Text format 0.0.4. The ``name{labels} `` prefix of each line is kept per family and
        reused while the family's label sets are the same as at the previous flush (the usual
        case: the model does not change), so a render mostly formats values."""
        out: list[str] = []
        for fam in families:
            help_text = fam.help.replace("\\", r"\\").replace("\n", r"\n")
            out.append(f"# HELP {fam.name} {help_text}\n# TYPE {fam.name} {fam.type}\n")
            labels = [r.labels for r in fam.records]
            cached = self._prefixes.get(fam.name)
            if cached is None or cached[0] != labels:  # C-level: dicts compare by content
                cached = (labels, self._line_prefixes(fam.name, labels))
                self._prefixes[fam.name] = cached
            values = list(map(repr, map(float, [r.value for r in fam.records])))
            if "nan" in values or "inf" in values or "-inf" in values:
                values = [_SPECIAL.get(v, v) for v in values]
            lines = zip(cached[1], values, repeat("\n"))  # joined at C level
            out.append("".join(chain.from_iterable(lines)))
        return "".join(out).encode()

    def _line_prefixes(self, name: str, labels: list[Mapping[str, str]]) -> list[str]:
        """``name{labels} `` per record; label text rendered once per labels dict (a
        parameter's statistics share one)."""
        const = "".join(f'{k}="{_escape(v)}",' for k, v in self.const_labels.items())
        by_id = {id(lab): lab for lab in labels}
        text = {key: f"{name}{{{self._label_text(const, lab)}}} " for key, lab in by_id.items()}
        return list(map(text.__getitem__, map(id, labels)))

    def _label_text(self, const: str, labels: Mapping[str, str]) -> str:
        if any(k in labels for k in self.const_labels):  # a record's own label wins
            const = "".join(
                f'{k}="{_escape(v)}",' for k, v in self.const_labels.items() if k not in labels
            )
        own = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
        return (const + own).rstrip(",")


class _Row(NamedTuple):
    """A record the exporter derived (a reduced head, a worst-head index): cheaper to make than
    a MetricRecord, and all a family needs."""

    labels: Mapping[str, str]
    value: float


class _HeadLayout:
    """Where each layer's heads are in a per-head metric's records, kept across metrics and
    flushes: every per-head metric of a probe has the same label sets in the same order, flush
    after flush, so the grouping (and the label dicts of reduced series) is computed once and
    then only checked (by identity within a flush, by content across flushes, at C level)."""

    def __init__(self) -> None:
        self.labels: list[Mapping[str, str]] | None = None
        self.groups: list[tuple[slice | list[int], dict[str, str]]] = []
        self.slices: list[slice] | None = None  # every layer's heads consecutive
        self.rests: list[dict[str, str]] = []
        self.head_numbers: list[float] = []
        self._worst_labels: dict[str, list[dict[str, str]]] = {}

    def match(self, labels: list[Mapping[str, str]]) -> None:
        if self.labels is not labels and self.labels != labels:
            self.groups = _layer_groups(labels)
            self._worst_labels = {}
            slices = [index for index, _ in self.groups if isinstance(index, slice)]
            self.slices = slices if len(slices) == len(self.groups) else None
            self.rests = [rest for _, rest in self.groups]
            try:
                self.head_numbers = list(map(float, map(itemgetter("head"), labels)))
            except ValueError:  # heads not numbered: the generic path reads the labels
                self.slices = None
        self.labels = labels

    def worst_labels(self, name: str) -> list[dict[str, str]]:
        found = self._worst_labels.get(name)
        if found is None:
            found = [{**rest, "metric": name} for _, rest in self.groups]
            self._worst_labels[name] = found
        return found


def _reduce_heads(
    name: str, records: list[MetricRecord], mode: HeadMode, k: int, layout: _HeadLayout
) -> tuple[list[Any], list[Any]]:
    """Per layer (all labels but ``head``): the worst head's record ('layer'), the k worst
    heads' records ('top_k') or all of them ('all'), and ``worst_head`` records naming the
    worst head's index."""
    reduction = HEAD_REDUCTIONS.get(name, "max")
    labels = [r.labels for r in records]
    layout.match(labels)
    values = [r.value for r in records]
    worst_labels = layout.worst_labels(name) if name not in _NO_WORST_HEAD else None
    if mode == "layer" and layout.slices is not None and not math.isnan(sum(values)):
        return _reduce_layers_fast(values, reduction, layout, worst_labels)
    kept: list[Any] = records if mode == "all" else []
    worst: list[Any] = []
    count = k if mode == "top_k" else 1
    for g, (index, rest) in enumerate(layout.groups):
        if isinstance(index, slice):
            vals = values[index]
            positions: Any = range(index.start, index.stop)
        else:
            vals = [values[i] for i in index]
            positions = index
        order = _worst_first(vals, reduction, count)
        if mode == "layer":
            kept.append(_Row(rest, vals[order[0]]))
        elif mode == "top_k":
            kept += [records[positions[i]] for i in order]
        if worst_labels is not None:
            worst.append(_Row(worst_labels[g], float(labels[positions[order[0]]]["head"])))
    return kept, worst


def _reduce_layers_fast(
    values: list[float],
    reduction: str,
    layout: _HeadLayout,
    worst_labels: list[dict[str, str]] | None,
) -> tuple[list[Any], list[Any]]:
    """_reduce_heads for mode 'layer' with no NaN and every layer's heads consecutive: the same
    result from C-level maps over the layers (no Python loop over them)."""
    slices = layout.slices
    chunks = list(map(values.__getitem__, slices))  # per layer: its heads' values
    if reduction == "min":
        best = list(map(min, chunks))
    elif reduction == "absmax":
        hi, lo = list(map(max, chunks)), list(map(min, chunks))
        best = [h if abs(h) >= abs(low) else low for h, low in zip(hi, lo, strict=True)]
    else:
        best = list(map(max, chunks))
    kept = list(map(_Row, layout.rests, best))
    if worst_labels is None:
        return kept, []
    at = map(list.index, chunks, best)  # the first head holding the worst value
    heads = [layout.head_numbers[sl.start + i] for sl, i in zip(slices, at, strict=True)]
    return kept, list(map(_Row, worst_labels, heads))


def _rest_key(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "head"))


def _layer_groups(labels: list[Mapping[str, str]]) -> list[tuple[slice | list[int], dict]]:
    """(positions, labels without head) of each layer's heads: slices when each layer's heads
    are consecutive (the probe's layout, found at C level), index lists otherwise."""
    try:  # the probe's records: labels exactly {layer, head}
        if set(map(len, labels)) != {2} or not all(map(itemgetter("head"), labels)):
            raise KeyError("head")
        keys = list(map(itemgetter("layer"), labels))
    except KeyError:
        keys = list(map(_rest_key, labels))
    spans: list[slice | list[int]] = []
    start = 0
    for _, run in groupby(keys):
        end = start + len(list(run))
        spans.append(slice(start, end))
        start = end
    if len(spans) != len(set(keys)):
        positions: dict[Any, list[int]] = defaultdict(list)
        for i, key in enumerate(keys):
            positions[key].append(i)
        spans = []
        for index in positions.values():  # head order, so ties go to the lowest head as above
            index.sort(key=lambda i: _head_order(labels[i]["head"]))
            spans.append(index)
    groups = []
    for index in spans:
        first = labels[index.start if isinstance(index, slice) else index[0]]
        groups.append((index, {k: v for k, v in first.items() if k != "head"}))
    return groups


def _head_order(head: str) -> tuple[int, str]:
    return (int(head), "") if head.isdigit() else (1 << 62, head)


def _worst_first(values: list[float], reduction: str, k: int) -> list[int]:
    """Indices of the k worst values, worst first (NaN before anything, then by reduction;
    ties: the first)."""
    if not math.isnan(sum(values)):  # no NaN (and no +Inf/-Inf mix): C-level scans
        if k == 1:
            if reduction == "max":
                return [values.index(max(values))]
            if reduction == "min":
                return [values.index(min(values))]
            hi, lo = max(values), min(values)
            return [values.index(hi if abs(hi) >= abs(lo) else lo)]
        index = range(len(values))
        if reduction == "min":
            return heapq.nsmallest(k, index, key=values.__getitem__)
        if reduction == "absmax":
            return heapq.nlargest(k, index, key=list(map(abs, values)).__getitem__)
        return heapq.nlargest(k, index, key=values.__getitem__)
    badness = [_badness(v, reduction) for v in values]
    return heapq.nlargest(k, range(len(values)), key=badness.__getitem__)


def _badness(value: float, reduction: str) -> tuple[bool, float]:
    """Larger is worse; NaN is the worst of all, ranked above +Inf/-Inf (a float key would tie
    it with them, and the tie went to the first head)."""
    if math.isnan(value):
        return True, 0.0
    if reduction == "min":
        return False, -value
    return False, abs(value) if reduction == "absmax" else value


class PrometheusSink:
    """Serves the latest flush on ``http://host:port/metrics``; ``close()`` stops the server.

    ``port=0`` takes an ephemeral port (see ``url``). A taken port raises ``NumwatchError``.
    """

    name = "prometheus"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        heads: HeadMode = "layer",
        top_k: int = 4,
        include: Sequence[str] = ("*",),
        exclude: Sequence[str] = (),
        rank: int = 0,
        run_name: str = "",
        serve: bool = True,
        known_events: Iterable[tuple[str, str]] = (),
    ) -> None:
        self.collector = SnapshotCollector(
            heads=heads,
            top_k=top_k,
            include=include,
            exclude=exclude,
            const_labels={"rank": str(rank)},
            run_name=run_name,
            known_events=known_events,
        )
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._server: _Server | None = None
        self._stop: weakref.finalize | None = None
        if serve:
            self._server, thread = _serve(self.collector, host, port)
            # Stopped at close(), or once the sink is dropped unclosed (a monitor left attached
            # after a halt, then dropped): it served the dead run's metrics and held the port
            # for the rest of the process, so the next run's attach() failed.
            self._stop = weakref.finalize(self, _stop_serving, self._server, thread)

    @classmethod
    def from_config(
        cls,
        cfg: PrometheusSinkConfig,
        *,
        rank: int,
        local_rank: int,
        run_name: str,
        known_events: Iterable[tuple[str, str]] = (),
    ) -> PrometheusSink | None:
        """The sink ``cfg`` asks for on this rank, or None.

        ``ranks='each'``: every process serves, on ``port + local_rank`` (ephemeral if port is 0).
        ``ranks='rank0'``: only global rank 0 serves.
        """
        if not cfg.enabled or (cfg.ranks == "rank0" and rank != 0):
            return None
        port = cfg.port + local_rank if cfg.port and cfg.ranks == "each" else cfg.port
        if port > 65535:
            raise NumwatchError(
                f"sinks.prometheus: port {cfg.port} + local rank {local_rank} = {port} is past "
                "65535; lower sinks.prometheus.port, or set it to 0 for ephemeral ports"
            )
        return cls(
            host=cfg.host,
            port=port,
            heads=cfg.heads,
            top_k=cfg.top_k,
            include=cfg.include,
            exclude=cfg.exclude,
            rank=rank,
            run_name=run_name,
            known_events=known_events,
        )

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) the server listens on; None when not serving."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return host, port

    @property
    def url(self) -> str | None:
        """The scrape URL, e.g. http://127.0.0.1:9700/metrics; None when not serving."""
        if self.address is None:
            return None
        host, port = self.address
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/metrics"

    def emit(self, snapshot: Snapshot, events: Sequence[Event]) -> None:
        self.collector.update(snapshot, events)

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        self._server = None
        if self._stop is not None:
            self._stop()


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a hung scraper never keeps the training process alive


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log on the trainer's stderr."""


def _app(collector: SnapshotCollector) -> Callable[..., list[bytes]]:
    """WSGI app: /metrics (or /) is the cached text exposition, uncompressed (gzip would cost
    the trainer CPU on every scrape; the scraper is normally on the same host or network)."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"numwatch serves its metrics on /metrics\n"]
        try:
            body = collector.exposition()
        except Exception:
            _log.exception("numwatch Prometheus exposition failed")
            start_response("500 Internal Server Error", [("Content-Type", "text/plain")])
            return [b"numwatch: exposition failed (see the training process's log)\n"]
        headers = [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))]
        start_response("200 OK", headers)
        return [body]

    return app


def _stop_serving(server: _Server, thread: threading.Thread) -> None:
    """shutdown() waits for the serving loop to end: a forked child has no serving thread, and
    the finalizer may run on the serving thread itself (a garbage collection there): both would
    wait for ever. There the loop is only told to end."""
    if thread.is_alive() and thread is not threading.current_thread():
        server.shutdown()
        thread.join(timeout=5.0)
    else:
        server._BaseServer__shutdown_request = True  # type: ignore[attr-defined]
    _SERVING.discard(server)
    server.server_close()


# The live servers, whose listening sockets are closed in a forked child (a DataLoader worker):
# the child shares the socket, so after detach the port stayed bound (scrapes hung, the next
# attach on it failed) while the child lived.
_SERVING: weakref.WeakSet[_Server] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [s.socket.close() for s in list(_SERVING)])


def _bind(host: str, port: int, app: Callable[..., list[bytes]], server_class: type) -> _Server:
    """The server, bound. A port held by a sink of this process that was dropped unclosed (a
    halted run's monitor, in a sweep) is freed by the garbage collection of its cycle, which may
    not have run yet: collect once, and bind again."""
    try:
        return make_server(host, port, app, server_class, handler_class=_QuietHandler)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE or not port:
            raise
        gc.collect()
        return make_server(host, port, app, server_class, handler_class=_QuietHandler)


def _serve(collector: SnapshotCollector, host: str, port: int) -> tuple[_Server, threading.Thread]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("_Server", (_Server,), {"address_family": family})
    try:
        server = _bind(host, port, _app(collector), server_class)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise NumwatchError(
                f"sinks.prometheus: port {port} on {host} is already in use (another process or "
                "monitor serves there); set sinks.prometheus.port to a free port, or to 0 for an "
                "ephemeral one"
            ) from None
        raise NumwatchError(f"sinks.prometheus: cannot listen on {host}:{port}: {exc}") from exc
    _SERVING.add(server)
    # poll_interval bounds how long close() waits for the serving thread to notice shutdown
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.1},
        name="numwatch-prometheus",
        daemon=True,
    )
    thread.start()
    return server, thread
