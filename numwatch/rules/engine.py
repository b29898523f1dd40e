"""Runs the configured rules over each flush (and, for step-level rules, over each step)."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping, Sequence

from numwatch.errors import NumwatchConfigError
from numwatch.events import Event
from numwatch.rules.base import Finding, Rule, SeriesKey
from numwatch.rules.nonfinite import NonfiniteRule
from numwatch.sinks.prometheus import DOCUMENTED_METRICS
from numwatch.snapshot import MetricRecord, series_key

__all__ = ["STEP_METRICS", "RuleEngine"]

# Metrics known at every step (without a flush), so rules on them can decide before the update.
STEP_METRICS = ("grad_norm", "loss", "nonfinite")
# Flushes after which a rule's metric that no flush carried, and that is no documented metric,
# is reported as a probable misspelling: sampled probes measure step 0, so every enabled probe's
# metrics are in the first flush; 3 leave room for a first flush that came early.
UNSEEN_METRIC_FLUSHES = 3
_log = logging.getLogger("numwatch")


class RuleEngine:
    def __init__(self, rules: Iterable[Rule], step_level: Iterable[str] = ()) -> None:
        self.rules = [r for r in rules if r.enabled]
        names = [r.name for r in self.rules]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise NumwatchConfigError(f"rules: duplicate rule names {sorted(dupes)}; names are ids")
        step_level = set(step_level)
        for rule in self.rules:
            if rule.name in step_level and rule.metric not in STEP_METRICS:
                raise NumwatchConfigError(
                    f"rules[{rule.name}]: its actions need a decision every step, but metric "
                    f"{rule.metric!r} is only known at flush; use one of {STEP_METRICS}"
                )
        self.step_rules = [r for r in self.rules if r.name in step_level]
        self.flush_rules = [r for r in self.rules if r.name not in step_level]
        self._names_seen: set[str] | None = set()  # None once the metric names were checked
        self._flushes = 0

    def evaluate(
        self, step: int, records: Sequence[MetricRecord], nonfinite: Sequence[Event] = ()
    ) -> list[tuple[Event, Rule]]:
        """Events of one flush, each with the rule that fired."""
        if self._names_seen is not None:
            self._check_metric_names(records)
        fired: list[tuple[Event, Rule]] = []
        wanted = {rule.metric for rule in self.flush_rules}
        by_name: dict[str, list[MetricRecord]] = {name: [] for name in wanted}
        for r in records:  # thousands per flush; few of them are read by a rule
            if r.name in wanted:
                by_name[r.name].append(r)
        keys: dict[str, list[SeriesKey]] = {}
        for rule in self.flush_rules:
            if isinstance(rule, NonfiniteRule):
                fired += [(e, rule) for e in rule.adopt(nonfinite)]
                rule.end_flush()
                continue
            recs = by_name[rule.metric]
            if rule.labels:
                recs = [rec for rec in recs if rule.wants(rec.name, rec.labels)]
                series = [series_key(rec.labels) for rec in recs]
            else:  # rules on one metric share its series keys
                series = keys.get(rule.metric)
                if series is None:
                    series = keys[rule.metric] = [series_key(rec.labels) for rec in recs]
            values = (rec.value for rec in recs)
            for i, finding in rule.observe_all(zip(series, values, strict=True)):
                fired.append((self._event(rule, step, recs[i].labels, finding), rule))
            rule.end_flush()
        return fired

    def evaluate_step(self, step: int, values: Mapping[str, float]) -> list[tuple[Event, Rule]]:
        """Events of one step from the step-level metrics (``STEP_METRICS``)."""
        fired = []
        for rule in self.step_rules:
            if rule.metric in values:
                event = self._observe(rule, step, {}, values[rule.metric])
                if event is not None:
                    fired.append((event, rule))
            rule.end_flush()
        return fired

    def _check_metric_names(self, records: Sequence[MetricRecord]) -> None:
        """Warn once about rules on a metric that no flush carries and numwatch does not
        document: a misspelled name is valid config, and its rule would stay silent for ever."""
        self._names_seen.update(r.name for r in records)
        self._flushes += 1
        if self._flushes < UNSEEN_METRIC_FLUSHES:
            return
        known = self._names_seen | DOCUMENTED_METRICS
        for rule in self.flush_rules:
            if rule.metric not in known and not isinstance(rule, NonfiniteRule):
                close = difflib.get_close_matches(rule.metric, sorted(known), n=3)
                _log.warning(
                    "rule %r reads metric %r, which none of the first %d flushes carried and "
                    "numwatch does not document; closest known metrics: %s",
                    rule.name,
                    rule.metric,
                    self._flushes,
                    ", ".join(close) or "none",
                )
        self._names_seen = None

    @staticmethod
    def _observe(rule: Rule, step: int, labels: Mapping[str, str], value: float) -> Event | None:
        finding = rule.observe(series_key(labels), value)
        return None if finding is None else RuleEngine._event(rule, step, labels, finding)

    @staticmethod
    def _event(rule: Rule, step: int, labels: Mapping[str, str], finding: Finding) -> Event:
        return Event(
            kind=rule.kind,
            step=step,
            message=f"[{rule.name}] {finding.message}",
            severity=rule.severity,
            rule=rule.name,
            metric=rule.metric,
            labels=dict(labels),
            value=finding.value,
            threshold=finding.threshold,
            evidence=finding.evidence,
        )
