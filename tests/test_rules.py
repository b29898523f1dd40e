"""Rules: each type fires on planted series and stays quiet on healthy ones."""

from __future__ import annotations

import math
import random
import re
from collections import deque

import pytest

from numwatch.config import MonitorConfig, RulesConfig
from numwatch.errors import NumwatchConfigError
from numwatch.replay import replay
from numwatch.rules import (
    GrowthRule,
    NonfiniteRule,
    PersistenceRule,
    RuleEngine,
    ThresholdRule,
    TrendRule,
    ZScoreRule,
    configured_rules,
    default_rules,
)
from numwatch.snapshot import MetricRecord


def feed(rule, values, key=()):
    """Indices of the flushes at which ``rule`` fires on ``values``."""
    fired = []
    for i, v in enumerate(values):
        if rule.observe(key, v) is not None:
            fired.append(i)
        rule.end_flush()
    return fired


def test_threshold_with_hold_and_cooldown():
    rule = ThresholdRule(name="t", metric="m", threshold=10, for_flushes=2, cooldown=2)
    assert feed(rule, [11, 5, 11, 12, 13, 14, 15, 16, 9]) == [3, 6]
    assert feed(ThresholdRule(name="a", metric="m", threshold=1, op="abs>"), [-2, 0.5]) == [0]
    assert feed(ThresholdRule(name="n", metric="m", threshold=1), [math.nan]) == []


def test_growth_against_median_and_ema():
    rule = GrowthRule(name="g", metric="m", factor=3, min_history=5)
    assert feed(rule, [1, 1.1, 0.9, 1, 1, 2.9, 3.5, 1]) == [6]
    ema = GrowthRule(name="e", metric="m", factor=3, baseline="ema", min_history=3)
    assert feed(ema, [1, 1, 1, 1, 4]) == [4]


def test_zscore_fires_on_spike_not_on_long_healthy_noise():
    rng = random.Random(0)
    healthy = [1.0 + 0.1 * rng.gauss(0, 1) for _ in range(20_000)]
    rule = ZScoreRule(name="z", metric="grad_norm", sigma=6, window=50, min_history=20)
    false_alarms = feed(rule, healthy)
    # Gaussian noise: P(z > 6) ~ 1e-9 per flush; the rolling estimate of sigma from 50 samples
    # adds heavier tails, still well under one alarm in 20k flushes (measured: 0).
    assert false_alarms == []
    spiked = [*healthy[:100], 5.0, *healthy[100:150]]
    assert feed(ZScoreRule(name="z", metric="m"), spiked) == [100]
    ema = ZScoreRule(name="ze", metric="m", ema=0.05, sigma=6)
    assert feed(ema, spiked) == [100]


def test_trend_on_exponential_growth_only():
    grow = [10 * 1.2**i for i in range(12)]
    rule = TrendRule(name="tr", metric="m", window=10, min_slope=0.1)
    assert feed(rule, grow) == [9, 10, 11]
    flat = [10 + (i % 2) for i in range(30)]
    assert feed(TrendRule(name="f", metric="m", window=10, min_slope=0.1), flat) == []
    floor = TrendRule(name="fl", metric="m", window=10, min_slope=0.1, min_value=60)
    assert feed(floor, grow) == [10, 11]  # 10*1.2^10 = 62 >= 60


def test_persistence_of_one_signed_bias():
    rule = PersistenceRule(name="p", metric="attn_output_bias", flushes=4, min_abs=0.5)
    assert feed(rule, [-0.9, -0.8, -0.95, -0.7, -0.9]) == [3, 4]
    noisy = PersistenceRule(name="q", metric="m", flushes=4, min_abs=0.5)
    assert feed(noisy, [-0.9, 0.8, -0.95, 0.7, -0.9, 0.6]) == []
    small = PersistenceRule(name="s", metric="m", flushes=4, min_abs=0.5)
    assert feed(small, [-0.1, -0.2, -0.1, -0.3]) == []


def test_nonfinite_rule_per_step():
    rule = NonfiniteRule(name="nf")
    assert feed(rule, [1.0, math.inf, 2.0, math.nan]) == [1, 3]
    # the message says what the per-step value is, not the metric's internal name
    assert rule.check(deque(), math.nan).message == "NaN/Inf in the step's gradients or loss (nan)"
    other = NonfiniteRule(name="nf", metric="loss")
    assert other.check(deque(), math.inf).message == "non-finite loss (inf)"


def test_engine_label_filters_and_events():
    rule = ThresholdRule(
        name="logit", metric="attn_max_logit", threshold=100, labels={"layer": "blocks.1.*"}
    )
    engine = RuleEngine([rule])
    records = [
        MetricRecord("attn_max_logit", {"layer": "blocks.0.attn", "head": "0"}, 500.0),
        MetricRecord("attn_max_logit", {"layer": "blocks.1.attn", "head": "3"}, 200.0),
        MetricRecord("attn_max_logit", {"layer": "blocks.1.attn", "head": "2"}, 50.0),
    ]
    fired = engine.evaluate(7, records)
    assert len(fired) == 1
    event, by = fired[0]
    assert by is rule
    assert (event.kind, event.step, event.rule, event.value, event.threshold) == (
        "precursor",
        7,
        "logit",
        200.0,
        100,
    )
    assert event.labels == {"layer": "blocks.1.attn", "head": "3"}


def test_engine_keeps_one_history_per_series_across_flushes():
    """Two unfiltered rules on one metric over many series: each series' history is its own,
    events carry the labels of the series that fired, NaN breaks runs."""
    hold = ThresholdRule(name="hold", metric="attn_output_bias", threshold=0.5, for_flushes=3)
    sign = PersistenceRule(name="sign", metric="attn_output_bias", flushes=3, min_abs=0.5)
    engine = RuleEngine([hold, sign])
    # head h's value per flush; head 1 holds > 0.5 from flush 0, head 2 from flush 2, head 3
    # is interrupted by NaN at flush 2, head 4 by +inf, the others stay small.
    series = {
        1: [0.9, 0.9, 0.9, 0.9],
        2: [0.1, 0.1, 0.9, 0.9],
        3: [0.9, 0.9, math.nan, 0.9],
        4: [0.9, 0.9, math.inf, 0.9],
    }
    fired_at = []
    for flush in range(4):
        records = [MetricRecord("other_metric", {"head": "1"}, 9.0)]
        records += [
            MetricRecord("attn_output_bias", {"layer": "l", "head": str(h)}, -0.1 if h > 4 else v)
            for h, values in [*series.items(), (5, None), (6, None)]
            for v in [values[flush] if values else None]
        ]
        for event, rule in engine.evaluate(flush, records):
            fired_at.append((flush, rule.name, event.labels["head"], event.value))
    assert fired_at == [  # +inf holds "> 0.5" (head 4) but is no finite sign run
        (2, "hold", "1", 0.9),
        (2, "hold", "4", math.inf),
        (2, "sign", "1", 0.9),
        (3, "hold", "1", 0.9),
        (3, "hold", "4", 0.9),
        (3, "sign", "1", 0.9),
    ]
    engine2 = RuleEngine([ThresholdRule(name="t", metric="m", threshold=0.5, for_flushes=2)])
    out = [
        [e.labels for e, _ in engine2.evaluate(f, [MetricRecord("m", {"k": "a"}, v)])]
        for f, v in enumerate([math.inf, 0.9])
    ]
    assert out == [[], [{"k": "a"}]]


def test_engine_rejects_duplicates_and_step_rules_on_flush_metrics():
    with pytest.raises(NumwatchConfigError, match="duplicate"):
        RuleEngine([ThresholdRule(name="a", metric="m", threshold=1)] * 2)
    with pytest.raises(NumwatchConfigError, match="only known at flush"):
        RuleEngine([ThresholdRule(name="a", metric="attn_max_logit", threshold=1)], ["a"])


@pytest.mark.parametrize(
    ("rule", "fields", "fix"),
    [
        ({"type": "zscore", "window": 10}, "min_history=20 .* window=10", {"window": 20}),
        ({"type": "growth", "factor": 2, "window": 3}, "min_history=5 .* window=3", {"window": 4}),
        (
            {"type": "threshold", "threshold": 1, "for_flushes": 53},
            "for_flushes=53 .* window=50",
            {"for_flushes": 52},
        ),
        (
            {"type": "persistence", "flushes": 5, "window": 2},
            " flushes=5 .* window=2",
            {"window": 3},
        ),
    ],
)
def test_settings_that_could_never_fire_are_config_errors(rule, fields, fix):
    """A series keeps `window` + 1 earlier values (zscore reads `window`): a rule needing more
    would stay silent."""
    add = {"name": "r", "metric": "loss", **rule}
    with pytest.raises(NumwatchConfigError, match=f"rules.add.0.*{fields}.*could never fire"):
        MonitorConfig.load(rules={"add": [add]})
    MonitorConfig.load(rules={"add": [{**add, **fix}]})  # the most the window allows


def test_rules_add_rejects_duplicate_names_and_replaces_a_default():
    twice = [
        ThresholdRule(name="r", metric="grad_norm", threshold=0),
        ThresholdRule(name="r", metric="loss", threshold=0),
    ]
    with pytest.raises(NumwatchConfigError, match=r"rules.add: duplicate rule names \['r'\]"):
        MonitorConfig.load(rules={"defaults": False, "add": twice}, env={})
    with pytest.raises(NumwatchConfigError, match=r"rules.add: duplicate rule names \['r'\]"):
        replay([], twice)
    mine = ZScoreRule(name="loss_spike", metric="loss", sigma=3)
    rules = configured_rules(RulesConfig(add=[mine]))
    assert rules["loss_spike"].sigma == 3
    assert len(rules) == len(default_rules())


def test_a_rule_on_a_metric_no_flush_carries_is_reported_once(caplog):
    """A misspelled metric is valid config: the engine says so after 3 flushes, naming the
    closest metrics; documented metrics absent from the run (no attention here) are not
    suspects."""
    typo = ThresholdRule(name="typo", metric="grad_nrom", threshold=0)
    engine = RuleEngine([*default_rules(), typo])
    records = [MetricRecord("grad_norm", {}, 1.0), MetricRecord("my_metric", {}, 1.0)]
    with caplog.at_level("WARNING", logger="numwatch"):
        for flush in range(6):
            engine.evaluate(flush, records)
            assert len(caplog.records) == (flush >= 2)
    message = caplog.records[0].getMessage()
    assert "'typo'" in message and "'grad_nrom'" in message
    assert "closest known metrics: grad_norm" in message
    caplog.clear()
    with caplog.at_level("WARNING", logger="numwatch"):
        custom = ThresholdRule(name="c", metric="my_metric", threshold=0)
        engine = RuleEngine([*default_rules(), custom])
        for flush in range(4):
            engine.evaluate(flush, records)
    assert caplog.records == []


def test_rules_of_the_users_on_a_loss_that_never_comes_are_reported_once(caplog):
    """The optimizer hook closes the steps and step(loss) is optional: a rule added on the loss
    then never fired, with no word. Said at the flush after 2 steps; a loss passed after
    optimizer.step() (after the first step's flush) and the default loss rules say nothing."""
    import torch

    add = [
        {"type": "threshold", "name": "loss_high", "metric": "loss", "threshold": 5.0},
        {"type": "threshold", "name": "worst", "metric": "loss_max", "threshold": 5.0},
    ]
    said = []
    with caplog.at_level("WARNING", logger="numwatch"):
        for late_loss in (True, False):
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            monitor = _quiet_monitor(model, flush_every=1, rules={"add": add}).attach(opt)
            for _ in range(4):
                loss = model(torch.randn(8, 4)).square().mean() + 100.0
                loss.backward()
                opt.step()
                opt.zero_grad()
                if late_loss:
                    monitor.step(loss)
                said.append(len(caplog.records))
            monitor.detach()
    assert said == [0, 0, 0, 0, 0, 1, 1, 1]
    assert caplog.records[0].getMessage() == (
        "numwatch: rules loss_high, worst read the loss, but no loss has reached numwatch (steps "
        "closed by the optimizer hook, or by step() without one), so they cannot fire; pass it "
        "every step: monitor.step(loss), before or after optimizer.step()"
    )


def test_a_rule_on_a_label_key_no_series_carries_is_reported_once(caplog):
    """A misspelled label key (``module`` on a gradient metric, whose series carry ``param``)
    reads as '' and matches nothing: the rule never fired, and nothing said why."""
    typo = ThresholdRule(name="typo", metric="grad_absmax", threshold=0, labels={"module": "0.*"})
    ok = ThresholdRule(name="ok", metric="grad_absmax", threshold=0, labels={"param": "0.*"})
    on_counts = ThresholdRule(
        name="counts", metric="events_total", threshold=0, labels={"rule": "ok"}
    )
    engine = RuleEngine([typo, ok, on_counts])
    records = [MetricRecord("grad_absmax", {"param": "0.weight"}, 1.0)]
    counts = [MetricRecord("events_total", {"kind": "precursor", "rule": "ok"}, 1.0)]
    with caplog.at_level("WARNING", logger="numwatch"):
        for flush in range(6):
            fired = engine.evaluate(flush, records, late=lambda events: counts)
            assert len(caplog.records) == (flush >= 2)
            assert sorted({e.rule for e, _ in fired}) == ["counts", "ok"]
    assert caplog.records[0].getMessage() == (
        "rule 'typo' selects by label 'module', which no series of metric 'grad_absmax' carried "
        "in the first 3 flushes (a missing label reads as ''); its labels: param"
    )


def test_default_rules_quiet_on_a_healthy_run_shape():
    """A healthy flush history (DESIGN.md §1b: max logit 10-120, no ties) raises nothing."""
    engine = RuleEngine(default_rules())
    rng = random.Random(1)
    for step in range(300):
        logit = 10 + 100 * (1 - math.exp(-step / 100)) + rng.uniform(-2, 2)
        records = [
            MetricRecord("attn_max_logit", {"layer": "l", "head": "0"}, logit),
            MetricRecord("attn_repeated_max_fraction", {"layer": "l", "head": "0"}, 0.0),
            MetricRecord("attn_saturated_fraction", {"layer": "l", "head": "0"}, 0.002),
            MetricRecord("attn_output_bias", {"layer": "l", "head": "0"}, rng.uniform(-0.3, 0.3)),
            MetricRecord(
                "attn_output_systematic_error", {"layer": "l", "head": "0"}, rng.uniform(0.0, 0.4)
            ),
            MetricRecord("grad_norm", {}, 1 + 0.1 * rng.gauss(0, 1)),
            MetricRecord("loss", {}, 3 * math.exp(-step / 200) + 0.05 * rng.gauss(0, 1)),
        ]
        assert engine.evaluate(step, records) == []


def test_default_rules_swap_on_a_sustained_systematic_output_error():
    """The paper kernel's CPU NoPE + sinks runs read 0.7-0.95 once logits grow: five flushes
    above 0.5 swap the layer; four do not."""
    for flushes, fires in ((4, False), (5, True)):
        engine = RuleEngine(default_rules())
        events = []
        for step in range(flushes):
            rec = MetricRecord("attn_output_systematic_error", {"layer": "l", "head": "1"}, 0.8)
            events += engine.evaluate(step, [rec])
        got = [(e, rule) for e, rule in events if e.rule == "attn_output_systematic"]
        assert bool(got) == fires
        if fires:
            assert got[0][0].labels == {"layer": "l", "head": "1"}
            assert list(got[0][1].actions) == ["swap_attention_kernel"]


def test_a_nonfinite_rule_keeps_its_label_filter_and_cooldown_at_flush():
    """Its labels select the origins it fires on, and its cooldown silences the flushes after
    it fires; both were accepted and ignored (it fired on every NaN, every flush)."""
    import torch
    from torch import nn

    import numwatch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    rules = {
        "defaults": False,
        "add": [
            {"type": "nonfinite", "name": "first_layer", "labels": {"param": "0.*"}},
            {"type": "nonfinite", "name": "any_quiet", "cooldown": 2},
        ],
    }
    monitor = numwatch.Monitor(
        model, flush_every=1, rules=rules, sinks__console__enabled=False,
        sinks__jsonl__enabled=False,
    ).attach()  # fmt: skip
    x = torch.randn(3, 4)
    for _ in range(5):
        model(x).sum().backward()
        model[1].weight.grad[0, 0] = float("nan")  # NaN in layer 1's gradient only
        monitor.step()
        model.zero_grad()
    fired = [(e.rule, e.step) for e in monitor.events if e.rule != "nonfinite"]
    assert fired == [("any_quiet", 0), ("any_quiet", 3)]
    # the NaNs the rules let pass are still reported, as the monitor's own event
    assert [e.step for e in monitor.events if e.rule == "nonfinite"] == [1, 2, 4]


def _quiet_monitor(model, **kw):
    import numwatch

    kw.setdefault("sinks__console__enabled", False)
    kw.setdefault("sinks__jsonl__enabled", False)
    return numwatch.Monitor(model, **kw)


def _regression_steps(monitor, model, opt, steps, scale_at=(), seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(8, 4, generator=g)
        y = torch.randn(8, 1, generator=g) * (1000.0 if step in scale_at else 1.0)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        monitor.step(loss)
        opt.step()
        opt.zero_grad()


def test_rules_on_what_the_rules_and_actions_did_fire_live():
    """Rules on events_total and mitigation_* saw no values live (those records were added
    after the rules ran) and fired only in replay; step-level events were not counted."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rules = {
        "defaults": False,
        "add": [
            {"type": "threshold", "name": "loss_high", "metric": "loss", "threshold": 100.0,
             "actions": ["skip_step"]},
            {"type": "threshold", "name": "many_skips", "metric": "mitigation_skipped_steps_total",
             "threshold": 1.0},
            {"type": "threshold", "name": "precursor_seen", "metric": "events_total",
             "threshold": 0.0, "labels": {"kind": "precursor"}},
        ],
    }  # fmt: skip
    monitor = _quiet_monitor(model, flush_every=2, rules=rules).attach(opt)
    _regression_steps(monitor, model, opt, 8, scale_at=(2, 3, 4))
    monitor.detach()
    fired = sorted({(e.rule, e.step) for e in monitor.events if e.kind != "action"})
    # skips at steps 2, 3, 4 (decided after their step's flush): the flush of step 5 is the
    # first to hold more than one; loss_high's precursor event of step 2 is counted at step 3
    skips = {s.step: s.value("mitigation_skipped_steps_total") for s in monitor.history}
    assert skips == {1: 0, 3: 1, 5: 3, 7: 3}
    assert [s for r, s in fired if r == "many_skips"] == [5, 7]
    assert [s for r, s in fired if r == "precursor_seen"] == [3, 5, 7]
    snap = monitor.snapshot()
    assert snap.value("events_total", kind="precursor", rule="loss_high") == 3
    assert snap.value("events_total", kind="action", rule="loss_high") == 3


def test_one_rule_that_raises_leaves_the_others_firing(caplog):
    """A float64 loss of 1e160 made the z-score rules raise (squares overflowed in pstdev) and
    every other rule went silent while it stayed in their window."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rules = {"add": [{"type": "threshold", "name": "loss_high", "metric": "loss",
                      "threshold": 100.0}]}  # fmt: skip
    monitor = _quiet_monitor(model, flush_every=1, rules=rules).attach(opt)
    g = torch.Generator().manual_seed(0)
    for step in range(45):
        x = torch.randn(8, 4, generator=g, dtype=torch.float64)
        y = torch.randn(8, 1, generator=g, dtype=torch.float64)
        y = y * {30: 1e80, 40: 1e3}.get(step, 1.0)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        monitor.step(loss)
        opt.step()
        opt.zero_grad()
    monitor.detach()
    assert [e.step for e in monitor.events if e.rule == "loss_high"] == [30, 40]
    assert monitor.errors.get("rules", 0) == 0

    class Broken(ThresholdRule):
        def check(self, history, value):
            raise RuntimeError("broken rule")

    engine = RuleEngine(
        [Broken(name="broken", metric="m", threshold=0), ThresholdRule(name="ok", metric="m",
                                                                       threshold=0)],
        run=lambda fn, *args: _swallow(fn, *args),
    )  # fmt: skip
    fired = engine.evaluate(0, [MetricRecord("m", {}, 1.0)])
    assert [r.name for _, r in fired] == ["ok"]


def _swallow(fn, *args):
    try:
        return fn(*args)
    except RuntimeError:
        return None


def test_a_value_measured_once_is_observed_once():
    """The spectral norms of one sample were reported again at every flush until the next
    sample, so one planted value satisfied for_flushes=3; a manual flush with no new step fed
    the last loss to the rules again."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rules = {
        "defaults": False,
        "add": [
            {"type": "threshold", "name": "sigma_3x", "metric": "weight_spectral_norm",
             "threshold": 10.0, "for_flushes": 3, "labels": {"param": "0.weight"}},
            {"type": "threshold", "name": "loss_2x", "metric": "loss", "threshold": 1e4,
             "for_flushes": 2},
        ],
    }  # fmt: skip
    monitor = _quiet_monitor(model, flush_every=10, rules=rules).attach(opt)
    sigmas = []
    for step in range(120):
        if step == 50:
            with torch.no_grad():
                model[0].weight *= 100.0  # for the one sampled step
        loss = model(torch.randn(4, 8)).pow(2).mean() * (1e6 if step == 59 else 1.0)
        loss.backward()
        monitor.step(loss)
        opt.step()
        opt.zero_grad()
        if step == 50:
            with torch.no_grad():
                model[0].weight /= 100.0
        if step % 10 == 9:
            sigmas.append(monitor.snapshot().get("weight_spectral_norm", param="0.weight"))
        if step == 59:
            monitor.flush()  # again, at the same step: no new observation
    monitor.detach()
    assert [s is not None for s in sigmas] == [i in (0, 5, 10) for i in range(12)]
    assert [e.rule for e in monitor.events] == []


def test_step_level_rules_refuse_labels_and_nonfinite_rules_select_by_metric():
    with pytest.raises(NumwatchConfigError, match="no labels to select"):
        RuleEngine([NonfiniteRule(name="nf", labels={"param": "x*"})], ["nf"])
    with pytest.raises(NumwatchConfigError, match="selects origins by metric"):
        RuleEngine([NonfiniteRule(name="nf", metric="grad_norm")])
    from numwatch.events import Event

    grad = Event(kind="nonfinite", step=3, message="NaN/Inf first seen in the gradient",
                 rule="nonfinite", metric="grad_nonfinite", labels={"param": "w"})  # fmt: skip
    loss_only = NonfiniteRule(name="loss_nan", metric="loss")
    assert loss_only.adopt([grad]) == []
    assert [e.rule for e in NonfiniteRule(name="any").adopt([grad])] == ["any"]


def test_replay_takes_each_logged_origin_once():
    """Each live nonfinite rule logs its own copy of an origin: fed back whole, N rules
    replayed as N^2 events."""
    from numwatch.replay import replay

    def event(rule):
        return {"kind": "nonfinite", "step": 19, "message": "NaN/Inf first seen in the gradient",
                "rule": rule, "metric": "grad_nonfinite", "labels": {"param": "w"},
                "evidence": {"phase": "backward"}}  # fmt: skip

    log = [{"schema": 1, "run": "r", "step": 19, "time": 0.0, "rank": 0,
            "metrics": [{"name": "loss", "labels": {}, "value": 1.0}],
            "events": [event("nonfinite"), event("page")]}]  # fmt: skip
    rules = RulesConfig(add=[{"type": "nonfinite", "name": "page"}])
    assert sorted(e.rule for e in replay(log, rules)) == ["nonfinite", "page"]


def _records(values, metric="m", labels=None):
    return [
        {"schema": 1, "run": "r", "step": i, "time": float(i), "rank": 0, "events": [],
         "metrics": [{"name": metric, "labels": labels or {}, "value": v}]}
        for i, v in enumerate(values)
    ]  # fmt: skip


def test_a_step_level_rule_refuses_a_cooldown():
    """A cooldown on a skip_step rule kept it quiet for steps: the NaN updates of those steps
    reached the weights."""
    import torch

    import numwatch

    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"],
                      "cooldown": 3}]}  # fmt: skip
    with pytest.raises(NumwatchConfigError, match="leave cooldown at 0"):
        numwatch.Monitor(torch.nn.Linear(2, 1), rules=rules, sinks__jsonl__enabled=False)


@pytest.mark.parametrize("metric", ["grad_norm", "nonfinite"])
def test_a_skip_step_rule_on_the_gradient_norm_needs_the_gradient_probe(metric):
    """With gradients.enabled false no step norm is measured: the rule was silent, and a NaN
    gradient reached the weights without an event."""
    rule = {"type": "nonfinite", "name": "nan_skip", "metric": metric, "actions": ["skip_step"]}
    with pytest.raises(
        NumwatchConfigError,
        match=re.escape(
            f"rules[nan_skip]: skip_step decides from the step's gradient norm (metric "
            f"'{metric}'), which gradients.enabled false leaves unmeasured"
        ),
    ):
        MonitorConfig.load(rules={"add": [rule]}, gradients__enabled=False, env={})
    assert MonitorConfig.load(rules={"add": [rule]}, env={}).rules.add[0].metric == metric
    on_loss = {**rule, "metric": "loss"}
    assert MonitorConfig.load(rules={"add": [on_loss]}, gradients__enabled=False, env={})


def test_zscore_reports_the_bound_a_downward_spike_crossed():
    from numwatch.replay import replay

    (event,) = replay(
        _records([1.0, 2.0] * 15 + [-100.0]), [ZScoreRule(name="z", metric="m", direction="both")]
    )
    assert event.value == -100.0 and event.threshold == pytest.approx(1.5 - 6.0 * 0.5, rel=0.1)


def test_persistence_gives_zero_no_sign():
    """min_abs: 0 fired on exact zeros as 'stayed positive' (attn_output_bias is exactly 0 for
    an exact kernel)."""
    from numwatch.replay import replay

    rule = PersistenceRule(name="p", metric="m", flushes=5, min_abs=0)
    assert replay(_records([0.0] * 6), [rule]) == []
    assert replay(_records([-0.0] * 6), [rule]) == []
    assert len(replay(_records([1e-9] * 5), [rule])) == 1


def test_default_logit_growth_fires_above_ten_percent_a_flush():
    """min_slope 0.1 of ln(value) is 10.5 %/flush: README says > 10 %."""
    from numwatch.replay import replay

    labels = {"layer": "h.0.attn", "head": "0"}
    for growth, fires in ((1.103, True), (1.095, False)):
        recs = _records([200 * growth**i for i in range(15)], "attn_max_logit", labels)
        events = [e for e in replay(recs, default_rules()) if e.rule == "attn_max_logit_growth"]
        assert bool(events) == fires, growth


def test_late_rules_see_the_monitors_own_events_of_their_flush_live_and_in_replay(tmp_path):
    """A rule on events_total saw the NaN origin the monitor reports without a nonfinite rule
    one flush late (and replay read the logged counts, which hold the late rules' own events:
    other flushes, other series)."""
    import torch

    import numwatch
    from numwatch.replay import replay
    from numwatch.sinks.jsonl import read_jsonl

    def run(rules, losses):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        log = tmp_path / f"run{len(losses)}-{len(rules['add'])}.jsonl"
        monitor = numwatch.Monitor(model, flush_every=1, rules=rules, sinks__console__enabled=False,
                                   sinks__jsonl__path=str(log)).attach()  # fmt: skip
        for value in losses:
            loss = model(torch.randn(8, 4)).square().mean() * 0 + value
            loss.backward()
            monitor.step(loss)
            model.zero_grad()
        monitor.detach()

        def key(e):
            return (e.rule, e.step, e.labels.get("rule", ""))

        live = [key(e) for e in monitor.events if e.kind != "action"]
        return live, [key(e) for e in replay(read_jsonl(log), monitor.config.rules)]

    nan_seen = {"type": "threshold", "name": "nan_seen", "metric": "events_total",
                "threshold": 0.0, "labels": {"kind": "nonfinite"}, "kind": "anomaly",
                "cooldown": 100}  # fmt: skip
    live, replayed = run({"defaults": False, "add": [nan_seen]}, [1.0, 1.0, math.nan, 1.0])
    assert sorted(live) == sorted(replayed) == [("nan_seen", 2, "nonfinite"), ("nonfinite", 2, "")]
    high = {"type": "threshold", "name": "loss_high", "metric": "loss", "threshold": 100.0}
    precursors = {"type": "threshold", "name": "precursors", "metric": "events_total",
                  "threshold": 0.0, "labels": {"kind": "precursor"}}  # fmt: skip
    live, replayed = run({"defaults": False, "add": [high, precursors]}, [1.0, 1.0, 500.0, 1.0])
    assert live == replayed
