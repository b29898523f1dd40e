"""`numwatch tail`: follows a log that grows (partial lines, late creation, a new run on the same
path) and prints one line per flush and per event."""

from __future__ import annotations

import gzip
import io
import itertools
import json
import lzma
import math
import threading
import time

import pytest
from conftest import LONG_LOG_FLUSHES, peak_memory
from rich.console import Console

from numwatch.cli import main as cli
from numwatch.events import Event
from numwatch.sinks.console import summary_line
from numwatch.sinks.jsonl import JsonlSink
from numwatch.sinks.tail import backlog, follow, record_to_snapshot
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


def test_n_counts_flushes_not_the_records_of_late_events(tmp_path, capsys):
    """The record a detach or halt writes (late events, no metrics) counted as one of the -n
    flushes: on a halted run `-n 1` printed only the halt, `-n 1 --no-events` nothing."""
    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, "t")
    sink.emit_events([Event(kind="action", step=0, message="before", rule="r")])
    for step in (1, 2, 3):
        sink.emit(Snapshot(step, [MetricRecord("loss", {}, 0.5)], time=1.0), [])
        if step > 1:
            sink.emit_events([Event(kind="action", step=step, message="halt", rule="r")])
    sink.close()
    gz = tmp_path / "run.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    written = [(0, False), (1, True), (2, True), (2, False), (3, True), (3, False)]  # (step, flush)
    for log in (path, gz):
        kept = {n: [(r["step"], bool(r["metrics"])) for r in backlog(log, n)[0]] for n in range(5)}
        # a flush with the late records after it; those before the first flush only with -n 4
        assert kept == {0: [], 1: written[4:], 2: written[2:], 3: written[1:], 4: written}
    assert cli(["tail", str(path), "--no-follow", "-n", "1", "--no-events"]) == 0
    assert capsys.readouterr().out.startswith("numwatch step 3 | loss 0.5")


def test_lines_that_are_not_records_are_skipped(tmp_path, capsys, caplog):
    """A crash cut the run's last line short; a new run on the path appended after it."""
    path = tmp_path / "run.jsonl"
    path.write_bytes(line(1) + line(2)[:25] + b"\n" + line(3))
    assert [r["step"] for r in follow(path, stop=lambda: True)] == [1, 3]
    with caplog.at_level("WARNING", logger="numwatch"):
        assert cli(["tail", str(path), "--no-follow"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [o.split(" | ")[0] for o in out] == ["numwatch step 1", "numwatch step 3"]
    assert "skipped 1 line(s)" in caplog.text and "line 2" in caplog.text


def test_a_compressed_log_is_printed_not_followed(tmp_path, capsys):
    path = tmp_path / "run.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(line(1) + line(2))
    assert cli(["tail", str(path), "--no-follow", "-n", "1"]) == 0
    assert capsys.readouterr().out.startswith("numwatch step 2 | loss 1")
    assert cli(["tail", str(path)]) == 1
    assert "--no-follow" in capsys.readouterr().err


def test_a_compressed_log_cut_short_or_not_compressed_at_all(tmp_path, capsys):
    """A gzip log cut in half printed an EOFError traceback; a plain file named .gz a
    BadGzipFile one (and the readers called it 'ends early')."""
    from numwatch.sinks.jsonl import read_jsonl

    whole = gzip.compress(b"".join(line(s) for s in range(1, 200)))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    assert cli(["tail", str(cut), "--no-follow", "-n", "1"]) == 0
    assert capsys.readouterr().out.startswith("numwatch step ")
    fake = tmp_path / "plain.jsonl.gz"
    fake.write_bytes(line(1))
    assert cli(["tail", str(fake), "--no-follow"]) == 1
    assert "not a compressed log" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a compressed log"):
        read_jsonl(fake)


def test_the_sink_refuses_a_compressed_name(tmp_path):
    """It wrote plain JSON under a .gz name, which no reader could then open."""
    from numwatch.errors import NumwatchConfigError

    for name in ("run.jsonl.gz", "run.jsonl.xz"):
        with pytest.raises(NumwatchConfigError, match="plain JSONL"):
            JsonlSink(tmp_path / name, "r")
        assert not (tmp_path / name).exists()


def plain(markup: str) -> str:
    out = io.StringIO()
    Console(file=out, force_terminal=False, width=500).print(markup)
    return out.getvalue().strip()


ATTENTION = {
    "attn_rows": 8.0,
    "attn_repeated_max_rows": 2.0,
    "attn_saturated_rows": 0.0,
    "attn_max_logit": 12.0,
}


@pytest.mark.parametrize(
    "kept",
    [k for n in range(len(ATTENTION) + 1) for k in itertools.combinations(ATTENTION, n)],
    ids=lambda kept: "+".join(kept) or "none",
)
def test_summary_line_of_any_subset_of_the_attention_metrics(kept):
    """A log written with sinks.jsonl.exclude holds any subset (`numwatch tail` reads it)."""
    metrics = [MetricRecord(name, {"layer": "b"}, ATTENTION[name]) for name in kept]
    text = plain(summary_line(Snapshot(1, metrics, time=0.0), []))
    shares = "attn_rows" in kept
    assert ("repeated-max 25.0%" in text) == (shares and "attn_repeated_max_rows" in kept)
    assert ("saturated 0.0%" in text) == (shares and "attn_saturated_rows" in kept)
    assert ("max_logit 12" in text) == ("attn_max_logit" in kept)


@pytest.mark.parametrize("order", [(12.0, math.nan), (math.nan, 12.0)])
def test_summary_line_shows_a_nan_layer_wherever_it_is(order):
    """A plain max() kept NaN only when it came first: a layer overflowing later in the stack
    (a blow-up's first step) hid behind the finite layers before it."""
    metrics = [MetricRecord("attn_max_logit", {"layer": f"h.{i}", "head": "0"}, v) for i, v in
               enumerate(order)]  # fmt: skip
    metrics += [MetricRecord("grad_absmax", {"param": f"p{i}"}, v) for i, v in enumerate(order)]
    text = plain(summary_line(Snapshot(7, metrics, time=0.0), []))
    assert "max_logit nan" in text and "grad_absmax nan (p" in text, text


def test_summary_line_shows_names_and_messages_verbatim():
    metrics = [
        MetricRecord("grad_absmax", {"param": "heads.[cls].weight"}, 2.0),
        MetricRecord("activation_absmax", {"module": "odd[/]name"}, 3.0),
    ]
    message = "[attn_repeated_max] attn_repeated_max_fraction = 0.67 > 0.05 for 3 flushes"
    event = Event(kind="precursor", step=1, message=message, rule="attn_repeated_max")
    text = plain(summary_line(Snapshot(1, metrics, time=0.0), [event]))
    assert "grad_absmax 2 (heads.[cls].weight)" in text
    assert "act_absmax 3 (odd[/]name)" in text
    assert text.endswith(f"events: 1 precursor — {message}")


def test_the_backlog_of_a_long_log_is_read_from_its_end(long_log, caplog):
    """`numwatch tail -n 1` read the whole log (and split it into lines) to print one record:
    about twice the log's size in memory. A line that is not a record among the last ones is
    still named by its line number."""
    lines = long_log.read_bytes().split(b"\n")
    lines[-3] = lines[-3][:100]  # the last-but-one record, cut short
    long_log.write_bytes(b"\n".join(lines) + b"partial")  # and a line still being written
    size = long_log.stat().st_size
    with caplog.at_level("WARNING", logger="numwatch"):
        (records, end), peak = peak_memory(lambda: backlog(long_log, 2))
    assert [r["step"] for r in records] == [
        10 * (LONG_LOG_FLUSHES - 3),
        10 * (LONG_LOG_FLUSHES - 1),
    ]
    assert end == size - len(b"partial")
    assert f"line {LONG_LOG_FLUSHES - 1}" in caplog.text
    assert peak < size / 4, (peak, size)  # reading it whole: twice its size


@pytest.mark.parametrize(
    "args",
    [
        ["tail", "run.jsonl", "-n", "-1"],
        ["replay", "run.jsonl", "--limit", "-1"],
        ["report", "run.jsonl", "--top", "-1"],
        ["tail", "run.jsonl", "--interval", "-1"],
        ["tail", "run.jsonl", "--interval", "inf"],  # passed, then time.sleep overflowed
    ],
)
def test_negative_counts_are_refused(args, capsys):
    """tail -n -1 printed nothing and replay --limit -1 dropped the last event, silently."""
    with pytest.raises(SystemExit) as exit_:
        cli(args)
    assert exit_.value.code == 2 and f"got {args[-1]}" in capsys.readouterr().err


def _record(step: int, n: int = 3) -> str:
    metrics = [{"name": f"m{i}", "labels": {}, "value": float(step)} for i in range(n)]
    return json.dumps({"schema": 1, "run": "r", "step": step, "time": 0.0, "rank": 0,
                       "metrics": metrics, "events": []})  # fmt: skip


def test_a_long_line_being_written_is_followed_from_its_start(tmp_path):
    """A record still being written that is longer than the first block (a large model's):
    the backlog's offset landed in its middle, and follow() lost it."""
    path = tmp_path / "a.jsonl"
    big = _record(5, n=3000)
    with path.open("w") as f:
        f.write("".join(_record(s) + "\n" for s in range(5)) + big[: len(big) // 2])
    records, offset = backlog(path, 0)
    assert records == [] and offset == path.read_bytes().rfind(b"\n") + 1
    with path.open("a") as f:
        f.write(big[len(big) // 2 :] + "\n")
    assert [r["step"] for r in follow(path, offset=offset, poll=0.01, stop=lambda: True)] == [5]


def test_no_follow_prints_a_last_record_without_its_newline(tmp_path, capsys):
    """Nothing will complete it: it was dropped from a plain log and shown from the same log
    gzipped."""
    (tmp_path / "a.jsonl").write_text(_record(0) + "\n" + _record(1))
    assert cli(["tail", "--no-follow", str(tmp_path / "a.jsonl")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("|")[0].strip() for line in lines] == ["numwatch step 0", "numwatch step 1"]


def test_no_follow_warns_of_a_last_line_a_crash_cut(tmp_path, capsys, caplog):
    """It was dropped without a word, where report and replay warn."""
    (tmp_path / "a.jsonl").write_text(_record(0) + "\n" + _record(1)[:25])
    with caplog.at_level("WARNING", logger="numwatch"):
        assert cli(["tail", "--no-follow", str(tmp_path / "a.jsonl")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("|")[0].strip() for line in lines] == ["numwatch step 0"]
    assert "skipped 1 line(s)" in caplog.text and caplog.text.rstrip().endswith("line 2")


def test_cli_refuses_a_folder_in_one_line(tmp_path, capsys):
    folder = tmp_path / "run.jsonl"
    folder.mkdir()
    assert cli(["tail", str(folder)]) == 1  # follow mode: it raised IsADirectoryError
    assert "is not a file" in capsys.readouterr().err


def test_a_compressed_log_under_a_plain_name_is_read_by_its_bytes(tmp_path, capsys):
    """`gzip -c run.jsonl > run.jsonl.1`: every line was skipped as not a record."""
    from numwatch.sinks.jsonl import compression, read_jsonl

    gz, xz = tmp_path / "run.jsonl.1", tmp_path / "run.old"
    gz.write_bytes(gzip.compress(line(1) + line(2)))
    xz.write_bytes(lzma.compress(line(3)))
    assert (compression(gz), compression(xz)) == (".gz", ".xz")
    assert compression(tmp_path / "missing") is None and compression(tmp_path) is None
    assert [r["step"] for r in read_jsonl(gz)] == [1, 2]
    assert [r["step"] for r in read_jsonl(xz)] == [3]
    assert cli(["tail", str(gz), "--no-follow", "-n", "1"]) == 0
    assert capsys.readouterr().out.startswith("numwatch step 2 | loss 1")
    assert cli(["tail", str(gz)]) == 1
    out = capsys.readouterr()
    assert out.out == "" and "is compressed" in out.err and "--no-follow" in out.err
