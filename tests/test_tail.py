"""`numwatch tail`: follows a log that grows (partial lines, late creation, a new run on the same
path) and prints one line per flush and per event."""

from __future__ import annotations

import json
import threading
import time

from numwatch.cli import main as cli
from numwatch.events import Event
from numwatch.sinks.jsonl import JsonlSink
from numwatch.sinks.tail import follow, record_to_snapshot
from numwatch.snapshot import MetricRecord, Snapshot


def line(step: int, loss: float | str = 1.0) -> bytes:
    record = {
        "schema": 1,
        "run": "t",
        "step": step,
        "time": 1.0,
        "rank": 0,
        "metrics": [{"name": "loss", "labels": {}, "value": loss}],
        "events": [],
    }
    return (json.dumps(record) + "\n").encode()


def test_follow_partial_lines_late_file_and_new_run(tmp_path):
    path = tmp_path / "run.jsonl"
    done = threading.Event()
    seen = []

    def reader():
        for record in follow(path, poll=0.01, stop=done.is_set):
            seen.append(record["step"])

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        time.sleep(0.05)  # the file does not exist yet
        with path.open("ab") as f:
            f.write(line(1))
            f.flush()
            half = line(2)
            f.write(half[:10])  # a line still being written
            f.flush()
            time.sleep(0.05)
            assert seen == [1]
            f.write(half[10:])
            f.flush()
        deadline = time.monotonic() + 5
        while seen != [1, 2] and time.monotonic() < deadline:
            time.sleep(0.01)
        path.write_bytes(line(0))  # a new run truncates the path
        deadline = time.monotonic() + 5
        while seen != [1, 2, 0] and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        done.set()
        thread.join(timeout=5)
    assert seen == [1, 2, 0]


def test_record_round_trip_with_non_finite_values(tmp_path):
    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, "t")
    event = Event(kind="spike", step=3, message="m", rule="r", labels={"param": "w"}, value=9.0)
    sink.emit(Snapshot(3, [MetricRecord("loss", {}, float("nan"))], time=2.0), [event])
    sink.close()
    (record,) = follow(path, stop=lambda: True)
    snapshot, events = record_to_snapshot(record)
    assert snapshot.step == 3 and snapshot.get("loss") != snapshot.get("loss")  # NaN back
    assert events[0].rule == "r" and events[0].labels == {"param": "w"} and events[0].value == 9.0


def test_cli_prints_last_flushes_and_events(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, "t")
    for step in range(5):
        events = [Event(kind="nonfinite", step=step, message="NaN here", rule="nonfinite")]
        sink.emit(Snapshot(step, [MetricRecord("loss", {}, 0.5)], time=1.0), events[: step == 4])
    sink.close()
    assert cli(["tail", str(path), "--no-follow", "-n", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [o.split(" | ")[0] for o in out if o.startswith("numwatch")] == [
        "numwatch step 3",
        "numwatch step 4",
    ]
    assert any("nonfinite step 4 nonfinite" in o and "NaN here" in o for o in out)
    assert cli(["tail", str(tmp_path / "missing.jsonl"), "--no-follow"]) == 1


def test_a_record_of_late_events_prints_its_events_only(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, "t")
    sink.emit(Snapshot(7, [MetricRecord("loss", {}, 0.5)], time=1.0), [])
    sink.emit_events([Event(kind="action", step=7, message="lr_backoff: x0.5", rule="spike")])
    sink.close()
    assert cli(["tail", str(path), "--no-follow"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [o.split(" | ")[0] for o in out if o.startswith("numwatch")] == ["numwatch step 7"]
    assert [o for o in out if not o.startswith("numwatch")] == [
        "  action step 7 spike  — lr_backoff: x0.5"
    ]
