"""`numwatch report RUN.jsonl`: a self-contained HTML report of one run, with PNG plots.

Reads the JSONL run log (README, 'JSONL schema'), so it works on a finished run, a crashed one
or a running one. The page holds a summary table, per-layer timelines of the attention
precursors (heads reduced the way the Prometheus exporter reduces them: the worst head of each
layer), gradient/activation extremes, spectral norms and monitor cost, with every event drawn as
a vertical line and every mitigation (stabilized kernel, skipped step, LR back-off) as a marker
or a shaded span; then the events and the heads that triggered them. Plots need matplotlib
(``pip install 'numwatch[report]'``); everything is embedded, so the file can be mailed.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import math
import sys
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from numwatch.cli import count
from numwatch.errors import NumwatchError
from numwatch.sinks.jsonl import RunBoundaries, is_flush, iter_jsonl
from numwatch.sinks.prometheus import HEAD_REDUCTIONS

__all__ = ["Run", "load_run", "main", "render_html", "write_report"]

EVENT_COLORS = {
    "nonfinite": "#d62728",
    "precursor": "#ff7f0e",
    "spike": "#9467bd",
    "anomaly": "#8c564b",
    "action": "#2ca02c",
}
# Attention timelines: (metric, title, log scale).
ATTENTION_PLOTS = [
    ("attn_repeated_max_fraction", "Repeated-max rows (fraction, worst head)", False),
    ("attn_saturated_fraction", "Saturated rows (fraction, worst head)", False),
    ("attn_max_logit", "Max attention logit (worst head)", True),
    ("attn_output_bias", "Output error bias mean(err)/mean|err| (worst head, signed)", False),
    ("attn_output_systematic_error", "Systematic output error beyond rounding (worst head)", False),
    # the mean over rows: the minimum is 0 in any causal layer (its first row has one key)
    ("attn_entropy_mean", "Mean softmax-row entropy, nats (lowest head)", False),
    ("attn_qk_logit_bound", "QK logit bound sigma_q sigma_k / sqrt(d) (largest head)", True),
]
# Per-parameter/module timelines: (metric, label, title, log scale); the ``top`` worst series.
TENSOR_PLOTS = [
    ("grad_absmax", "param", "Gradient absmax (largest parameters)", True),
    ("grad_underflow_fraction", "param", "Gradient underflow fraction (largest)", False),
    ("activation_absmax", "module", "Activation absmax (largest modules)", True),
    ("weight_spectral_norm", "param", "Weight spectral norm (largest)", False),
    ("optimizer_update_ratio", "param", "RMS(update) / RMS(weight) (largest)", True),
]


class Points:
    """One series' (step, value) points, 16 bytes each: a long log's report holds millions
    (GPT-2's ~150 parameters by a dozen gradient metrics, per flush), which as tuples took
    several times the log's size in memory."""

    __slots__ = ("steps", "values")

    def __init__(self) -> None:
        self.steps = array("q")
        self.values = array("d")

    def append(self, point: tuple[int, float]) -> None:
        self.steps.append(point[0])
        self.values.append(point[1])

    def pop(self) -> tuple[int, float]:
        return self.steps.pop(), self.values.pop()

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> tuple[int, float]:
        return self.steps[i], self.values[i]

    def __iter__(self) -> Iterator[tuple[int, float]]:
        return zip(self.steps, self.values, strict=True)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Points):
            return self.steps == other.steps and self.values == other.values
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, like a list

    def __repr__(self) -> str:
        return f"Points({list(self)!r})"


@dataclass
class Run:
    """One run of a JSONL log, as series: {metric: {labels: [(step, value)]}} plus events."""

    path: Path
    name: str
    rank: int
    steps: list[int]
    times: list[float]
    series: dict[str, dict[tuple[tuple[str, str], ...], Points]]
    events: list[dict[str, Any]]
    skipped_runs: int = 0
    notes: list[str] = field(default_factory=list)

    def names(self) -> set[str]:
        return set(self.series)

    def layer_series(self, metric: str) -> dict[str, list[tuple[int, float]]]:
        """Per layer: the worst head's value at each flush (HEAD_REDUCTIONS)."""
        reduction = HEAD_REDUCTIONS.get(metric, "max")
        by_layer: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for labels, points in self.series.get(metric, {}).items():
            layer = dict(labels).get("layer", "")
            for step, v in points:
                by_layer[layer][step].append(v)
        return {
            layer: [(step, _reduce(vals, reduction)) for step, vals in sorted(steps.items())]
            for layer, steps in sorted(by_layer.items())
        }

    def scalar(self, metric: str) -> list[tuple[int, float]]:
        """A metric without labels (or the sum over its label sets) per flush."""
        total: dict[int, float] = defaultdict(float)
        for points in self.series.get(metric, {}).values():
            for step, v in points:
                total[step] += v
        return sorted(total.items())


def _reduce(values: list[float], reduction: str) -> float:
    if any(math.isnan(v) for v in values):
        return math.nan
    if reduction == "min":
        return min(values)
    if reduction == "absmax":
        return max(values, key=abs)
    return max(values)


def load_run(path: str | Path) -> Run:
    """The last run in ``path`` (a log the same path was reused for holds several: see
    ``RunBoundaries``), read record by record: memory holds the series, not the log."""
    path = Path(path)
    if not path.is_file():
        raise NumwatchError(f"no run log at {str(path)!r}")
    run: Run | None = None
    runs = 0
    boundaries = RunBoundaries()
    for record in iter_jsonl(path):
        if boundaries.starts(record):
            runs += 1
            run = Run(path=path, name="", rank=0, steps=[], times=[], series={}, events=[])
        assert run is not None
        run.name, run.rank = record.get("run", ""), record.get("rank", 0)
        step = record["step"]
        for m in record["metrics"]:
            points = run.series.setdefault(m["name"], {}).setdefault(
                tuple(sorted(m["labels"].items())), Points()
            )
            if points and points[-1][0] == step:  # a second flush of one step (flush() at the
                points.pop()  # end of training, then detach): its latest value, not a sum
            points.append((step, m["value"]))
        run.events += record["events"]
        if is_flush(record):
            run.steps.append(step)
            run.times.append(record["time"])
    if run is None:
        raise NumwatchError(f"{str(path)!r} holds no flush records yet")
    run.skipped_runs = runs - 1
    return run


# ---------------------------------------------------------------------------------------- plots
def _matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise NumwatchError(
            "numwatch report draws its plots with matplotlib: pip install 'numwatch[report]'"
        ) from None
    return Figure


def _png(fig: Any) -> str:
    """The figure as a base64 PNG of at most 256 colours (line plots lose nothing visible, and
    the page, archived next to every run log, shrinks about 2.5-fold)."""
    from PIL import Image  # matplotlib's own dependency

    rendered, packed = io.BytesIO(), io.BytesIO()
    fig.savefig(rendered, format="png", dpi=90, bbox_inches="tight")
    rendered.seek(0)
    Image.open(rendered).convert("RGB").quantize(256).save(packed, format="png", optimize=True)
    return base64.b64encode(packed.getvalue()).decode()


def _markers(ax: Any, run: Run) -> None:
    """Events as vertical lines (one per step and kind); mitigations as spans and ticks."""
    seen = set()
    for event in run.events:
        key = (event["step"], event["kind"])
        if key in seen:
            continue
        seen.add(key)
        ax.axvline(event["step"], color=EVENT_COLORS.get(event["kind"], "grey"), lw=0.8, alpha=0.6)
    stabilized = run.layer_series("attn_kernel_stabilized")
    on_steps = sorted({s for pts in stabilized.values() for s, v in pts if v > 0})
    for start, end in _spans(on_steps, run.steps):
        ax.axvspan(start, end, color="#2ca02c", alpha=0.08, lw=0)
    lr = [s for s, v in run.scalar("mitigation_lr_factor") if v < 1]
    for start, end in _spans(lr, run.steps):
        ax.axvspan(start, end, color="#1f77b4", alpha=0.08, lw=0)
    for step in _skipped_steps(run):
        ax.plot([step], [0], marker="v", color="#17becf", transform=ax.get_xaxis_transform())


def _skipped_steps(run: Any) -> list[int]:
    """Steps whose update skip_step withheld, from its action events (their step is exact; the
    counter shows a skip one flush late, and not at all in the first window or the last); a
    log without them (its events left out): the flushes where the counter rose from 0 on."""
    events = {
        e["step"]
        for e in run.events
        if (ev := e.get("evidence") or {}).get("action") == "skip_step" and not ev.get("failed")
    }
    if events:
        return sorted(events)
    counter = [(None, 0.0), *run.scalar("mitigation_skipped_steps_total")]
    return [step for (_, a), (step, b) in pairwise(counter) if b > a]


def _spans(on: Sequence[int], steps: Sequence[int]) -> Iterable[tuple[int, int]]:
    """Flush steps where a state held, as spans: a flush covers the steps since the previous
    flush, so a span starts at the flush before its first one."""
    on_set = set(on)
    start = end = None
    previous = steps[0] if steps else 0
    for step in steps:
        if step in on_set:
            start = previous if start is None else start
            end = step
        elif start is not None:
            yield start, end
            start = None
        previous = step
    if start is not None:
        yield start, end


def _legend(ax: Any, n: int) -> None:
    if 0 < n <= 12:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def _verbatim(text: str) -> str:
    """``text`` (a parameter, module or layer name) as matplotlib draws it verbatim: a pair of
    '$' would start mathtext, which garbles the name or raises on an unknown command, and a
    legend leaves out labels that begin with '_' (as torch.compile's '_orig_mod.' does)."""
    text = text.replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def _title(ax: Any, title: str) -> None:
    ax.set_title(_verbatim(title), fontsize=9, loc="left")


# matplotlib's tick and limit arithmetic overflows near float64's maximum (on a log axis and a
# linear one alike): larger finite values are drawn at this bound, and the axes say so.
_DRAWABLE = 1e300


def _plot(ax: Any, points: Points | list[tuple[int, float]], label: str, **kwargs: Any) -> None:
    if points:
        steps, values = zip(*points, strict=True)
        if any(math.isfinite(v) and abs(v) > _DRAWABLE for v in values):
            values = tuple(
                max(-_DRAWABLE, min(v, _DRAWABLE)) if math.isfinite(v) else v for v in values
            )
            note = f"|values| past {_DRAWABLE:g} drawn at {_DRAWABLE:g}"
            ax.text(0.99, 0.03, note, transform=ax.transAxes, ha="right", fontsize=7, color="#666")
        # a series of one point (a run after its first flush) is drawn as a dot: a line of
        # one point draws nothing
        dot = {"marker": ".", "ms": 5} if len(points) == 1 else {}
        ax.plot(steps, values, label=_verbatim(label), lw=1.2, **dot, **kwargs)


def _figure(rows: int) -> tuple[Any, list[Any]]:
    fig = _matplotlib()(figsize=(11, 2.6 * rows))
    axes = fig.subplots(rows, 1, squeeze=False, sharex=True)[:, 0]
    return fig, list(axes)


def _finish(fig: Any, axes: list[Any], run: Run) -> str:
    for ax in axes:
        _markers(ax, run)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    return _png(fig)


def _training_plot(run: Run) -> str | None:
    panels = [
        ("loss", "Loss"),
        ("grad_norm", "Gradient L2 norm"),
    ]
    panels = [(m, t) for m, t in panels if m in run.series]
    nonfinite = [m for m in ("grad_nonfinite", "activation_nonfinite") if m in run.series]
    if not panels and not nonfinite:
        return None
    fig, axes = _figure(len(panels) + bool(nonfinite))
    for ax, (metric, title) in zip(axes, panels, strict=False):
        _plot(ax, run.scalar(metric), metric)
        _title(ax, title)
        if metric == "loss":
            _window_loss(ax, run)
        if metric == "grad_norm" and _positive(run.scalar(metric)):
            ax.set_yscale("log")
    if nonfinite:
        ax = axes[-1]
        for metric in nonfinite:
            _plot(ax, run.scalar(metric), metric)
        _title(ax, "Non-finite elements per flush window")
        _legend(ax, len(nonfinite))
    return _finish(fig, axes, run)


def _window_loss(ax: Any, run: Run) -> None:
    """Beside each flush's last-step loss, the largest and the mean of its window's steps: a
    spike between two flushes shows only there; a NaN/Inf there (no point drawn) as a cross."""
    windows = [m for m in ("loss_max", "loss_mean") if m in run.series]
    if not windows:  # a log from before loss_max
        return
    for metric in windows:
        _plot(ax, run.scalar(metric), metric)
    bad = [s for s, v in run.scalar("loss_max") if not math.isfinite(v)]
    if bad:  # at the axes' top edge
        top, color = ax.get_xaxis_transform(), EVENT_COLORS["nonfinite"]
        ax.plot(
            bad,
            [1.0] * len(bad),
            "x",
            color=color,
            transform=top,
            clip_on=False,
            label="loss_max NaN/Inf",
        )
    _legend(ax, 1 + len(windows) + bool(bad))


def _positive(points: list[tuple[int, float]]) -> bool:
    return any(v > 0 and math.isfinite(v) for _, v in points)


def _attention_plot(run: Run) -> str | None:
    plots = [p for p in ATTENTION_PLOTS if p[0] in run.series]
    if not plots:
        return None
    fig, axes = _figure(len(plots))
    for ax, (metric, title, log) in zip(axes, plots, strict=True):
        layers = run.layer_series(metric)
        for i, (layer, points) in enumerate(layers.items()):
            _plot(ax, points, layer, color=_layer_color(i, len(layers)))
        _title(ax, title)
        if log and any(_positive(p) for p in layers.values()):
            ax.set_yscale("log")
        _legend(ax, len(layers))
    return _finish(fig, axes, run)


def _layer_color(i: int, n: int) -> Any:
    """Layers shade from dark (first) to light (last): depth reads off the colour."""
    import matplotlib

    return matplotlib.colormaps["viridis"](i / max(n - 1, 1) * 0.9)


def _worst_series(run: Run, metric: str, label: str, top: int) -> dict[str, Points]:
    """The ``top`` label values whose largest finite value over the run is the largest."""
    by_name: dict[str, Points] = {}
    for labels, points in run.series.get(metric, {}).items():
        by_name[dict(labels).get(label, "")] = points

    def peak(points: Points) -> float:
        finite = [abs(v) for _, v in points if math.isfinite(v)]
        return max(finite, default=-math.inf)

    ranked = sorted(by_name, key=lambda k: peak(by_name[k]), reverse=True)[:top]
    return {k: by_name[k] for k in ranked}


def _tensor_plot(run: Run, top: int) -> str | None:
    plots = [p for p in TENSOR_PLOTS if p[0] in run.series]
    if not plots:
        return None
    fig, axes = _figure(len(plots))
    for ax, (metric, label, title, log) in zip(axes, plots, strict=True):
        worst = _worst_series(run, metric, label, top)
        for name, points in worst.items():
            _plot(ax, points, name)
        _title(ax, f"{title}, top {len(worst)}")
        if log and any(_positive(p) for p in worst.values()):
            ax.set_yscale("log")
        _legend(ax, len(worst))
    return _finish(fig, axes, run)


def _cost_plot(run: Run) -> str | None:
    if "step_seconds" not in run.series:
        return None
    fig, axes = _figure(1)
    ax = axes[0]
    _plot(ax, [(s, v * 1e3) for s, v in run.scalar("step_seconds")], "step")
    overhead = run.scalar("monitor_overhead_seconds")
    _plot(ax, [(s, v * 1e3) for s, v in overhead], "numwatch overhead")
    _title(ax, "Time per step, ms")
    _legend(ax, 2)
    return _finish(fig, axes, run)


# ---------------------------------------------------------------------------------------- tables
def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.4g}"
    return str(v)


def _extreme(
    run: Run, metric: str, *, largest: bool = True, absolute: bool = False
) -> tuple[float, int, dict[str, str]] | None:
    """(value, step, labels) of the most extreme finite value of ``metric`` over the run."""
    best = None
    for labels, points in run.series.get(metric, {}).items():
        for step, v in points:
            if not math.isfinite(v):
                continue
            key = abs(v) if absolute else (v if largest else -v)
            if best is None or key > best[0]:
                best = (key, v, step, dict(labels))
    return None if best is None else best[1:]


def _where(labels: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in labels.items())


def summary_rows(run: Run) -> list[tuple[str, str]]:
    """(what, value) rows of the summary table, for the metrics the log has."""
    rows = [
        ("run", f"{run.name} (rank {run.rank})"),
        (
            "steps",
            f"{run.steps[0]} .. {run.steps[-1]} in {len(run.steps)} flushes"
            if run.steps
            else "no flushes (events only)",
        ),
    ]
    if len(run.times) > 1:
        rows.append(("wall time", f"{run.times[-1] - run.times[0]:.1f} s between first/last flush"))
    kinds = Counter(e["kind"] for e in run.events)
    rows.append(("events", ", ".join(f"{n} {k}" for k, n in kinds.items()) or "none"))
    loss = run.scalar("loss")
    if loss:
        finite = [v for _, v in loss if math.isfinite(v)]
        # the largest of every step (loss_max), not only of each flush's last: NaN first
        windows = run.scalar("loss_max") or loss
        nan = [(s, v) for s, v in windows if math.isnan(v)]
        step, top = nan[0] if nan else max(windows, key=lambda p: p[1])
        text = f"last {_fmt(loss[-1][1])}, lowest {_fmt(min(finite, default=math.nan))}"
        rows.append(("loss", f"{text}, largest {_fmt(top)} at flush step {step}"))
    for metric in ("grad_nonfinite", "activation_nonfinite"):
        points = [(s, v) for s, v in run.scalar(metric) if v > 0]
        if metric in run.series:
            text = (
                f"first at flush step {points[0][0]}, {_fmt(sum(v for _, v in points))} in all"
                if points
                else "none"
            )
            rows.append((f"{metric} elements", text))
    for metric, what, kwargs in (
        ("grad_norm_max", "largest gradient norm", {}),
        ("grad_absmax", "largest |gradient|", {}),
        ("activation_absmax", "largest |activation|", {}),
        ("attn_max_logit", "largest attention logit", {}),
        ("attn_repeated_max_fraction", "most repeated-max rows", {}),
        ("attn_saturated_fraction", "most saturated rows", {}),
        ("attn_output_bias", "strongest output bias", {"absolute": True}),
        ("attn_output_systematic_error", "most systematic output error", {}),
        # the mean: the minimum is 0 in any causal layer (its first row has one key)
        ("attn_entropy_mean", "lowest mean softmax entropy", {"largest": False}),
        ("weight_spectral_norm", "largest weight spectral norm", {}),
        ("attn_qk_logit_bound", "largest QK logit bound", {}),
    ):
        found = _extreme(run, metric, **kwargs)
        if found is not None:
            v, step, labels = found
            where = f" ({_where(labels)})" if labels else ""
            rows.append((what, f"{_fmt(v)} at step {step}{where}"))
    skipped = run.scalar("mitigation_skipped_steps_total")
    events = len(_skipped_steps(run))
    if skipped or events:
        # the counter lags its last skip by a flush; it also holds skips of earlier attaches
        rows.append(
            ("skipped optimizer steps", _fmt(max(skipped[-1][1] if skipped else 0, events)))
        )
    lr = run.scalar("mitigation_lr_factor")
    if lr:
        rows.append(("lowest LR factor", _fmt(min(v for _, v in lr))))
    stabilized = run.layer_series("attn_kernel_stabilized")
    on = sorted(layer for layer, pts in stabilized.items() if pts and pts[-1][1] > 0)
    if stabilized:
        rows.append(("layers on the stabilized kernel at the end", ", ".join(on) or "none"))
    last = run.steps[-1] if run.steps else None
    modes = sorted(  # the mode names what the kernel computes: plain, *_split, reproductions
        f"{dict(labels)['layer']}: {dict(labels)['mode']}"
        for labels, pts in run.series.get("attn_kernel_mode", {}).items()
        if pts and pts[-1][0] == last and pts[-1][1] > 0
    )
    if "attn_kernel_mode" in run.series:
        rows.append(("numwatch kernel modes at the end", ", ".join(modes) or "none"))
    overhead, step_s = run.scalar("monitor_overhead_seconds"), run.scalar("step_seconds")
    if overhead and step_s:
        o = sum(v for _, v in overhead) / len(overhead)
        s = sum(v for _, v in step_s) / len(step_s)
        share = f" ({100 * o / s:.1f} % of {s * 1e3:.1f} ms)" if s else ""
        rows.append(("monitor overhead", f"{o * 1e3:.2f} ms/step{share}"))
    errors = run.series.get("monitor_errors_total", {})
    if errors:
        bad = {dict(k)["component"]: pts[-1][1] for k, pts in errors.items() if pts[-1][1] > 0}
        # the counter of the last flush's failures reaches no flush: their action events do
        failed = sum(1 for e in run.events if (e.get("evidence") or {}).get("failed") is True)
        if failed > bad.get("actions", 0):
            bad["actions"] = failed
        rows.append(
            ("monitor errors", ", ".join(f"{c}: {_fmt(n)}" for c, n in bad.items()) or "none")
        )
    return rows


def triggered_heads(run: Run) -> list[dict[str, Any]]:
    """(layer, head) pairs named by events: rules, first and last step, count; most first."""
    heads: dict[tuple[str, str], dict[str, Any]] = {}
    for e in run.events:
        labels = e.get("labels") or {}
        if "head" not in labels or e["kind"] == "action":
            continue
        key = (labels.get("layer", ""), labels["head"])
        h = heads.setdefault(
            key,
            {
                "layer": key[0],
                "head": key[1],
                "rules": Counter(),
                "first": e["step"],
                "last": e["step"],
            },
        )
        h["rules"][e["rule"] or e["kind"]] += 1
        h["first"] = min(h["first"], e["step"])
        h["last"] = max(h["last"], e["step"])
    return sorted(
        heads.values(),
        key=lambda h: (
            -sum(h["rules"].values()),
            h["layer"],
            int(h["head"]) if h["head"].isdigit() else 0,
        ),
    )


def worst_heads(run: Run, top: int) -> list[tuple[str, str, str, float, int]]:
    """(metric, layer, head, value, step): the ``top`` most extreme heads per precursor."""
    out = []
    for metric in (
        "attn_repeated_max_fraction",
        "attn_saturated_fraction",
        "attn_max_logit",
        "attn_output_bias",
        "attn_output_systematic_error",
    ):
        peaks = []
        for labels, points in run.series.get(metric, {}).items():
            lab = dict(labels)
            if "head" not in lab:
                continue
            finite = [(abs(v), v, s) for s, v in points if math.isfinite(v)]
            if finite:
                _, v, s = max(finite)
                peaks.append((abs(v), metric, lab.get("layer", ""), lab["head"], v, s))
        peaks.sort(reverse=True)
        out += [(m, layer, head, v, s) for _, m, layer, head, v, s in peaks[:top] if v != 0]
    return out


# ---------------------------------------------------------------------------------------- HTML
_CSS = """
body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}img{max-width:100%}.legend span{margin-right:14px;font-size:12px}
.note{color:#666;font-size:12px}
"""


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(run: Run, *, top: int = 8, max_events: int = 300) -> str:
    """The report page of ``run``."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>numwatch report: {html.escape(run.name)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>numwatch report: {html.escape(run.name)}</h1>",
        f"<p class='note'>{html.escape(str(run.path))}",
    ]
    if run.skipped_runs:
        parts.append(f"; the last of {run.skipped_runs + 1} runs in this log")
    parts.append("</p><h2>Summary</h2>")
    parts.append(_table(["", ""], summary_rows(run)))
    legend = "".join(
        f"<span style='color:{c}'>&#9474; {k} event</span>" for k, c in EVENT_COLORS.items()
    )
    legend += (
        "<span style='background:#2ca02c22'>&nbsp;stabilized kernel&nbsp;</span>"
        "<span style='background:#1f77b422'>&nbsp;LR backed off&nbsp;</span>"
        "<span style='color:#17becf'>&#9660; skipped step</span>"
    )
    sections = [
        ("Training", lambda: _training_plot(run)),
        ("Attention precursors per layer", lambda: _attention_plot(run)),
        ("Gradients, activations, weights", lambda: _tensor_plot(run, top)),
        ("Cost", lambda: _cost_plot(run)),
    ]
    parts.append(f"<p class='legend'>Markers in every plot: {legend}</p>")
    for title, draw in sections:
        try:
            png = draw()
        except Exception as exc:  # matplotlib failing on extreme data costs this plot only
            parts.append(f"<h2>{html.escape(title)}</h2>")
            reason = html.escape(f"{type(exc).__name__}: {exc}")
            parts.append(f"<p class='note'>This plot could not be drawn ({reason}).</p>")
            continue
        if png is not None:
            parts.append(f"<h2>{html.escape(title)}</h2>")
            parts.append(f"<img alt='{html.escape(title)}' src='data:image/png;base64,{png}'>")
    heads = triggered_heads(run)
    parts.append("<h2>Heads that triggered</h2>")
    if heads:
        rows = [
            (
                h["layer"],
                h["head"],
                ", ".join(f"{r} x{n}" for r, n in h["rules"].items()),
                h["first"],
                h["last"],
            )
            for h in heads
        ]
        parts.append(_table(["layer", "head", "rules (events)", "first step", "last step"], rows))
    else:
        parts.append("<p>No event named a head.</p>")
    worst = worst_heads(run, 5)
    if worst:
        parts.append("<h2>Most extreme heads</h2>")
        parts.append(_table(["metric", "layer", "head", "value", "step"], worst))
    parts.append(f"<h2>Events ({len(run.events)})</h2>")
    if run.events:
        rows = [
            (
                e["step"],
                e["kind"],
                e["severity"],
                e["rule"],
                _where(e.get("labels") or {}),
                e.get("value"),
                e.get("threshold"),
                e["message"],
            )
            for e in run.events[:max_events]
        ]
        parts.append(
            _table(
                ["step", "kind", "severity", "rule", "labels", "value", "threshold", "message"],
                rows,
            )
        )
        if len(run.events) > max_events:
            parts.append(
                f"<p class='note'>{len(run.events) - max_events} more events in the log.</p>"
            )
    else:
        parts.append("<p>No events.</p>")
    parts.append("</body></html>\n")
    return "".join(parts)


def write_report(path: str | Path, out: str | Path | None = None, *, top: int = 8) -> Path:
    """Write the HTML report of the run log ``path`` (default: next to it, .html in place of
    .jsonl, .jsonl.gz or .jsonl.xz); never over the log itself."""
    log = Path(path)
    stem = log.with_suffix("") if log.suffix in (".gz", ".xz") else log
    target = Path(out) if out is not None else stem.with_suffix(".html")
    if target.exists() and target.samefile(log):  # same path, a symlink or a hard link to it
        raise NumwatchError(
            f"{str(target)!r} is the run log itself: the report would overwrite it; "
            "write the report elsewhere (-o REPORT.html)"
        )
    run = load_run(path)
    _matplotlib()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_html(run, top=top), encoding="utf-8")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="numwatch report", description="Write a self-contained HTML report of a run log."
    )
    parser.add_argument("log", help="the run's JSONL log (sinks.jsonl.path)")
    parser.add_argument("-o", "--out", default=None, help="HTML file (default: LOG with .html)")
    parser.add_argument(
        "--top", type=count, default=8, help="parameters/modules drawn per gradient/activation plot"
    )
    args = parser.parse_args(argv)
    try:
        out = write_report(args.log, args.out, top=args.top)
    except (NumwatchError, OSError, ValueError) as exc:
        print(f"numwatch report: {exc}", file=sys.stderr)
        return 1
    print(f"numwatch report: wrote {out}")
    return 0
