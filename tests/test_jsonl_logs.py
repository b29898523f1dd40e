"""The JSONL log read back: where the runs of a reused path begin, a line a crash cut short, a
new run appended after a crash, non-finite event values."""

from __future__ import annotations

import math

from numwatch.events import Event
from numwatch.sinks.jsonl import JsonlSink, read_jsonl, run_starts
from numwatch.snapshot import MetricRecord, Snapshot


def flush(step: int) -> Snapshot:
    return Snapshot(step, [MetricRecord("loss", {}, 1.0)], time=float(step))


def write(path, run: str, steps, late: list[Event] | None = None) -> None:
    sink = JsonlSink(path, run)
    for step in steps:
        sink.emit(flush(step), [])
    if late:
        sink.emit_events(late)
    sink.close()


def test_a_repeated_step_stays_in_the_run_a_new_name_or_an_earlier_step_starts_one(tmp_path):
    path = tmp_path / "run.jsonl"
    # a manual flush with no new step repeats step 9; detach's record of late events too
    write(path, "a", [4, 9, 9], late=[Event(kind="action", step=9, message="lr_backoff: x0.5")])
    write(path, "b", [9])  # the path reused by another run, from the step where "a" ended
    write(path, "b", [2])  # ... and by a restart of that run
    records = read_jsonl(path)
    assert [(r["run"], r["step"]) for r in records] == [
        ("a", 4),
        ("a", 9),
        ("a", 9),
        ("a", 9),
        ("b", 9),
        ("b", 2),
    ]
    assert run_starts(records) == [0, 4, 5]


def test_a_crash_mid_write_loses_only_its_record_and_a_new_run_starts_a_line(tmp_path, caplog):
    path = tmp_path / "run.jsonl"
    write(path, "a", [1, 2, 3])
    path.write_bytes(path.read_bytes()[:-30])  # the crash: the last record cut short
    with caplog.at_level("WARNING", logger="numwatch"):
        assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "skipped 1 line(s)" in warning and warning.endswith("line 3")
    write(path, "b", [1])  # the path reused: appended after the partial line, not onto it
    write(path, "c", [1])  # a log that ends its last line gets no blank line
    lines = path.read_text().split("\n")
    assert len(lines) == 6 and lines[-1] == "" and all(lines[:-1])
    caplog.clear()
    with caplog.at_level("WARNING", logger="numwatch"):
        records = read_jsonl(path)
    assert [(r["run"], r["step"]) for r in records] == [("a", 1), ("a", 2), ("b", 1), ("c", 1)]
    assert "skipped 1 line(s)" in caplog.text and "line 3" in caplog.text


def test_non_finite_event_values_read_back_as_floats(tmp_path):
    path = tmp_path / "run.jsonl"
    event = Event(kind="spike", step=1, message="m", value=math.inf, threshold=-math.inf)
    nan = Event(kind="nonfinite", step=1, message="m", value=math.nan)
    sink = JsonlSink(path, "a")
    sink.emit(flush(1), [event, nan])
    sink.close()
    first, second = read_jsonl(path)[0]["events"]
    assert (first["value"], first["threshold"]) == (math.inf, -math.inf)
    assert math.isnan(second["value"]) and second["threshold"] is None
