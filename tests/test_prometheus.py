"""Prometheus exporter: head reduction on planted values, exposition format (promtool), counters,
the HTTP server's life cycle, and the monitor wiring."""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import numwatch
from numwatch.config import PrometheusSinkConfig
from numwatch.demo import GPTConfig, TinyGPT, bigram_batches
from numwatch.errors import NumwatchHalt
from numwatch.events import Event
from numwatch.sinks.prometheus import PrometheusSink, SnapshotCollector
from numwatch.snapshot import MetricRecord, Snapshot

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool (Debian package 'prometheus') not installed; `make test` installs it as root",
)


def samples(text: str | bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float | str]:
    """{(sample name, sorted labels): value} of a text exposition; NaN as "nan" (comparable)."""
    text = text.decode() if isinstance(text, bytes) else text
    return {
        (s.name, tuple(sorted(s.labels.items()))): "nan" if math.isnan(s.value) else s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: bytes, name: str, **labels: str) -> float:
    got = samples(text)[(name, tuple(sorted({"rank": "0", **labels}.items())))]
    return math.nan if got == "nan" else got


def head_snapshot(values: dict[str, list[list[float]]], *, order=None) -> Snapshot:
    """Per-head records {metric: [[head values of layer 0], [layer 1], ...]} as the probe lays
    them out (layer, then head; one labels dict per head); ``order`` permutes the records."""
    records = []
    n_layers = len(next(iter(values.values())))
    for layer in range(n_layers):
        for head in range(len(next(iter(values.values()))[layer])):
            labels = {"layer": f"blocks.{layer}.attn", "head": str(head)}
            records += [MetricRecord(name, labels, v[layer][head]) for name, v in values.items()]
    if order is not None:
        records = [records[i] for i in order]
    return Snapshot(7, records, time=1.7e9)


def exposition(snapshot: Snapshot, events=(), **kwargs) -> bytes:
    collector = SnapshotCollector(const_labels={"rank": "0"}, run_name="t", **kwargs)
    collector.update(snapshot, events)
    return collector.exposition()


PLANTED = {
    "attn_max_logit": [[1.0, 9.0, 3.0, 9.0], [2.0, math.nan, 50.0, 1.0]],
    "attn_min_logit": [[-1.0, -7.0, 0.0, -7.5], [-2.0, -3.0, -1.0, -4.0]],
    "attn_output_bias": [[0.1, -0.8, 0.5, 0.7], [0.2, 0.3, -0.1, 0.9]],
    "attn_rows": [[64.0] * 4, [64.0] * 4],
    "attn_saturated_fraction": [[0.2, 0.5, 0.5, 0.1], [0.0, 0.0, 0.0, 0.0]],
}


def test_layer_mode_keeps_worst_head_value_and_index():
    text = exposition(head_snapshot(PLANTED))
    assert value(text, "numwatch_attn_max_logit", layer="blocks.0.attn") == 9.0
    # ties: the first head wins; NaN is always the worst (non-finite inputs)
    assert value(text, "numwatch_worst_head", layer="blocks.0.attn", metric="attn_max_logit") == 1
    assert math.isnan(value(text, "numwatch_attn_max_logit", layer="blocks.1.attn"))
    assert value(text, "numwatch_worst_head", layer="blocks.1.attn", metric="attn_max_logit") == 1
    assert value(text, "numwatch_attn_min_logit", layer="blocks.0.attn") == -7.5
    assert value(text, "numwatch_worst_head", layer="blocks.0.attn", metric="attn_min_logit") == 3
    # absmax keeps the sign of the worst head
    assert value(text, "numwatch_attn_output_bias", layer="blocks.0.attn") == -0.8
    assert value(text, "numwatch_attn_output_bias", layer="blocks.1.attn") == 0.9
    assert value(text, "numwatch_attn_rows", layer="blocks.0.attn") == 64.0
    # without NaN (the C-level path): ties go to the first head as well
    for layer, head in (("blocks.0.attn", 1), ("blocks.1.attn", 0)):
        labels = {"layer": layer, "metric": "attn_saturated_fraction"}
        assert value(text, "numwatch_worst_head", **labels) == head
    names = {name for name, _ in samples(text)}
    assert "numwatch_attn_rows" in names
    # no worst head for rows: every head of a layer sees the same rows
    assert not any(dict(lab).get("metric") == "attn_rows" for _, lab in samples(text))
    heads = [lab for name, lab in samples(text) if name == "numwatch_attn_max_logit"]
    assert len(heads) == 2 and all("head" not in dict(lab) for lab in heads)


def test_layer_mode_independent_of_record_order():
    n = sum(len(v) * len(v[0]) for v in PLANTED.values())
    shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    assert samples(exposition(head_snapshot(PLANTED, order=shuffled))) == samples(
        exposition(head_snapshot(PLANTED))
    )


def test_a_nan_head_is_worse_than_an_infinite_one():
    """NaN counts as the worst head: a layer with head 0 at +Inf and head 1 NaN was exported as
    +Inf with worst_head 0 (NaN tied with Inf, and the tie went to the first head)."""
    inf = math.inf
    planted = {
        "attn_max_logit": [[inf, math.nan, 1.0]],
        "attn_min_logit": [[-inf, math.nan, 1.0]],
        "attn_output_bias": [[-inf, 0.5, math.nan]],
    }
    text = exposition(head_snapshot(planted))
    for name, head in (("attn_max_logit", 1), ("attn_min_logit", 1), ("attn_output_bias", 2)):
        assert math.isnan(value(text, f"numwatch_{name}", layer="blocks.0.attn"))
        assert value(text, "numwatch_worst_head", layer="blocks.0.attn", metric=name) == head
    top = samples(exposition(head_snapshot(planted), heads="top_k", top_k=1))
    kept = [dict(lab)["head"] for name, lab in top if name == "numwatch_attn_max_logit"]
    assert kept == ["1"]


def test_top_k_and_all_modes():
    snap = head_snapshot(PLANTED)
    top = samples(exposition(snap, heads="top_k", top_k=2))
    kept = {
        (dict(lab)["layer"], dict(lab)["head"])
        for name, lab in top
        if name == "numwatch_attn_max_logit"
    }
    assert kept == {("blocks.0.attn", "1"), ("blocks.0.attn", "3"), ("blocks.1.attn", "1")} | {
        ("blocks.1.attn", "2")
    }
    full = samples(exposition(snap, heads="all"))
    assert sum(name == "numwatch_attn_max_logit" for name, _ in full) == 8
    key = ("numwatch_attn_min_logit", (("head", "2"), ("layer", "blocks.1.attn"), ("rank", "0")))
    assert full[key] == -1.0
    # the worst head index is exported in every mode
    assert any(name == "numwatch_worst_head" for name, _ in full)


def test_counters_gauges_and_events():
    snap = Snapshot(
        3,
        [
            MetricRecord("monitor_errors_total", {"component": "sinks"}, 2.0),
            MetricRecord("loss", {}, 0.5),
        ],
        time=1.7e9,
    )
    event = Event(kind="nonfinite", step=3, message="x", rule="nonfinite")
    collector = SnapshotCollector(const_labels={"rank": "3"})
    collector.update(snap, [event, event])
    collector.update(snap, [event])
    text = collector.exposition().decode()
    assert "# TYPE numwatch_monitor_errors_total counter" in text
    assert "# TYPE numwatch_loss gauge" in text
    assert 'numwatch_events_total{rank="3",kind="nonfinite",rule="nonfinite"} 3.0' in text
    assert 'numwatch_step{rank="3"} 3.0' in text
    # the monitor's own events_total (from its rules) wins over the sink's count
    snap2 = Snapshot(
        4, [MetricRecord("events_total", {"kind": "spike", "rule": "r"}, 5.0)], time=1.7e9
    )
    collector.update(snap2, [event])
    got = samples(collector.exposition())
    events = {lab: v for (name, lab), v in got.items() if name == "numwatch_events_total"}
    assert events == {(("kind", "spike"), ("rank", "3"), ("rule", "r")): 5.0}


def test_a_series_a_flush_did_not_sample_keeps_its_last_value():
    """Attention and activation series vanished from every flush that did not sample them
    (flush_every < attention.every): Prometheus marked them stale between samples and an alert
    with `for:` could never hold. Until session 24 gradients (gradients.every) still did, and so
    did the updates of parameters another flush's rotation measured (optimizer.max_bytes). A
    metric sampled again is served as sampled: the gradient series of a parameter frozen since
    is gone (held, a NaN count would fire an alert for the rest of the run)."""
    sampled = Snapshot(
        1,
        [
            MetricRecord("loss", {}, 0.5),
            MetricRecord("attn_max_logit", {"layer": "a", "head": "0"}, 7.0),
            MetricRecord("weight_spectral_norm", {"param": "w"}, 3.0),
            MetricRecord("grad_norm", {}, 1.5),
            MetricRecord("grad_nonfinite", {"param": "w"}, 1.0),
            MetricRecord("optimizer_update_ratio", {"param": "w"}, 1e-3),
        ],
        time=1.7e9,
    )
    between = Snapshot(3, [MetricRecord("loss", {}, 0.25)], time=1.7e9)
    resampled = Snapshot(
        5,
        [
            MetricRecord("loss", {}, 0.2),
            MetricRecord("weight_spectral_norm", {"param": "w"}, 2.0),
            MetricRecord("optimizer_update_ratio", {"param": "v"}, 2e-3),  # the rotation's next
            MetricRecord("grad_nonfinite", {"param": "v"}, 0.0),  # w frozen: no gradient
        ],
        time=1.7e9,
    )
    collector = SnapshotCollector(const_labels={"rank": "0"})
    collector.update(sampled)
    collector.update(between)
    got = samples(collector.exposition())
    assert got[("numwatch_loss", (("rank", "0"),))] == 0.25
    assert got[("numwatch_attn_max_logit", (("layer", "a"), ("rank", "0")))] == 7.0
    assert got[("numwatch_weight_spectral_norm", (("param", "w"), ("rank", "0")))] == 3.0
    assert got[("numwatch_grad_norm", (("rank", "0"),))] == 1.5
    collector.update(resampled)
    got = samples(collector.exposition())
    assert got[("numwatch_weight_spectral_norm", (("param", "w"), ("rank", "0")))] == 2.0
    ratios = {lab: v for (name, lab), v in got.items() if name == "numwatch_optimizer_update_ratio"}
    assert ratios == {(("param", "v"), ("rank", "0")): 2e-3, (("param", "w"), ("rank", "0")): 1e-3}
    assert got[("numwatch_attn_max_logit", (("layer", "a"), ("rank", "0")))] == 7.0
    assert got[("numwatch_grad_norm", (("rank", "0"),))] == 1.5
    nonfinite = {lab: v for (name, lab), v in got.items() if name == "numwatch_grad_nonfinite"}
    assert nonfinite == {(("param", "v"), ("rank", "0")): 0.0}
    # w's update is held while its turn may come (2 series known, 1 per sample: a rotation of
    # 2 samples), then it goes: frozen, it has no update to report (its ratio was held forever)
    for step, held in ((6, True), (7, False)):
        only_v = Snapshot(step, [MetricRecord("optimizer_update_ratio", {"param": "v"}, 3e-3)],
                          time=1.7e9)  # fmt: skip
        collector.update(only_v)
        got = samples(collector.exposition())
        assert (("numwatch_optimizer_update_ratio", (("param", "w"), ("rank", "0"))) in got) == held
    # a metric whose absence is its value is not held: no layer routed any more
    routed = Snapshot(6, [MetricRecord("attn_kernel_mode", {"layer": "a", "mode": "plain"}, 1.0)],
                      time=1.7e9)  # fmt: skip
    collector.update(routed)
    collector.update(Snapshot(7, [MetricRecord("loss", {}, 0.1)], time=1.7e9))
    assert not any(
        name == "numwatch_attn_kernel_mode" for name, _ in samples(collector.exposition())
    )


def test_updates_in_a_rotation_of_uneven_chunks_stay_served_between_their_turns():
    """A byte budget measures big parameters alone and small ones many at a time: a rotation
    length taken from the latest chunk (13 series over 10) dropped a big one every rotation,
    one sample before its turn came again."""
    chunks = [["big1"], ["big2"], ["big3"], [f"small{i}" for i in range(10)]]
    collector = SnapshotCollector(const_labels={"rank": "0"})
    step = 0
    for _ in range(3):
        for chunk in chunks:
            records = [MetricRecord("optimizer_update_ratio", {"param": p}, 1e-3) for p in chunk]
            collector.update(Snapshot(step, records, time=1.7e9))
            step += 1
            served = {lab for (name, lab), _ in samples(collector.exposition()).items()
                      if name == "numwatch_optimizer_update_ratio"}  # fmt: skip
            if step > len(chunks):  # every parameter measured once: all served from now on
                assert len(served) == 13


def _served_updates(collector):
    return {dict(lab)["param"] for (name, lab), _ in samples(collector.exposition()).items()
            if name == "numwatch_optimizer_update_ratio"}  # fmt: skip


def test_an_update_stays_served_while_the_rotation_grows_and_turns_move():
    """A series was held for its own last gap between measurements, plus one: after an
    unfreezing the head, measured every sample until then, vanished for six flushes before its
    turn came round again; a parameter trained on some steps only moved the turns of the
    others and made them vanish now and then."""
    collector = SnapshotCollector(const_labels={"rank": "0"})

    def sample(step, params):
        records = [MetricRecord("optimizer_update_ratio", {"param": p}, 1e-3) for p in params]
        collector.update(Snapshot(step, records, time=1.7e9))
        return _served_updates(collector)

    step = 0
    for step in range(5):  # the backbone frozen: the head alone, every sample
        assert sample(step, ["head"]) == {"head"}
    backbone = [[f"b{i}", f"b{i + 1}"] for i in range(0, 16, 2)]  # unfrozen: 9 samples a turn
    last = {}
    for _ in range(3):
        for chunk in [*backbone, ["head"]]:
            step += 1
            assert "head" in sample(step, chunk)
            last.update(dict.fromkeys(chunk, step))
    assert len(last) == 17
    # frozen again: a backbone parameter goes once the longest turn (9 samples) and one more
    # passed it by
    for _ in range(12):
        step += 1
        last["head"] = step
        assert sample(step, ["head"]) == {p for p, at in last.items() if step - at <= 10}
    assert sample(step + 1, ["head"]) == {"head"}


def test_registry_and_fast_text_agree():
    snap = head_snapshot(PLANTED)
    snap = Snapshot(
        snap.step,
        [*snap, MetricRecord("grad_absmax", {"param": 'odd "name"\\x\n'}, float("inf"))],
        time=snap.time,
    )
    sink = PrometheusSink(serve=False, heads="top_k", top_k=2, run_name="r")
    sink.emit(snap, [Event(kind="spike", step=1, message="m", rule="z")])
    fast = samples(sink.collector.exposition())
    assert fast == samples(generate_latest(sink.registry))
    assert fast[("numwatch_grad_absmax", (("param", 'odd "name"\\x\n'), ("rank", "0")))] == math.inf


def test_include_exclude():
    snap = Snapshot(
        1,
        [
            MetricRecord("grad_absmax", {"param": "w"}, 1.0),
            MetricRecord("grad_mean", {"param": "w"}, 0.1),
            MetricRecord("loss", {}, 2.0),
        ],
        time=1.7e9,
    )
    names = {n for n, _ in samples(exposition(snap, include=["grad_*"], exclude=["grad_mean"]))}
    always = {"numwatch_run_info", "numwatch_step", "numwatch_flush_timestamp_seconds"}
    assert names == {"numwatch_grad_absmax", *always}


def test_default_config_excludes_low_value_tensor_stats():
    cfg = PrometheusSinkConfig()
    assert not cfg.enabled and cfg.host == "127.0.0.1" and cfg.heads == "layer"
    assert "grad_mean" in cfg.exclude and "grad_absmax" not in cfg.exclude


# ------------------------------------------------------------------------------ HTTP server
def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def test_server_ephemeral_port_serves_and_closes():
    sink = PrometheusSink(port=0, run_name="srv")
    try:
        host, port = sink.address
        assert host == "127.0.0.1" and port > 0
        assert sink.url == f"http://127.0.0.1:{port}/metrics"
        status, ctype, body = get(sink.url)
        assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
        assert value(body, "numwatch_run_info", run="srv") == 1.0  # before any flush
        sink.emit(Snapshot(5, [MetricRecord("loss", {}, 1.5)], time=1.7e9), [])
        assert value(get(sink.url)[2], "numwatch_loss") == 1.5
        assert get(f"http://127.0.0.1:{port}/nope")[0] == 404
    finally:
        sink.close()
    sink.close()  # idempotent
    assert sink.url is None
    again = PrometheusSink(port=port)  # the port is free again
    again.close()


def test_taken_port_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(numwatch.NumwatchError, match=rf"port {port} .* already in use"):
            PrometheusSink(port=port)


def test_concurrent_scrapes_during_updates():
    sink = PrometheusSink(port=0)
    errors: list[BaseException] = []
    stop = threading.Event()

    def scrape():
        while not stop.is_set():
            try:
                step = value(get(sink.url)[2], "numwatch_step")
                assert 0 <= step < 40
            except KeyError:  # before the first flush there is no step
                pass
            except BaseException as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=scrape) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        base = list(head_snapshot(PLANTED))
        for step in range(40):
            sink.emit(Snapshot(step, base, time=1.7e9), [])
    finally:
        stop.set()
        for t in threads:
            t.join()
        sink.close()
    assert not errors


@pytest.mark.parametrize(
    ("ranks", "rank", "local_rank", "port", "expected"),
    [
        ("each", 0, 0, 9710, 9710),
        ("each", 3, 1, 9710, 9711),
        ("each", 3, 1, 0, 0),
        ("rank0", 0, 0, 9710, 9710),
        ("rank0", 1, 1, 9710, None),
    ],
)
def test_from_config_ports_per_rank(monkeypatch, ranks, rank, local_rank, port, expected):
    seen = {}
    monkeypatch.setattr(
        PrometheusSink, "__init__", lambda self, **kw: seen.update(kw) or None, raising=True
    )
    cfg = PrometheusSinkConfig(enabled=True, ranks=ranks, port=port)
    sink = PrometheusSink.from_config(cfg, rank=rank, local_rank=local_rank, run_name="r")
    assert (sink is None) == (expected is None)
    if expected is not None:
        assert seen["port"] == expected and seen["rank"] == rank


@pytest.mark.parametrize(("env", "expected"), [({"LOCAL_RANK": "1"}, 9711), ({}, 9713)])
def test_the_monitor_binds_port_plus_local_rank_else_the_global_rank(monkeypatch, env, expected):
    """torch.multiprocessing.spawn sets no LOCAL_RANK: every rank bound port + 0 and all but
    one failed at attach with 'port in use'."""
    seen = {}
    monkeypatch.setattr(
        PrometheusSink, "from_config", lambda cfg, **kw: seen.update(kw) or None, raising=True
    )
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("RANK", "3")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monitor = numwatch.Monitor(
        torch.nn.Linear(2, 1), sinks__jsonl__enabled=False, sinks__console__enabled=False
    ).attach()
    monitor.detach()
    assert seen["rank"] == 3 and 9710 + seen["local_rank"] == expected


# ------------------------------------------------------------------------------ with the monitor
def tiny_training(monitor_overrides: dict, steps: int = 4, nan_at: int | None = None):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=16, seq_len=8, d_model=16, n_heads=2, n_layers=2)
    model = TinyGPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    overrides = {
        "flush_every": 2,
        "attention__every": 1,
        "activations__every": 1,
        "sinks__jsonl__enabled": False,
        "sinks__console__enabled": False,
        "sinks__prometheus__enabled": True,
        "sinks__prometheus__port": 0,
        **monitor_overrides,
    }
    monitor = numwatch.Monitor(model, **overrides).attach(opt)
    data = bigram_batches(cfg, 2)
    for step in range(steps):
        x, y = next(data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if step == nan_at:
            model.head.weight.grad[0, 0] = float("nan")
        monitor.step(loss)
        if step == nan_at:
            model.head.weight.grad.nan_to_num_(0.0)
        opt.step()
        opt.zero_grad()
    return monitor, model


def test_every_configured_rule_has_an_event_series_from_the_start():
    """events_total{kind,rule} appeared only at a rule's first event, at 1: increase() and
    rate() lose that first event (a counter needs an earlier sample), and the dashboard's event
    panels read "No data" on a healthy run. Every configured rule (and the action it runs) is
    served at 0 from the first flush, and still after another rule fired."""
    monitor, _ = tiny_training({}, steps=2)  # one flush
    body = get(monitor.prometheus_url)[2]
    assert value(body, "numwatch_events_total", kind="spike", rule="loss_spike") == 0
    assert value(body, "numwatch_events_total", kind="action", rule="attn_repeated_max") == 0
    assert value(body, "numwatch_events_total", kind="nonfinite", rule="nonfinite") == 0
    monitor.detach()
    monitor, _ = tiny_training({}, nan_at=1)
    body = get(monitor.prometheus_url)[2]
    assert value(body, "numwatch_events_total", kind="nonfinite", rule="nonfinite") == 1
    assert value(body, "numwatch_events_total", kind="spike", rule="loss_spike") == 0
    monitor.detach()
    # a nonfinite rule's configured kind is its events' kind (the adopted event kept
    # "nonfinite": its series appeared at 1 beside a configured one that stayed at 0)
    kind = {"rules__add": [{"type": "nonfinite", "name": "nan_seen", "kind": "anomaly"}]}
    monitor, _ = tiny_training(kind, nan_at=1)
    body = get(monitor.prometheus_url)[2]
    assert value(body, "numwatch_events_total", kind="anomaly", rule="nan_seen") == 1
    assert [e.kind for e in monitor.events if e.rule == "nan_seen"] == ["anomaly"]
    monitor.detach()
    # the monitor's own NaN event, which no rule adopts here, has its series from the start
    monitor, _ = tiny_training({"rules__disable": ["nonfinite"]}, steps=2)
    body = get(monitor.prometheus_url)[2]
    assert value(body, "numwatch_events_total", kind="nonfinite", rule="nonfinite") == 0
    monitor.detach()


def test_monitor_serves_and_detach_stops():
    monitor, _ = tiny_training({}, nan_at=1)
    url = monitor.prometheus_url
    body = get(url)[2]
    assert value(body, "numwatch_step") == 3
    assert value(body, "numwatch_events_total", kind="nonfinite", rule="nonfinite") == 1
    heads = monitor.snapshot().series("attn_max_logit")
    worst = max(r.value for r in heads if r.labels["layer"] == "blocks.0.attn")
    assert value(body, "numwatch_attn_max_logit", layer="blocks.0.attn") == worst
    monitor.detach()
    assert monitor.prometheus_url is None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_a_halted_run_dropped_without_detach_frees_its_port():
    """A halt leaves the monitor attached; a sweep in one process then drops the run's model,
    optimizer and monitor. The server thread served the dead run for the rest of the process
    and kept the port: every later run's attach() failed."""
    import gc
    import threading

    def run(port):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        monitor = numwatch.Monitor(
            model, flush_every=1, sinks__jsonl__enabled=False, sinks__console__enabled=False,
            sinks__prometheus__enabled=True, sinks__prometheus__port=port,
            rules__add=[{"type": "nonfinite", "name": "nonfinite", "actions": ["halt"]}],
        ).attach(opt)  # fmt: skip
        port = monitor.prometheus_url.rsplit(":", 1)[1].split("/")[0]
        with pytest.raises(NumwatchHalt):
            for step in range(5):
                x = torch.randn(4, 8)
                x[0, 0] = float("nan") if step == 2 else x[0, 0]
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        assert monitor.attached
        return int(port)

    def serving():
        return sum(t.name == "numwatch-prometheus" for t in threading.enumerate())

    before = serving()
    port = run(0)
    assert run(port) == port  # the next run of the sweep binds the same port, collected or not
    gc.collect()
    assert serving() == before
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_stopping_the_server_never_waits_for_a_loop_that_cannot_end():
    """The sink's finalizer ran shutdown(), which waits for the serving loop: in a forked
    child (no serving thread) the child hung at exit, and a garbage collection on the serving
    thread itself deadlocked it (the port held for good)."""
    import threading

    from numwatch.sinks.prometheus import _stop_serving

    sink = PrometheusSink(serve=True, host="127.0.0.1", port=0, run_name="r")
    server = sink._server
    thread = next(t for t in threading.enumerate() if t.name == "numwatch-prometheus")
    _stop_serving(server, threading.current_thread())  # as if run on the serving thread
    thread.join(timeout=5)
    assert not thread.is_alive()
    script = (
        "import os, sys, torch, numwatch\n"
        "model = torch.nn.Linear(4, 2)\n"
        "m = numwatch.Monitor(model, sinks__prometheus__enabled=True, sinks__prometheus__port=0,"
        " sinks__console__enabled=False, sinks__jsonl__enabled=False).attach()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n    sys.exit(0)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "m.detach()\n"
        "print('child status', status)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "child status 0" in run.stdout, run.stderr[-2000:]


def test_a_forked_child_does_not_keep_the_port_after_detach():
    """A DataLoader worker forked while attached shares the listening socket: after detach a
    scrape hung instead of being refused, and the next monitor on the port failed to attach,
    while the worker lived."""
    from conftest import forked_child

    model = torch.nn.Linear(2, 1)
    options = {"sinks__console__enabled": False, "sinks__jsonl__enabled": False,
               "sinks__prometheus__enabled": True, "sinks__prometheus__port": 0}  # fmt: skip
    monitor = numwatch.Monitor(model, **options).attach()
    url = monitor.prometheus_url
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with forked_child():  # lives on past the parent's detach
        monitor.detach()
        with pytest.raises(urllib.error.URLError, match="Connection refused"):
            urllib.request.urlopen(url, timeout=2)
        again = numwatch.Monitor(model, **{**options, "sinks__prometheus__port": port}).attach()
        assert again.prometheus_url == url
        again.detach()


def test_monitor_attach_on_taken_port_fails_cleanly():
    model = torch.nn.Linear(2, 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        monitor = numwatch.Monitor(
            model,
            sinks__jsonl__enabled=False,
            sinks__console__enabled=False,
            sinks__prometheus__enabled=True,
            sinks__prometheus__port=port,
        )
        with pytest.raises(numwatch.NumwatchError, match=r"sinks\.prometheus"):
            monitor.attach()
    assert not monitor.attached
    assert not model._forward_hooks and not model.weight._post_accumulate_grad_hooks
    # nothing is left bound or hooked: the same monitor attaches once the port is free
    monitor.attach()
    assert monitor.prometheus_url == f"http://127.0.0.1:{port}/metrics"
    monitor.detach()


@needs_promtool
@pytest.mark.parametrize("heads", ["layer", "top_k", "all"])
def test_promtool_accepts_exposition(heads):
    monitor, _ = tiny_training(
        {"sinks__prometheus__heads": heads, "sinks__prometheus__exclude": []}, nan_at=1
    )
    try:
        body = get(monitor.prometheus_url)[2]
    finally:
        monitor.detach()
    result = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=30
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert b"numwatch_attn_max_logit" in body and b"numwatch_grad_mean" in body


def test_a_port_past_65535_for_a_local_rank_is_a_clear_error(monkeypatch):
    import numwatch
    from numwatch.errors import NumwatchError

    monkeypatch.setenv("LOCAL_RANK", "1")
    monitor = numwatch.Monitor(
        torch.nn.Linear(2, 2), sinks__console__enabled=False, sinks__jsonl__enabled=False,
        sinks__prometheus__enabled=True, sinks__prometheus__port=65535,
    )  # fmt: skip
    with pytest.raises(NumwatchError, match="65535 \\+ local rank 1 = 65536 is past 65535"):
        monitor.attach()
    monkeypatch.setenv("LOCAL_RANK", "abc")
    with pytest.raises(NumwatchError, match="LOCAL_RANK='abc' is not an integer"):
        monitor.attach()


def test_every_metric_of_the_readme_reference_is_documented_here():
    """Five metrics of README's reference had no HELP text: Prometheus got a generic one, and a
    rule on loss_scale was warned about as a probable misspelling."""
    import re
    from pathlib import Path

    from numwatch.sinks.prometheus import DOCUMENTED_METRICS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("## Metric reference", 1)[1].split("\n## ", 1)[0]
    names = set()
    for row in table.splitlines():
        if row.startswith("| `"):
            first = row.split("|")[1]
            names.update(n for n in re.findall(r"`([a-z_*]+)`", first) if "*" not in n)
    assert names and names <= DOCUMENTED_METRICS, sorted(names - DOCUMENTED_METRICS)
