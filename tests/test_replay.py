"""`numwatch replay`: rules run offline over a recorded log give the live run's verdicts."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import LONG_LOG_FLUSHES, LONG_LOG_PARAMS, peak_memory

import numwatch
from numwatch.cli import main as cli
from numwatch.config import MonitorConfig, RulesConfig
from numwatch.demo import GPTConfig, TinyGPT, bigram_batches
from numwatch.errors import NumwatchConfigError
from numwatch.replay import replay, summarize
from numwatch.sinks.jsonl import read_jsonl

SPIKE_STEP = 309


def record(step: int, loss: float, events: list | None = None) -> dict:
    return {
        "schema": 1,
        "run": "t",
        "step": step,
        "time": float(step),
        "rank": 0,
        "metrics": [{"name": "loss", "labels": {}, "value": loss}],
        "events": events or [],
    }


def planted_log() -> list[dict]:
    """Flushes every 10 steps: a flat loss, one 5x spike at SPIKE_STEP, then flat again."""
    steps = range(9, 400, 10)
    return [record(s, 5.0 if s == SPIKE_STEP else 1.0 + 0.01 * (s % 3)) for s in steps]


def test_default_rules_find_the_planted_spike_once():
    events = replay(planted_log())
    assert [(e.rule, e.kind, e.step) for e in events] == [
        ("loss_spike", "spike", SPIKE_STEP),
        ("loss_rise", "spike", SPIKE_STEP),
    ]
    assert events[0].time == float(SPIKE_STEP)  # the flush's time, not the replay's
    from numwatch.rules import default_rules

    as_list = replay(planted_log(), default_rules())  # rules themselves, not a RulesConfig
    assert [(e.rule, e.step) for e in as_list] == [(e.rule, e.step) for e in events]
    assert summarize(events) == {
        "loss_spike": {"first_step": SPIKE_STEP, "events": 1},
        "loss_rise": {"first_step": SPIKE_STEP, "events": 1},
    }


def test_loss_rise_sees_a_slow_rise_after_the_early_descent():
    """The shape of the LR-1e-3 bump in bench/results/repro_spike_late_h200 (step 318): the loss
    falls from 6 to 0.04, stays, then climbs over a few flushes. The 6-sigma z-score's window
    still spans the descent; the loss at twice its recent median does not need it to."""
    losses = [6.0 * 0.7**i for i in range(15)] + [0.04] * 15 + [0.05, 0.065, 0.085, 0.12, 0.2]
    log = [record(9 + 10 * i, v) for i, v in enumerate(losses)]
    events = replay(log)
    above = [9 + 10 * i for i, v in enumerate(losses) if i >= 30 and v > 2 * 0.04]
    assert above == [329, 339, 349]
    assert [(e.rule, e.step) for e in events] == [("loss_rise", s) for s in above]


def test_rules_config_adds_disables_and_needs_history():
    flat = RulesConfig(disable=["loss_spike", "loss_rise"])
    assert replay(planted_log(), flat) == []
    threshold = RulesConfig(
        defaults=False,
        add=[{"type": "threshold", "name": "big_loss", "metric": "loss", "threshold": 3.0}],
    )
    assert [(e.rule, e.step) for e in replay(planted_log(), threshold)] == [
        ("big_loss", SPIKE_STEP)
    ]
    # min_history: the z-score rule needs 20 flushes, loss_rise 5: a spike at the 10th flush is
    # loss_rise's alone, one at the 3rd nobody's
    tenth = [record(s, 5.0 if s == 99 else 1.0) for s in range(9, 200, 10)]
    assert [(e.rule, e.step) for e in replay(tenth)] == [("loss_rise", 99)]
    third = [record(s, 5.0 if s == 29 else 1.0) for s in range(9, 200, 10)]
    assert replay(third) == []


def test_logged_nonfinite_events_are_reported():
    nan = {"kind": "nonfinite", "step": 19, "message": "NaN/Inf first seen in the gradient",
           "rule": "nonfinite", "metric": "grad_nonfinite", "labels": {"param": "w"}}  # fmt: skip
    log = [record(9, 1.0), record(19, float("nan"), [nan]), record(29, 1.0)]
    events = replay(log)
    assert [(e.kind, e.rule, e.step, e.labels) for e in events] == [
        ("nonfinite", "nonfinite", 19, {"param": "w"})
    ]
    without = replay(log, RulesConfig(disable=["nonfinite"]))
    assert [(e.kind, e.step) for e in without] == [("nonfinite", 19)]


def _small_run(log, rules):
    """A two-layer model, its SGD and a monitor flushing every step into ``log``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = numwatch.Monitor(model, flush_every=1, activations__every=1, rules=rules,
                               sinks__jsonl__path=str(log),
                               sinks__console__enabled=False).attach(opt)  # fmt: skip
    return model, opt, monitor


def _nan_in_forward_run(log, rules, steps=3):
    """A run whose forward input holds a NaN at step 1 (module '0' first sees it)."""
    model, opt, monitor = _small_run(log, rules)
    for step in range(steps):
        x = torch.randn(2, 4)
        x[0, 0] = float("nan") if step == 1 else x[0, 0]
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.detach()
    return monitor


def test_a_nonfinite_rule_of_another_kind_reports_each_origin_once_live_and_on_replay(tmp_path):
    """A nonfinite rule configured with kind 'anomaly' (not to stop a run on stop_on
    ['nonfinite']): its events had kind 'nonfinite' whatever the config said; once they took
    the configured kind, the monitor saw no adoption and reported every origin a second time,
    as a critical 'nonfinite' event. Replay reads its logged origins as origins."""
    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "kind": "anomaly",
                      "severity": "warning"}]}  # fmt: skip
    log = tmp_path / "run.jsonl"
    monitor = _nan_in_forward_run(log, rules)
    live = [(e.kind, e.rule, e.severity, e.step) for e in monitor.events]
    assert live == [("anomaly", "nonfinite", "warning", 1), ("anomaly", "nonfinite", "warning", 2)]
    replayed = replay(read_jsonl(log))  # the default rules: one critical nonfinite per origin
    assert [(e.kind, e.rule, e.step) for e in replayed] == [
        ("nonfinite", "nonfinite", 1), ("nonfinite", "nonfinite", 2)
    ]  # fmt: skip


def test_a_threshold_rule_of_kind_nonfinite_leaves_the_origin_reported(tmp_path):
    """A user's threshold rule on grad_nonfinite with kind 'nonfinite' counted as adopting the
    monitor's origin event, which was then reported nowhere (log, callbacks, events_total),
    live and on replay."""
    rules = {"disable": ["nonfinite"], "add": [
        {"type": "threshold", "name": "grad_nan", "metric": "grad_nonfinite", "threshold": 0.5,
         "kind": "nonfinite"},
    ]}  # fmt: skip
    log = tmp_path / "run.jsonl"
    monitor = _nan_in_forward_run(log, rules, steps=2)
    origins = [e for e in monitor.events if e.message.startswith("NaN/Inf first seen")]
    assert [(e.rule, e.kind, e.step, e.labels) for e in origins] == [
        ("nonfinite", "nonfinite", 1, {"module": "0"})
    ]
    assert monitor.snapshot().value("events_total", kind="nonfinite", rule="nonfinite") == 1
    replayed = replay(read_jsonl(log), RulesConfig(**rules))
    assert [(e.rule, e.step) for e in replayed if e.rule == "nonfinite"] == [("nonfinite", 1)]


def test_a_step_level_nonfinite_rule_gives_the_origins_its_kind(tmp_path):
    """A skip_step nonfinite rule of kind 'anomaly' (not to stop the run on stop_on
    ['nonfinite']): it fired every step, but at flush the origin went unadopted and was
    reported as a critical 'nonfinite' event, unlike on replay."""
    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "kind": "anomaly",
                      "severity": "warning", "actions": ["skip_step"]}]}  # fmt: skip
    log = tmp_path / "run.jsonl"
    monitor = _nan_in_forward_run(log, rules)
    kinds = {(e.kind, e.severity) for e in monitor.events if e.kind != "action"}
    assert kinds == {("anomaly", "warning")}
    origins = [e for e in monitor.events if e.message.startswith("NaN/Inf first seen")]
    assert [(e.rule, e.step) for e in origins] == [("nonfinite", 1)]
    assert [e.kind for e in monitor.events if e.kind == "action"] == ["action"]  # one skip
    replayed = replay(read_jsonl(log), RulesConfig(**rules))
    assert {(e.kind, e.severity) for e in replayed} == {("anomaly", "warning")}


@pytest.mark.parametrize("metric", ["grad_norm"])
def test_a_step_level_nonfinite_rule_on_a_step_metric_owns_every_origin(tmp_path, metric):
    """A skip_step rule on grad_norm fires on a NaN that began in a forward
    activation: its origin (metric activation_nonfinite) was no 'grad_norm' origin, stayed a
    critical nonfinite event, and replay refused the rule (no origin metric)."""
    rule = {"type": "nonfinite", "name": "nonfinite", "metric": metric, "kind": "anomaly",
            "severity": "warning", "actions": ["skip_step"]}  # fmt: skip
    rules = {"add": [rule]}
    log = tmp_path / "run.jsonl"
    monitor = _nan_in_forward_run(log, rules)
    kinds = {(e.kind, e.severity) for e in monitor.events if e.kind != "action"}
    assert kinds == {("anomaly", "warning")}
    replayed = replay(read_jsonl(log), RulesConfig(**rules))
    assert [(e.kind, e.rule, e.step) for e in replayed] == [("anomaly", "nonfinite", 1)]


def _nan_in_gradient_run(log, rules):
    """A run whose gradient holds a NaN at step 1 (loss finite); the NaN weights make step
    2's loss NaN unless the update was skipped."""
    model, opt, monitor = _small_run(log, rules)
    for step in range(3):
        loss = model(torch.randn(2, 4)).pow(2).mean()
        loss.backward()
        if step == 1:
            model[1].weight.grad[0, 0] = float("nan")
        monitor.step(loss)
        opt.step()
        opt.zero_grad()
    monitor.detach()
    return monitor


def test_a_skip_step_rule_on_the_loss_fires_at_flush_only_where_the_loss_was_nan(tmp_path):
    """Replay and a dry run judged a skip_step rule on the loss as one on any origin: it
    fired at step 1, on a NaN in a gradient only, where the live rule (a finite loss) did not."""
    rules = {"add": [{"type": "nonfinite", "name": "loss_nan", "metric": "loss",
                      "actions": ["skip_step"]}]}  # fmt: skip
    live = _nan_in_gradient_run(tmp_path / "live.jsonl", rules)
    assert sorted({e.step for e in live.events if e.rule == "loss_nan"}) == [2]
    replayed = replay(read_jsonl(tmp_path / "live.jsonl"), RulesConfig(**rules))
    dry = _nan_in_gradient_run(tmp_path / "dry.jsonl", {**rules, "act": False})
    for events in (replayed, dry.events):
        assert [(e.rule, e.step, e.metric) for e in events if e.rule == "loss_nan"] == [
            ("loss_nan", 2, "activation_nonfinite")
        ]  # the origin of step 2 (the NaN weights' forward), the window whose loss was NaN


def test_cli_json_with_a_config_file(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in planted_log()))
    config = tmp_path / "rules.yaml"
    config.write_text(
        "rules:\n  defaults: false\n  add:\n"
        "    - {type: threshold, name: big_loss, metric: loss, threshold: 3.0}\n"
    )
    assert cli(["replay", str(log), "--config", str(config), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["flushes"] == 40 and out["steps"] == [9, 399]
    assert out["by_rule"] == {"big_loss": {"first_step": SPIKE_STEP, "events": 1}}
    assert [e["step"] for e in out["events"]] == [SPIKE_STEP]
    assert cli(["replay", str(log)]) == 0
    text = capsys.readouterr().out
    assert "loss_spike" in text and f"first at step {SPIKE_STEP:>7}" in text
    # a log that is not there is said as report and tail say it, status 1 (2: a refused config)
    assert cli(["replay", str(tmp_path / "missing.jsonl")]) == 1
    assert "no run log at" in capsys.readouterr().err
    assert cli(["replay", str(tmp_path)]) == 1
    assert "it is not a file" in capsys.readouterr().err
    # a path reused by a later run: the last run is replayed (its steps start again), alone
    later = [record(s, 1.0) for s in range(9, 300, 10)]
    with log.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in later))
    assert cli(["replay", str(log), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["runs_in_log"], out["flushes"], out["events"]) == (2, 30, [])


def test_cli_one_run_from_a_log_with_late_events_and_a_crashed_last_line(tmp_path, capsys):
    """A manual flush with no new step repeats the last step, detach's record of late events
    (no metrics) too: one run, and the late record is not a flush. The last line is cut short."""
    action = {"kind": "action", "step": 29, "message": "lr_backoff: x0.5", "rule": "r"}
    log = [record(9, 1.0), record(19, 1.0), record(29, 1.0), record(29, 1.0)]
    log.append(dict(record(29, 1.0, [action]), metrics=[]))
    path = tmp_path / "run.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in log) + json.dumps(record(39, 1.0))[:40]
    path.write_text(text)
    assert cli(["replay", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["runs_in_log"], out["flushes"], out["steps"]) == (1, 4, [9, 29])


def test_cli_reads_a_long_log_record_by_record(long_log, capsys):
    """Each run's records stream past the rules: a long log held as records took about 10x its
    size in memory (960 MB for a 95 MB log)."""
    rc, peak = peak_memory(lambda: cli(["replay", str(long_log), "--json"]))
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["flushes"] == LONG_LOG_FLUSHES
    assert out["steps"] == [0, 10 * (LONG_LOG_FLUSHES - 1)]
    assert peak < 10 * LONG_LOG_FLUSHES * LONG_LOG_PARAMS, peak  # the records: ~500 B a point


def test_replay_of_a_live_log_gives_the_live_events(tmp_path):
    """Every rule kind that fires on a real run fires again, at the same flushes and series."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=16, seq_len=8, d_model=16, n_heads=2, n_layers=2)
    model = TinyGPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    rules = {
        "act": False,
        "add": [
            # per head, at most flushes: labels and series keys must line up
            dict(type="threshold", name="logits", metric="attn_max_logit", threshold=0.2),
            dict(
                type="zscore",
                name="loss_z",
                metric="loss",
                sigma=0.5,
                min_history=2,
                direction="both",
            ),
            dict(type="growth", name="grad_growth", metric="grad_norm", factor=1.01, min_history=2),
        ],
    }
    log = tmp_path / "run.jsonl"
    monitor = numwatch.Monitor(
        model,
        flush_every=2,
        attention__every=1,
        rules=rules,
        sinks__jsonl__path=str(log),
        sinks__console__enabled=False,
        sinks__prometheus__enabled=False,
    ).attach(opt)
    data = bigram_batches(cfg, 4)
    for _ in range(24):
        x, y = next(data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        monitor.step(loss)
        opt.step()
        opt.zero_grad()
    monitor.detach()

    def key(e):
        return e.rule, e.kind, e.step, tuple(sorted(e.labels.items())), e.value

    live = [key(e) for e in monitor.events if e.kind != "action"]
    again = [key(e) for e in replay(read_jsonl(log), monitor.config.rules)]
    assert {k[0] for k in live} == {"logits", "loss_z", "grad_growth"}  # all three fired
    assert again == live


def test_cli_json_is_strict_json_with_an_infinite_value(tmp_path, capsys):
    """A rule firing on an inf loss: --json wrote a bare Infinity, which strict parsers reject."""
    log = tmp_path / "run.jsonl"
    records = [record(9, 1.0), record(19, 1.0), {**record(29, 1.0), "metrics": [
        {"name": "loss", "labels": {}, "value": "inf"}]}]  # fmt: skip
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = tmp_path / "rules.yaml"
    config.write_text(
        "rules:\n  defaults: false\n  add:\n"
        "    - {type: threshold, name: big_loss, metric: loss, threshold: 3.0}\n"
    )
    assert cli(["replay", str(log), "--config", str(config), "--json"]) == 0

    def strict(constant):
        raise ValueError(f"not JSON: {constant}")

    out = json.loads(capsys.readouterr().out, parse_constant=strict)
    assert [e["value"] for e in out["events"]] == ["inf"]


def test_replay_refuses_a_config_the_monitor_would_refuse(tmp_path, capsys):
    """Actions were validated by Monitor() only: replay --config (and MonitorConfig.load)
    accepted a bad action setting, a misspelled action, or a cooldown on a skip_step rule."""
    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps(record(9, 1.0)) + "\n")
    for action, cooldown, says in (
        ("{type: swap_attention_kernel, split_sum: maybe}", 0, "split_sum"),
        ("swap_attention_kernal", 0, "unknown action"),
        ("skip_step", 3, "leave cooldown at 0"),
    ):
        config = tmp_path / "rules.yaml"
        config.write_text(
            "rules:\n  add:\n    - {name: r, metric: loss, type: threshold, threshold: 0.1, "
            f"cooldown: {cooldown}, actions: [{action}]}}\n"
        )
        assert cli(["replay", str(log), "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert says in err and f"(from config file {str(config)!r})" in err, err


def test_replay_refuses_a_skip_step_rule_that_could_not_decide_every_step(tmp_path, capsys):
    """What a skip_step rule needs (a metric known every step, no labels) was checked only by
    the engine the monitor builds: replay --config and MonitorConfig.load accepted both."""
    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps(record(9, 1.0)) + "\n")
    config = tmp_path / "rules.yaml"
    for setting, says in (
        ("metric: attn_max_logit", "'attn_max_logit' is only known at flush"),
        ("metric: loss, labels: {layer: x}", "drop 'labels'"),
    ):
        config.write_text(
            "rules:\n  add:\n    - {name: r, type: threshold, threshold: 0.1, "
            f"{setting}, actions: [skip_step]}}\n"
        )
        assert cli(["replay", str(log), "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert "rules[r]: its actions need a decision every step" in err and says in err, err
        with pytest.raises(NumwatchConfigError, match=re.escape(says)):
            MonitorConfig.load(str(config))


def test_a_dry_run_accepts_a_skip_step_nonfinite_rule_on_the_gradient_norm():
    """rules.act false (events only): the skip_step rule on grad_norm, valid live, was
    refused ('a nonfinite rule at flush selects origins by metric')."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rule = {"type": "nonfinite", "name": "nan_skip", "metric": "grad_norm",
            "actions": ["skip_step"]}  # fmt: skip
    monitor = numwatch.Monitor(
        model, rules__add=[rule], rules__act=False, flush_every=1,
        sinks__console__enabled=False, sinks__jsonl__enabled=False,
    )  # fmt: skip
    monitor.attach(opt)
    model(torch.full((2, 4), float("nan"))).sum().backward()
    opt.step()
    assert {e.rule for e in monitor.events} == {"nan_skip", "nonfinite"}  # the default's too
    assert not monitor.errors
    monitor.detach()


def test_replay_of_a_file_with_no_flush_records_fails(tmp_path, capsys):
    """An empty file, or bytes that are no log, read '0 flushes; 0 events' with exit 0: a
    script checking a rule's false alarms took it as a pass."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    garbage = tmp_path / "notes.jsonl"
    garbage.write_text("not a log\n")
    for path in (empty, garbage):
        assert cli(["replay", str(path)]) == 1
        assert "holds no flush records" in capsys.readouterr().err


def test_a_resumed_run_replays_with_the_rules_starting_over_as_they_did_live(tmp_path):
    """A run resumed in a new process (same run_name, its steps going on) appends to one log:
    replay carried the first part's rule history into the second and raised events the live
    rules, which started empty, never did."""
    log = tmp_path / "exp.jsonl"
    rules = {"defaults": False, "add": [{"type": "growth", "name": "loss_rise", "metric": "loss",
                                         "factor": 2.0, "window": 5}]}  # fmt: skip
    live = []
    for first_step, losses in ((0, [1.0] * 10), (10, [3.0] * 3 + [1.0] * 7)):
        model = torch.nn.Linear(2, 1)
        monitor = numwatch.Monitor(
            model, run_name="exp", first_step=first_step, flush_every=1, rules=rules,
            sinks__jsonl__path=str(log), sinks__console__enabled=False,
        ).attach()  # fmt: skip
        for loss in losses:
            model(torch.ones(1, 2)).sum().backward()
            monitor.step(loss)
        monitor.detach()
        live += [(e.rule, e.step) for e in monitor.events]
    records = read_jsonl(log)
    assert len({r["monitor"] for r in records}) == 2
    assert live == []
    assert replay(records, RulesConfig(**rules)) == []
    # one monitor's records (the same run without the restart): the history carries over
    one = [{**r, "monitor": "m"} for r in records]
    assert [(e.rule, e.step) for e in replay(one, RulesConfig(**rules))] == [
        ("loss_rise", 10), ("loss_rise", 11), ("loss_rise", 12)
    ]  # fmt: skip
