"""`numwatch replay RUN.jsonl`: run a rules configuration over a recorded run log, offline.

Why: to tune a rule against an incident that is already logged, or to count a new rule's false
alarms on a healthy run, without training again. Each flush's metrics reach the rules in order,
as they did live, so a rule gives the verdicts it would have given on that run; its history is
the flushes in the log (a log written with ``sinks.jsonl.every`` > 1, or with metrics excluded,
holds less than the live rules saw).

A log whose path a later run reused holds several runs; the command replays the last, as
`numwatch report` shows the last. Actions do not run: a replay cannot change the run it reads,
so a run that was mitigated live replays as mitigated. Rules whose actions decide every step
(skip_step) are evaluated at flush granularity here, like the others. Non-finite events come
from the log: only the live run knew where a NaN started.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from itertools import groupby
from pathlib import Path
from typing import Any

from numwatch.cli import count
from numwatch.config import MonitorConfig, RulesConfig
from numwatch.errors import NumwatchError
from numwatch.events import Event
from numwatch.rules import (
    Rule,
    RuleEngine,
    at_flush,
    configured_rules,
    is_origin,
    unadopted,
)
from numwatch.sinks.jsonl import RunBoundaries, is_flush, iter_jsonl, json_safe
from numwatch.sinks.tail import record_to_snapshot
from numwatch.snapshot import MetricRecord

__all__ = ["main", "replay", "summarize"]


def replay(
    records: Iterable[dict[str, Any]], rules: RulesConfig | Sequence[Rule] | None = None
) -> list[Event]:
    """Events that ``rules`` (default: the default rule set) raise on one run's records, in order.

    ``rules``: a ``RulesConfig``, or rules themselves (``default_rules()``, or your own list).
    ``records``: parsed JSONL records (``read_jsonl`` or, read one by one, ``iter_jsonl``) of
    one run; a log whose path was reused holds several (``RunBoundaries`` says where each begins).
    Each event carries the time of the flush that raised it."""
    if isinstance(rules, (list, tuple)):  # validated as config: two with one name are refused
        rules = MonitorConfig.validated({"rules": {"defaults": False, "add": list(rules)}}).rules
    cfg = rules or RulesConfig()
    out: list[Event] = []
    monitor = None
    for record in records:
        if not is_flush(record):  # late events of a detach: actions, nothing to evaluate
            continue
        if monitor is None or record.get("monitor", "") != monitor:
            # a new monitor (a resumed run's process) started its rules and counts over
            monitor = record.get("monitor", "")
            engine = RuleEngine(map(at_flush, configured_rules(cfg).values()))  # new state
            counts: Counter[tuple[str, str]] = Counter()  # events_total, as replayed
            judged = None  # as live: a second flush of one step adds no observation
        snapshot, logged = record_to_snapshot(record)
        nonfinite = _origins(logged)
        overflows = [e for e in logged if e.evidence.get("scaler_overflow") is True]  # the
        # monitor's own (a user's rule may have the name), as made
        mitigation = [r for r in snapshot if r.name.startswith("mitigation_")]  # the live run's

        made = partial(_with_monitors, nonfinite=nonfinite, overflows=overflows)
        late = partial(_late_records, counts=counts, made=made, mitigation=mitigation)
        fired: list[Event] = []
        if snapshot.step != judged:
            judged = snapshot.step
            fired = [e for e, _ in engine.evaluate(snapshot.step, list(snapshot), nonfinite, late)]
        fired = made(fired)
        counts.update((e.kind, e.rule) for e in fired)
        out += [dataclasses.replace(e, time=record["time"]) for e in fired]
    return out


def _with_monitors(
    fired: Sequence[Event], nonfinite: Sequence[Event], overflows: Sequence[Event]
) -> list[Event]:
    """A flush's rule events plus the monitor's own, as the live monitor reports them."""
    return [*fired, *unadopted(nonfinite, fired), *overflows]


def _late_records(
    so_far: Sequence[Event],
    counts: Counter[tuple[str, str]],
    made: Callable[[Sequence[Event]], list[Event]],
    mitigation: list[MetricRecord],
) -> list[MetricRecord]:
    """events_total from the replayed events (the logged counts hold the live rules'), this
    flush's own included, as the live rules on it see them; mitigation_* as logged."""
    now = counts + Counter((e.kind, e.rule) for e in made(so_far))
    totals = [
        MetricRecord("events_total", {"kind": kind, "rule": rule}, float(n))
        for (kind, rule), n in sorted(now.items())
    ]
    return totals + mitigation


def _origins(logged: Sequence[Event]) -> list[Event]:
    """The monitor's NaN/Inf origins of a flush, once each: every nonfinite rule of the live
    run logged its own copy (fed back as they are, N rules replayed as N^2 events), and a
    step-level rule's event ("NaN/Inf in the step's gradients") is no origin."""
    seen: dict[tuple, Event] = {}
    for e in logged:
        # (a rule's copy has the kind the rule gives it; a GradScaler overflow is no origin)
        if is_origin(e) and (e.kind != "action") and not e.evidence.get("scaler_overflow"):
            key = (e.step, e.metric, tuple(sorted(e.labels.items())), e.evidence.get("phase"))
            seen.setdefault(
                key, dataclasses.replace(e, kind="nonfinite", rule="nonfinite", severity="critical")
            )
    return list(seen.values())


def summarize(events: Sequence[Event]) -> dict[str, dict[str, int]]:
    """Per rule: the step of its first event and how many it raised."""
    out: dict[str, dict[str, int]] = {}
    for e in events:
        entry = out.setdefault(e.rule, {"first_step": e.step, "events": 0})
        entry["events"] += 1
    return out


class _RunNumber:
    """groupby key: which run of the log a record belongs to (``RunBoundaries``)."""

    def __init__(self) -> None:
        self.number = -1
        self.boundaries = RunBoundaries()

    def __call__(self, record: dict[str, Any]) -> int:
        self.number += self.boundaries.starts(record)
        return self.number


@dataclasses.dataclass
class _Tally:
    """What the summary says of a run, counted as its records stream past the rules."""

    flushes: int = 0
    steps: list[int] = dataclasses.field(default_factory=list)  # [first, last] flushed step
    logged: int = 0

    def count(self, records: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for record in records:
            if is_flush(record):
                self.flushes += 1
                self.steps = [self.steps[0] if self.steps else record["step"], record["step"]]
            self.logged += sum(e["kind"] != "action" for e in record["events"])
            yield record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="numwatch replay",
        description="Run a rules configuration over a recorded JSONL run log (no actions run).",
    )
    p.add_argument("log", help="the run's JSONL log (.gz and .xz are read too)")
    p.add_argument(
        "--config",
        help="numwatch YAML config whose 'rules' section is replayed (default: the default rules)",
    )
    p.add_argument("--limit", type=count, default=40, help="events listed (0: all); JSON lists all")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    try:
        rules = MonitorConfig.from_yaml(args.config).rules if args.config else RulesConfig()
    except (NumwatchError, OSError, ValueError, KeyError) as err:
        print(f"numwatch replay: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    log = Path(args.log)
    if not log.is_file():  # as report and tail say it (status 2 is for a refused config)
        what = "is not a file" if log.exists() else "does not exist"
        print(f"numwatch replay: no run log at {args.log!r}: it {what}", file=sys.stderr)
        return 1
    try:
        # Record by record, each run in turn (a long log does not fit in memory as records):
        # the last run's verdicts are kept, as `report` shows the last run.
        runs, events, tally = 0, [], _Tally()
        for number, group in groupby(iter_jsonl(log), key=_RunNumber()):
            runs, tally = number + 1, _Tally()
            events = replay(tally.count(group), rules)
    except NumwatchError as err:  # rules the monitor would refuse
        print(f"numwatch replay: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as err:  # unreadable, or a plain file named .gz
        print(f"numwatch replay: {err}", file=sys.stderr)
        return 1
    if not tally.flushes:  # an empty file, or no log: "0 events" would read as a pass
        print(
            f"numwatch replay: {args.log} holds no flush records (an empty file, or not a "
            "numwatch log)",
            file=sys.stderr,
        )
        return 1
    steps, logged = tally.steps, tally.logged
    summary = summarize(events)
    if args.json:
        result = {
            "log": args.log,
            "runs_in_log": runs,
            "flushes": tally.flushes,
            "steps": [min(steps), max(steps)] if steps else None,
            "logged_events": logged,
            "by_rule": summary,
            "events": [e.to_dict() for e in events],
        }
        print(json.dumps(json_safe(result), default=str, allow_nan=False))
        return 0
    span = f", steps {min(steps)}-{max(steps)}" if steps else ""
    last = f" (the last of {runs} runs in the log)" if runs > 1 else ""
    print(f"{args.log}: {tally.flushes} flushes{last}{span}; {len(events)} events on replay")
    print(f"(the live run logged {logged} events, actions aside, with its own configuration)")
    shown = events if args.limit == 0 else events[: args.limit]
    for e in shown:
        labels = ",".join(f"{k}={v}" for k, v in e.labels.items())
        print(f"  step {e.step:>7}  {e.kind:<9} {e.rule:<28} {labels:<28} {e.message}")
    if len(shown) < len(events):
        print(f"  ... {len(events) - len(shown)} more (--limit 0 lists all)")
    for rule, entry in sorted(summary.items(), key=lambda kv: kv[1]["first_step"]):
        print(f"{rule:<30} first at step {entry['first_step']:>7}, {entry['events']} events")
    return 0
