"""Spike rules replayed over the committed H200 run logs: which fire, when, and which should not.

`numwatch replay` runs each candidate rule alone over every log in bench/results/repro_*h200*/
(flushes every 10 steps) and records the steps of its events. A run whose loss never doubled
over its running median (the 2x divergence rule of bench/_repro.py, read from the run's JSON
next to its log) should raise no event from a loss rule; in the others, the question is how
early the first one comes. CPU only: the logs are data.

``--cadence N`` keeps one flush per N steps of each log whose flushes came more often: with 50 the
rules see what they would at the default cadence (a flush's ``loss`` is its last step's; a rule's
window counts flushes, so it spans 5x the steps of a 10-step log). ``loss_max`` (the largest loss
of a flush's steps) is in the logs of session 14 on only.

    python bench/replay_rules.py --out bench/results/rules_replay_h200_logs.json
    python bench/replay_rules.py --cadence 50 \
        --out bench/results/rules_replay_h200_logs_cadence50.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from numwatch.config import RulesConfig
from numwatch.replay import replay
from numwatch.sinks.jsonl import read_jsonl, run_starts

RESULTS = Path(__file__).resolve().parent / "results"
# "loss_rise" here is session 13's default (20 flushes); the default now is "loss_rise_w5".
CANDIDATES = {
    "loss_spike": {"type": "zscore", "metric": "loss", "sigma": 6.0, "window": 50},
    "loss_rise": {"type": "growth", "metric": "loss", "factor": 2.0, "window": 20},
    "loss_rise_3x": {"type": "growth", "metric": "loss", "factor": 3.0, "window": 20},
    "loss_rise_w5": {"type": "growth", "metric": "loss", "factor": 2.0, "window": 5},
    "loss_max_rise": {"type": "growth", "metric": "loss_max", "factor": 2.0, "window": 20},
    "loss_max_rise_w5": {"type": "growth", "metric": "loss_max", "factor": 2.0, "window": 5},
    "grad_norm_spike": {"type": "zscore", "metric": "grad_norm", "sigma": 6.0, "window": 50},
}


def divergence_of(log: Path) -> int | None:
    """The run's divergence step from the reproduction's JSON beside its folder (None: never,
    or not recorded)."""
    summary = log.parent.with_suffix(".json")
    if not summary.exists():
        return None
    runs = json.loads(summary.read_text()).get("runs", {})
    return runs.get(log.name.split(".")[0], {}).get("divergence_step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cadence", type=int, default=0, help="keep one flush per N steps (0: all)")
    args = p.parse_args()
    metrics = {spec["metric"] for spec in CANDIDATES.values()}
    report = {
        "benchmark": "spike rules replayed over the H200 reproduction logs",
        "candidates": CANDIDATES,
        "cadence": args.cadence or "as logged",
        "runs": {},
    }
    for log in sorted(RESULTS.glob("repro_*h200*/*.jsonl.xz")):
        records = read_jsonl(log)
        records = records[run_starts(records)[-1] :]  # one run per log; the last if reused
        logged = records[1]["step"] - records[0]["step"] if len(records) > 1 else 1
        every = max(1, args.cadence // logged) if args.cadence else 1
        records = records[every - 1 :: every]
        for r in records:  # only what the candidates read: the replays run ~50x faster
            r["metrics"] = [m for m in r["metrics"] if m["name"] in metrics]
        row = {"flushes": len(records), "cadence": logged * every}
        row["divergence_step"] = divergence_of(log)
        for name, spec in CANDIDATES.items():
            rules = RulesConfig(defaults=False, add=[{**spec, "name": name}])
            row[name] = [e.step for e in replay(records, rules)]
        key = str(log.relative_to(RESULTS))
        report["runs"][key] = row
        print(key, {k: (v[:3] if isinstance(v, list) else v) for k, v in row.items()}, flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
