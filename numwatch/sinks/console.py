"""A one-line health summary per flush on stderr.

On a terminal the line is coloured with Rich; elsewhere (CI logs, files) it is a plain line.
Lines are printed whole, so they interleave cleanly with tqdm bars and logging output.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

from numwatch.events import Event
from numwatch.snapshot import MetricRecord, Snapshot

__all__ = ["ConsoleSink", "summary_line"]


def _worst_key(record: MetricRecord) -> tuple[bool, float]:
    """max() key: NaN is the worst value, as in the Prometheus exporter and the report (a plain
    max keeps a NaN only where it comes first)."""
    return (math.isnan(record.value), record.value)


def _worst(snapshot: Snapshot, metric: str, label: str) -> tuple[float, str] | None:
    series = snapshot.series(metric)
    if not series:
        return None
    best = max(series, key=_worst_key)
    name = best.labels.get(label, "")
    text = escape(name)  # a name may hold '[...]'
    # escape() doubles a trailing backslash against a tag that may follow; a ')' follows here
    return best.value, text[:-1] if name.endswith("\\") else text


# (metric, what): the attention precursors counted in rows, shown as shares of attn_rows.
_ATTN_SHARES = (("attn_repeated_max_rows", "repeated-max"), ("attn_saturated_rows", "saturated"))


def _attention(snapshot: Snapshot) -> str | None:
    """The attention part of the line, of whichever precursors the flush holds: a log written
    with ``sinks.jsonl.exclude`` (read back by `numwatch tail`) may lack any of them."""
    rows = sum(r.value for r in snapshot.series("attn_rows"))
    shares = []
    for metric, what in _ATTN_SHARES:
        series = snapshot.series(metric)
        if rows and series:
            shares.append((what, sum(r.value for r in series) / rows))
    parts = []
    if shares:
        style = "yellow" if any(share for _, share in shares) else "green"
        parts.append(f"[{style}]" + " ".join(f"{w} {share:.1%}" for w, share in shares) + "[/]")
    logits = snapshot.series("attn_max_logit")
    if logits:
        parts.append(f"max_logit {max(logits, key=_worst_key).value:.3g}")
    return "attn " + " ".join(parts) if parts else None


def summary_line(snapshot: Snapshot, events: Sequence[Event]) -> str:
    """Rich-markup summary of one flush (plain text once markup is stripped)."""
    # a rank other than 0: its own values (its per-rank log, its console once a Join stopped
    # the aggregation)
    rank = f" rank {snapshot.rank}" if snapshot.rank else ""
    parts = [f"[bold]numwatch[/]{rank} step {snapshot.step}"]
    loss = snapshot.get("loss")
    if loss is not None:
        parts.append(f"loss {loss:.4g}")
    norm = snapshot.get("grad_norm")
    if norm is not None:
        parts.append(f"grad_norm {norm:.3g}")
    worst = _worst(snapshot, "grad_absmax", "param")
    if worst:
        parts.append(f"grad_absmax {worst[0]:.3g} ({worst[1]})")
    worst = _worst(snapshot, "activation_absmax", "module")
    if worst:
        parts.append(f"act_absmax {worst[0]:.3g} ({worst[1]})")
    attention = _attention(snapshot)
    if attention:
        parts.append(attention)
    nonfinite = sum(r.value for r in snapshot.series("grad_nonfinite"))
    nonfinite += sum(r.value for r in snapshot.series("activation_nonfinite"))
    style = "bold red" if nonfinite else "green"
    parts.append(f"[{style}]nonfinite {int(nonfinite)}[/]")
    overhead = snapshot.get("monitor_overhead_seconds")
    step_s = snapshot.get("step_seconds")
    if overhead is not None:
        text = f"overhead {overhead * 1e3:.2f} ms/step"
        if step_s:
            text += f" ({100 * overhead / step_s:.1f}%)"
        parts.append(text)
    if events:
        kinds = Counter(e.kind for e in events)
        listed = escape(", ".join(f"{n} {k}" for k, n in kinds.items()))
        first = min(events, key=lambda e: e.kind != "action")  # what was done matters most
        # escaped: every rule's message begins with '[rule]', which Rich would take for a tag
        parts.append(f"[bold yellow]events: {listed}[/] — {escape(first.message)}")
    return " | ".join(parts)


class ConsoleSink:
    name = "console"

    def __init__(self, every: int = 1, console: Console | None = None) -> None:
        self.every = every
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True)
        self._flushes = 0

    def emit(self, snapshot: Snapshot, events: Sequence[Event]) -> None:
        self._flushes += 1
        if events or self._flushes % self.every == 0:
            self.console.print(summary_line(snapshot, events))

    def emit_events(self, events: Sequence[Event]) -> None:
        """Events raised after the last flush (what its actions did), at detach."""
        for e in events:
            self.console.print(
                f"[bold yellow]{escape(e.kind)}[/] step {e.step}: {escape(e.message)}"
            )

    def close(self) -> None:
        """Nothing to release: the console belongs to the process."""
