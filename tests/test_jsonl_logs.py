"""The JSONL log read back: where the runs of a reused path begin, a line a crash cut short, a
new run appended after a crash, non-finite event values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

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


def test_late_events_of_an_earlier_step_stay_in_the_run(tmp_path, capsys):
    """A NaN at step 2 acted on by the flush of step 4: detach's record of what the action did
    carried the NaN's step, 2, and every reader took it for a new run that held no flush
    (replay: '0 flushes', the report: 'no flushes'). The record now carries the last flush's
    step, and a record without metrics never starts a run, also in logs written before."""
    import torch

    import numwatch
    from numwatch.cli import main as cli
    from numwatch.sinks.report import load_run

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backoff = {"type": "lr_backoff", "factor": 0.5, "steps": 10}
    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": [backoff]}]}
    path = tmp_path / "run.jsonl"
    monitor = numwatch.Monitor(
        model, flush_every=5, rules=rules, sinks__jsonl__path=str(path),
        sinks__console__enabled=False,
    ).attach(opt)  # fmt: skip
    for step in range(5):
        x = torch.randn(5, 4)
        if step == 2:
            x[0, 0] = float("nan")
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    monitor.detach()
    records = read_jsonl(path)
    assert [(r["step"], bool(r["metrics"])) for r in records] == [(4, True), (4, False)]
    assert [e["step"] for e in records[1]["events"]] == [2]  # the event keeps its own step
    old = dict(records[1], step=2)  # as written before: the late record at the event's step
    for log in (path, tmp_path / "old.jsonl"):
        if log != path:
            log.write_text("".join(json.dumps(r) + "\n" for r in (records[0], old)))
        assert run_starts(read_jsonl(log)) == [0]
        run = load_run(log)
        assert (run.skipped_runs, run.steps, len(run.events)) == (0, [4], 2)
        capsys.readouterr()
        assert cli(["replay", str(log), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["runs_in_log"], out["flushes"], out["logged_events"]) == (1, 1, 1)


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


def test_a_write_that_fails_part_way_loses_only_its_record(tmp_path, monkeypatch, caplog):
    """A full disk cut a record short; the record written once there was space again was glued
    onto the cut line and lost with it."""
    import errno
    import os

    import numwatch.sinks.jsonl as jsonl

    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, "a")
    sink.emit(flush(1), [])
    real_write, full = os.write, [True]

    def disk_full(fd: int, data) -> int:
        if not full[0]:
            return real_write(fd, data)
        if len(data) > 20:
            return real_write(fd, data[:20])  # room for 20 bytes, then none
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jsonl.os, "write", disk_full)
    for step in (2, 3):
        with pytest.raises(OSError):
            sink.emit(flush(step), [])
    full[0] = False
    sink.emit(flush(4), [])
    sink.emit_events([Event(kind="action", step=4, message="late", time=4.0)])
    sink.close()
    with caplog.at_level("WARNING", logger="numwatch"):
        records = read_jsonl(path)
    assert [(r["step"], len(r["metrics"])) for r in records] == [(1, 1), (4, 1), (4, 0)]
    # steps 2 and 3 each wrote 20 bytes before the disk was full: two cut lines
    assert "skipped 2 line(s)" in caplog.text and caplog.text.rstrip().endswith("line 2, 3")


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


def test_two_monitors_of_one_process_keep_their_logs_apart(tmp_path, monkeypatch):
    """A GAN's generator and discriminator monitors, made in the same second with the default
    run name and path: each gets its own name and log (they shared one, records interleaved),
    and one explicit path for two attached monitors is refused until the first detaches."""
    import pytest
    import torch
    from torch import nn

    import numwatch
    from numwatch.errors import NumwatchConfigError

    monkeypatch.chdir(tmp_path)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    quiet = {"flush_every": 1, "sinks__console__enabled": False}
    mg = numwatch.Monitor(gen, **quiet).attach()
    md = numwatch.Monitor(disc, **quiet).attach()
    assert mg.run_name != md.run_name and mg.jsonl_path != md.jsonl_path
    for _ in range(2):
        disc(gen(torch.randn(2, 4))).sum().backward()
        mg.step()
        md.step()
    mg.detach()
    md.detach()
    for monitor, numel in ((mg, 16), (md, 4)):  # each log holds its own model's weight
        records = read_jsonl(monitor.jsonl_path)
        assert [r["step"] for r in records] == [0, 1]
        assert {r["run"] for r in records} == {monitor.run_name}
        sizes = {
            m["value"]
            for r in records
            for m in r["metrics"]
            if m["name"] == "grad_numel" and m["labels"].get("param") == "weight"
        }
        assert sizes == {numel}

    path = str(tmp_path / "shared.jsonl")
    first = numwatch.Monitor(gen, sinks__jsonl__path=path, **quiet).attach()
    with pytest.raises(NumwatchConfigError, match="another attached monitor"):
        numwatch.Monitor(disc, sinks__jsonl__path=path, **quiet).attach()
    first.detach()
    numwatch.Monitor(disc, sinks__jsonl__path=path, **quiet).attach().detach()


def test_bad_bytes_and_a_compressed_log_cut_short_are_read_up_to_the_damage(tmp_path):
    """A line of bad UTF-8 raised UnicodeDecodeError for the whole log, and a .gz cut short
    (copied while written) raised EOFError: the records around them are still the run."""
    import gzip
    import json as _json

    good = [
        _json.dumps({"schema": 1, "run": "r", "step": s, "time": 0.0, "rank": 0,
                     "metrics": [{"name": "loss", "labels": {}, "value": 1.0}], "events": []})
        for s in range(200)
    ]  # fmt: skip
    path = tmp_path / "bad.jsonl"
    path.write_bytes(("\n".join(good[:2]) + "\nnot json\n").encode() + b"\x00\xff\n")
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]

    whole = gzip.compress(("\n".join(good) + "\n").encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    steps = [r["step"] for r in read_jsonl(cut)]
    assert steps == list(range(len(steps))) and 0 < len(steps) < 200


_HOLD = """
import sys, time
from numwatch.sinks.jsonl import JsonlSink
sink = JsonlSink(sys.argv[1], "other")
print("holding", flush=True)
time.sleep(60)
"""


def test_a_log_another_process_writes_is_refused_and_a_default_name_moves_on(tmp_path, monkeypatch):
    """Two processes started in one second (a sweep, a job array) took the same default run
    name and interleaved their records in one log: the in-process check could not see the
    other process. The log is locked while written: an explicit path is refused, a default
    run name takes the next suffix."""
    import subprocess
    import sys

    import pytest
    import torch

    import numwatch
    from numwatch import monitor as monitor_module
    from numwatch.errors import LogInUse

    monkeypatch.chdir(tmp_path)
    taken = tmp_path / "numwatch-runs" / "run-20261130T000000Z.rank0.jsonl"
    taken.parent.mkdir()
    other = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(taken)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout.readline().strip() == "holding"
        with pytest.raises(LogInUse, match="another process"):
            JsonlSink(taken, "mine")
        monkeypatch.setattr(monitor_module, "_default_run_name", lambda: "run-20261130T000000Z")
        model = torch.nn.Linear(2, 1)
        monitor = numwatch.Monitor(model, sinks__console__enabled=False).attach()
        assert monitor.run_name == "run-20261130T000000Z-2"
        model(torch.randn(3, 2)).sum().backward()
        monitor.step()
        monitor.detach()
        assert read_jsonl(tmp_path / "numwatch-runs" / "run-20261130T000000Z-2.rank0.jsonl")
        named = numwatch.Monitor(
            model, run_name="run-20261130T000000Z", sinks__console__enabled=False
        )
        with pytest.raises(LogInUse):
            named.attach()
    finally:
        other.kill()
        other.wait()
    assert taken.read_text() == ""  # the other process's log got nothing of ours


def test_a_filesystem_without_flock_still_gets_its_log(tmp_path, monkeypatch, caplog):
    """Lustre with noflock, some FUSE/NFS mounts: flock fails with ENOLCK. Every such failure
    read as 'log in use': no log at all, and with a default name 1000 empty files were made."""
    import errno

    import torch

    import numwatch
    from numwatch.sinks import jsonl

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(jsonl.fcntl, "flock", flock)
    monkeypatch.setattr(jsonl, "_LOCK_UNSUPPORTED", [])
    model = torch.nn.Linear(4, 4)
    path = str(tmp_path / "runs" / "{run_name}.jsonl")
    with caplog.at_level("WARNING", logger="numwatch"):
        monitor = numwatch.Monitor(model, sinks__jsonl__path=path, sinks__console__enabled=False)
        monitor.attach()
    model(torch.randn(2, 4)).sum().backward()
    monitor.step()
    monitor.detach()
    assert len(list((tmp_path / "runs").iterdir())) == 1
    assert read_jsonl(monitor.jsonl_path) and "cannot lock the log" in caplog.text


def test_a_forked_child_does_not_keep_the_log_locked_after_detach(tmp_path):
    """A DataLoader worker forked while attached shares the log's open file and so its flock:
    re-attaching to the same run's log was refused while the worker lived."""
    import torch
    from conftest import forked_child

    import numwatch

    model = torch.nn.Linear(2, 1)
    options = {"run_name": "exp", "sinks__console__enabled": False,
               "sinks__jsonl__path": str(tmp_path / "{run_name}.jsonl")}  # fmt: skip
    monitor = numwatch.Monitor(model, **options).attach()
    with forked_child():  # lives on past the parent's detach
        monitor.detach()
        numwatch.Monitor(model, **options).attach().detach()  # was refused: LogInUse


def test_a_default_name_is_not_renamed_per_rank(tmp_path, monkeypatch):
    """Each rank took its own suffix: two jobs started in one second paired one job's rank 0
    with the other's rank 1. A distributed run is refused and told to set run_name."""
    import pytest
    import torch

    import numwatch
    from numwatch import monitor as monitor_module
    from numwatch.errors import LogInUse

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(monitor_module, "_default_run_name", lambda: "run-20261130T000000Z")
    model = torch.nn.Linear(2, 1)
    first = numwatch.Monitor(model, sinks__console__enabled=False).attach()
    monkeypatch.setattr(monitor_module, "get_world_size", lambda: 2)
    try:
        with pytest.raises(LogInUse, match="set run_name"):
            numwatch.Monitor(torch.nn.Linear(2, 1), sinks__console__enabled=False).attach()
    finally:
        first.detach()


def test_an_unusable_log_path_is_a_config_error_naming_the_setting(tmp_path):
    """A parent that is a file, a folder as the path, a folder that cannot be created: attach
    raised a raw OSError ('File exists' for the first) that did not name sinks.jsonl.path."""
    import sys

    import pytest
    import torch

    import numwatch
    from numwatch.errors import NumwatchConfigError

    (tmp_path / "afile").touch()
    cases = [
        (tmp_path / "afile" / "run.jsonl", f"{str(tmp_path / 'afile')!r} is a file, not a folder"),
        (tmp_path / "afile" / "sub" / "run.jsonl", f"{str(tmp_path / 'afile')!r} is a file"),
        (tmp_path, "it is a folder, not a file"),
    ]
    if sys.platform == "linux":  # procfs refuses new folders
        cases.append(
            (Path("/proc/numwatch/run.jsonl"), "its folder '/proc/numwatch' cannot be created")
        )
    model = torch.nn.Linear(4, 4)
    for path, problem in cases:
        monitor = numwatch.Monitor(
            model, sinks__jsonl__path=str(path), sinks__console__enabled=False
        )
        with pytest.raises(NumwatchConfigError) as err:
            monitor.attach()
        assert str(err.value).startswith(
            f"sinks.jsonl.path {str(path)!r} cannot be written: {problem}"
        )
        assert not monitor.attached and not model._forward_pre_hooks and not model._forward_hooks
        assert not model.weight._post_accumulate_grad_hooks
