"""Runs the configured rules over each flush (and, for step-level rules, over each step)."""

from __future__ import annotations

import difflib
import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from numwatch.errors import NumwatchConfigError
from numwatch.events import Event
from numwatch.rules.base import Finding, Rule, SeriesKey
from numwatch.rules.nonfinite import NonfiniteRule
from numwatch.sinks.prometheus import DOCUMENTED_METRICS
from numwatch.snapshot import MetricRecord, series_key

__all__ = ["LATE_METRICS", "ORIGIN_METRICS", "STEP_METRICS", "RuleEngine", "check_step_rule"]

# Metrics known at every step (without a flush), so rules on them can decide before the update.
STEP_METRICS = ("grad_norm", "loss", "nonfinite")
# Metrics that count what the rules and actions did: rules on them run after the others, on
# counts that include the events of this flush's other rules.
LATE_METRICS = ("events_total", "mitigation_skipped_steps_total", "mitigation_lr_factor")
# What a flush-level nonfinite rule can select by ``metric``: where the NaN/Inf began.
ORIGIN_METRICS = ("nonfinite", "activation_nonfinite", "grad_nonfinite", "loss")
# Flushes after which a rule's metric that no flush carried, and that is no documented metric,
# is reported as a probable misspelling: sampled probes measure step 0, so every enabled probe's
# metrics are in the first flush; 3 leave room for a first flush that came early.
UNSEEN_METRIC_FLUSHES = 3
_log = logging.getLogger("numwatch")


def at_flush(rule: Rule) -> Rule:
    """``rule`` as evaluated at flush granularity (replay; a dry run, ``rules.act`` false, that
    runs no skip_step): a nonfinite rule with skip_step as ``NonfiniteRule.at_flush`` says."""
    if isinstance(rule, NonfiniteRule) and rule.skips_steps:
        return rule.at_flush()
    return rule


def check_step_rule(rule: Rule) -> None:
    """Refuse a rule whose actions (skip_step) need a decision every step, but which could not
    make one there: ``RulesConfig`` checks with it, so ``replay --config`` and
    ``MonitorConfig.load`` refuse what ``Monitor`` refuses."""
    if rule.metric not in STEP_METRICS:
        raise NumwatchConfigError(
            f"rules[{rule.name}]: its actions need a decision every step, but metric "
            f"{rule.metric!r} is only known at flush; use one of {STEP_METRICS}"
        )
    if rule.labels:
        raise NumwatchConfigError(
            f"rules[{rule.name}]: its actions need a decision every step, from the "
            f"step's global {rule.metric}, which has no labels to select; drop "
            f"'labels' (origins are named at flush)"
        )
    if rule.cooldown:
        raise NumwatchConfigError(
            f"rules[{rule.name}]: a rule with skip_step decides every step; a cooldown "
            f"({rule.cooldown}) would let the updates of the steps it is quiet through "
            "(its NaN or spike would reach the weights): leave cooldown at 0"
        )


def is_origin(event: Event) -> bool:
    """Whether ``event`` is a NaN/Inf origin of the monitor's, or a nonfinite rule's copy of
    one: the copy keeps its evidence (``phase``) whatever ``kind`` the rule gives it (logs
    before the phase was logged: its message). A threshold rule of kind ``nonfinite`` on a
    NaN count is none: it took over the origins and they went unreported."""
    return "phase" in event.evidence or event.message.startswith("NaN/Inf first seen")


def unadopted(nonfinite: Sequence[Event], fired: Sequence[Event]) -> list[Event]:
    """The monitor's NaN/Inf origin events that no nonfinite rule fired on (none enabled, or
    one selecting other origins): reported all the same, and counted in ``events_total``."""
    adopted = any(is_origin(e) and e.kind != "action" for e in fired)
    return [] if adopted else list(nonfinite)


class RuleEngine:
    """``run(fn, *args)`` calls each rule (default: directly); the monitor passes its guard, so
    a rule that raises is counted and skipped for that flush while the others still fire."""

    def __init__(
        self,
        rules: Iterable[Rule],
        step_level: Iterable[str] = (),
        run: Callable[..., Any] | None = None,
    ) -> None:
        self._run = run or (lambda fn, *args: fn(*args))
        self.rules = [r for r in rules if r.enabled]
        names = [r.name for r in self.rules]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise NumwatchConfigError(f"rules: duplicate rule names {sorted(dupes)}; names are ids")
        step_level = set(step_level)
        for rule in self.rules:
            if rule.name in step_level:
                check_step_rule(rule)
        self.step_rules = [r for r in self.rules if r.name in step_level]
        self.flush_rules = [r for r in self.rules if r.name not in step_level]
        for rule in self.flush_rules:
            if isinstance(rule, NonfiniteRule) and rule.metric not in ORIGIN_METRICS:
                raise NumwatchConfigError(
                    f"rules[{rule.name}]: a nonfinite rule at flush selects origins by metric, "
                    f"one of {ORIGIN_METRICS}; got {rule.metric!r}"
                )
        # rules on what the others did run last (see LATE_METRICS)
        self.flush_rules.sort(key=lambda r: r.metric in LATE_METRICS)
        self._names_seen: set[str] | None = set()  # None once the metric names were checked
        # metrics a rule filters by label (a nonfinite rule's labels select origins, not series),
        # and the label keys their series carried, until the metric names were checked
        self._labelled = {
            r.metric for r in self.flush_rules if r.labels and not isinstance(r, NonfiniteRule)
        }
        self._label_keys: dict[str, set[str]] = {}
        self._flushes = 0
        self._step_fired: set[str] = set()  # nonfinite step rules that fired since the flush

    def evaluate(
        self,
        step: int,
        records: Sequence[MetricRecord],
        nonfinite: Sequence[Event] = (),
        late: Callable[[Sequence[Event]], Sequence[MetricRecord]] | None = None,
    ) -> list[tuple[Event, Rule | None]]:
        """Events of one flush, each with the rule that fired (None: no action to run).
        ``late(events so far)`` gives the ``LATE_METRICS`` records once the other rules ran
        (default: those in ``records``)."""
        if self._names_seen is not None:
            self._check_metric_names(records)
        fired: list[tuple[Event, Rule | None]] = []
        # A nonfinite rule deciding every step (skip_step) that fired on this window's NaN
        # owns its origins: they take its kind and severity (a kind 'anomaly' chosen not to stop
        # the run on stop_on ['nonfinite'] still did), without running its actions again.
        for rule in self.step_rules:
            if isinstance(rule, NonfiniteRule) and rule.name in self._step_fired:
                fired += [(e, None) for e in self._run(rule.own, nonfinite, True) or []]
        self._step_fired.clear()
        wanted = {rule.metric for rule in self.flush_rules} | {"loss_mean"}
        by_name: dict[str, list[MetricRecord]] = {name: [] for name in wanted}
        for r in records:  # thousands per flush; few of them are read by a rule
            if r.name in wanted:
                by_name[r.name].append(r)
        keys: dict[str, list[SeriesKey]] = {}
        counted = late is None
        for rule in self.flush_rules:
            if not counted and rule.metric in LATE_METRICS:
                counted = True
                for name in LATE_METRICS:
                    by_name[name] = []
                late_records = late([e for e, _ in fired])
                if self._names_seen is not None:
                    self._note_label_keys(late_records)
                for r in late_records:
                    if r.name in wanted:
                        by_name[r.name].append(r)
            if isinstance(rule, NonfiniteRule):
                window_loss = by_name["loss_mean"][0].value if by_name["loss_mean"] else None
                events = self._run(rule.adopt, nonfinite, window_loss) or []
            else:
                events = self._run(self._flush_events, rule, step, by_name[rule.metric], keys)
            fired += [(e, rule) for e in events or []]
            rule.end_flush()
        return fired

    def _flush_events(
        self,
        rule: Rule,
        step: int,
        recs: list[MetricRecord],
        keys: dict[str, list[SeriesKey]],
    ) -> list[Event]:
        if rule.labels:
            recs = [rec for rec in recs if rule.wants(rec.name, rec.labels)]
            series = [series_key(rec.labels) for rec in recs]
        else:  # rules on one metric share its series keys
            series = keys.get(rule.metric)
            if series is None:
                series = keys[rule.metric] = [series_key(rec.labels) for rec in recs]
        values = (rec.value for rec in recs)
        return [
            self._event(rule, step, recs[i].labels, finding)
            for i, finding in rule.observe_all(zip(series, values, strict=True))
        ]

    def evaluate_step(self, step: int, values: Mapping[str, float]) -> list[tuple[Event, Rule]]:
        """Events of one step from the step-level metrics (``STEP_METRICS``)."""
        fired = []
        for rule in self.step_rules:
            if rule.metric in values:
                event = self._run(self._observe, rule, step, {}, values[rule.metric])
                if event is not None:
                    fired.append((event, rule))
                    self._step_fired.add(rule.name)
            rule.end_flush()
        return fired

    @property
    def judges_evaluations(self) -> bool:
        """A step-level nonfinite rule judges later closure calls too (``judge_evaluation``)."""
        return any(isinstance(r, NonfiniteRule) for r in self.step_rules)

    def judge_evaluation(self, step: int, values: Mapping[str, float]) -> list[tuple[Event, Rule]]:
        """Events of the step-level nonfinite rules on a later closure call of ``step`` (SAM's
        gradients at its perturbed weights: the update uses them too), from that call's
        values: each fires on a non-finite value of its metric. Their history is left as it
        is: the step was observed once, when it closed."""
        fired = []
        for rule in self.step_rules:
            if isinstance(rule, NonfiniteRule) and rule.metric in values:
                finding = self._run(rule.check, deque(), values[rule.metric])
                if finding is not None:
                    fired.append((self._event(rule, step, {}, finding), rule))
                    self._step_fired.add(rule.name)
        return fired

    def _check_metric_names(self, records: Sequence[MetricRecord]) -> None:
        """Warn once about rules on a metric that no flush carries and numwatch does not
        document, or filtering by a label key its series do not carry: a misspelled name is
        valid config, and its rule would stay silent for ever."""
        self._names_seen.update(r.name for r in records)
        self._note_label_keys(records)
        self._flushes += 1
        if self._flushes < UNSEEN_METRIC_FLUSHES:
            return
        for rule in self.flush_rules:
            keys = self._label_keys.get(rule.metric)
            missing = [] if keys is None else sorted(set(rule.labels) - keys)
            if missing and not isinstance(rule, NonfiniteRule):
                _log.warning(
                    "rule %r selects by label %s, which no series of metric %r carried in the "
                    "first %d flushes (a missing label reads as ''); its labels: %s",
                    rule.name,
                    ", ".join(map(repr, missing)),
                    rule.metric,
                    self._flushes,
                    ", ".join(sorted(keys)) or "none",
                )
        self._label_keys = {}
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

    def _note_label_keys(self, records: Iterable[MetricRecord]) -> None:
        """Add the label keys of the series of metrics that a rule filters by label (a missing
        key reads as '', so a misspelled one matches nothing)."""
        for r in records:
            if r.name in self._labelled:
                self._label_keys.setdefault(r.name, set()).update(r.labels)

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
