"""`numwatch report`: a planted run log gives the summary, heads and events it holds, with
embedded PNG plots and markers at the events and mitigations."""

from __future__ import annotations

import base64
import gzip
import io
import json
import lzma
import math
import re
import shutil
import subprocess
import sys

import pytest
from conftest import LONG_LOG_FLUSHES, LONG_LOG_PARAMS, peak_memory

from numwatch.cli import main as cli
from numwatch.errors import NumwatchError
from numwatch.events import Event
from numwatch.sinks.jsonl import JsonlSink
from numwatch.sinks.report import load_run, render_html, summary_rows, write_report
from numwatch.snapshot import MetricRecord, Snapshot

pytest.importorskip("matplotlib", reason="numwatch[report] extra (matplotlib) not installed")


def flush(step: int, *, logit: float, repeated: float, stabilized: float, loss: float, skipped=0):
    records = [
        MetricRecord("loss", {}, loss),
        MetricRecord("grad_norm", {}, 1.0 + step / 100),
        MetricRecord("grad_absmax", {"param": "w"}, 0.5),
        MetricRecord("grad_nonfinite", {"param": "w"}, 3.0 if step == 29 else 0.0),
        MetricRecord("step_seconds", {}, 0.1),
        MetricRecord("monitor_overhead_seconds", {}, 0.002),
        MetricRecord("mitigation_skipped_steps_total", {}, float(skipped)),
        MetricRecord("mitigation_lr_factor", {}, 1.0),
    ]
    for layer in range(2):
        name = f"blocks.{layer}.attn"
        records.append(MetricRecord("attn_kernel_stabilized", {"layer": name}, stabilized))
        for head in range(3):
            labels = {"layer": name, "head": str(head)}
            hot = layer == 1 and head == 2
            records.append(MetricRecord("attn_max_logit", labels, logit if hot else 5.0))
            records.append(
                MetricRecord("attn_repeated_max_fraction", labels, repeated if hot else 0.0)
            )
    return Snapshot(step, records, time=1000.0 + step)


PRECURSOR = Event(
    kind="precursor",
    step=19,
    message="[attn_repeated_max] attn_repeated_max_fraction = 0.3 > 0.05 for 3 flushes",
    rule="attn_repeated_max",
    metric="attn_repeated_max_fraction",
    labels={"layer": "blocks.1.attn", "head": "2"},
    value=0.3,
    threshold=0.05,
)
SWAP = Event(
    kind="action",
    step=19,
    message="swap_attention_kernel: routed layer 'blocks.1.attn' to the stabilized kernel",
    severity="info",
    rule="attn_repeated_max",
    labels={"layer": "blocks.1.attn", "head": "2"},
)
NAN = Event(
    kind="nonfinite",
    step=27,
    message="NaN/Inf first seen in the gradient of param 'w' (backward) at step 27",
    severity="critical",
    rule="nonfinite",
    labels={"param": "w"},
)


@pytest.fixture
def log(tmp_path):
    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, "planted")
    sink.emit(flush(9, logit=10.0, repeated=0.0, stabilized=0.0, loss=3.0), [])
    sink.emit(flush(19, logit=40.0, repeated=0.3, stabilized=0.0, loss=2.0), [PRECURSOR, SWAP])
    sink.emit(flush(29, logit=120.0, repeated=0.1, stabilized=1.0, loss=1.5, skipped=1), [NAN])
    sink.emit(flush(39, logit=90.0, repeated=0.0, stabilized=1.0, loss=1.2, skipped=1), [])
    sink.close()
    return path


def text_of(page: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))


def test_summary_heads_and_events(log):
    page = render_html(load_run(log))
    text = text_of(page)
    assert "steps 9 .. 39 in 4 flushes" in text
    assert "events 1 precursor, 1 action, 1 nonfinite" in text
    assert "loss last 1.2, lowest 1.2, largest 3 at flush step 9" in text
    assert "grad_nonfinite elements first at flush step 29, 3 in all" in text
    assert "largest attention logit 120 at step 29 (head=2, layer=blocks.1.attn)" in text
    assert "most repeated-max rows 0.3 at step 19 (head=2, layer=blocks.1.attn)" in text
    assert "skipped optimizer steps 1" in text
    assert "layers on the stabilized kernel at the end blocks.0.attn, blocks.1.attn" in text
    assert "monitor overhead 2.00 ms/step (2.0 % of 100.0 ms)" in text
    # heads that triggered: only the precursor names a head (actions are not triggers)
    heads = page.split("Heads that triggered")[1].split("</table>")[0]
    assert text_of(heads).strip() == (
        "layer head rules (events) first step last step blocks.1.attn 2 attn_repeated_max x1 19 19"
    )
    assert "NaN/Inf first seen in the gradient of param &#x27;w&#x27;" in page


def test_page_is_self_contained_with_png_plots(log, tmp_path):
    out = write_report(log, tmp_path / "r.html")
    page = out.read_text()
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(images) == 4  # training, attention, tensors, cost
    assert all(base64.b64decode(b).startswith(b"\x89PNG\r\n\x1a\n") for b in images)
    assert not re.search(r"(src|href)=['\"]?https?:", page)


def test_markers_at_events_and_mitigations(log):
    from matplotlib.figure import Figure

    from numwatch.sinks.report import _markers

    ax = Figure().subplots()
    _markers(ax, load_run(log))
    vertical = sorted(line.get_xdata()[0] for line in ax.lines if line.get_marker() in ("None", ""))
    assert vertical == [19, 19, 27]  # precursor and action at 19, nonfinite at 27
    skipped = [line.get_xdata()[0] for line in ax.lines if line.get_marker() == "v"]
    assert skipped == [29]
    # the stabilized kernel ran in the windows (19, 29] and (29, 39]: one span from 19 to 39
    (span,) = ax.patches
    assert (span.get_x(), span.get_x() + span.get_width()) == (19, 39)


def test_last_run_of_a_reused_log(log):
    sink = JsonlSink(log, "second")  # the same path again: a new run appends
    sink.emit(flush(4, logit=1.0, repeated=0.0, stabilized=0.0, loss=9.0), [])
    sink.close()
    run = load_run(log)
    assert run.name == "second" and run.steps == [4] and run.skipped_runs == 1
    assert "the last of 2 runs" in render_html(run)


def test_the_report_folder_is_made(log, tmp_path):
    target = write_report(log, tmp_path / "new" / "folder" / "run.html")
    assert target.is_file()


def test_a_second_flush_of_one_step_replaces_its_values(tmp_path):
    """flush() at the end of training, then detach(): two records of the last step; the report
    summed them (the last loss doubled)."""
    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, "twice")
    sink.emit(flush(9, logit=10.0, repeated=0.0, stabilized=0.0, loss=3.0), [])
    sink.emit(flush(19, logit=40.0, repeated=0.0, stabilized=0.0, loss=2.0), [])
    sink.emit(flush(19, logit=40.0, repeated=0.0, stabilized=0.0, loss=2.0), [])
    sink.close()
    run = load_run(path)
    assert run.scalar("loss") == [(9, 3.0), (19, 2.0)]
    assert run.scalar("step_seconds") == [(9, 0.1), (19, 0.1)]
    assert run.layer_series("attn_max_logit")["blocks.1.attn"] == [(9, 10.0), (19, 40.0)]


def test_a_long_log_is_read_into_compact_series(long_log):
    """A week-long run's log is read record by record into 16-byte points: reading whole
    records held about 11x the log's size (1 GB for a 91 MB log)."""
    run, peak = peak_memory(lambda: load_run(long_log))
    assert run.steps == [10 * i for i in range(LONG_LOG_FLUSHES)]
    series = run.series["grad_absmax"][(("param", "layers.7.weight"),)]
    assert list(series) == [(10 * i, float(i + 7)) for i in range(LONG_LOG_FLUSHES)]
    points = LONG_LOG_FLUSHES * LONG_LOG_PARAMS
    assert peak < 40 * points, peak  # the records alone: ~500 B a point


@pytest.mark.parametrize("suffix, opener", [(".gz", gzip.open), (".xz", lzma.open)])
def test_compressed_log_reads_the_same(log, tmp_path, suffix, opener):
    """Archived logs are compressed (the harness writes gzip, bench/results keeps xz); the
    report reads them as they are and names its page after the log, not the compression."""
    packed = tmp_path / f"run.jsonl{suffix}"
    with log.open("rb") as f, opener(packed, "wb") as g:
        shutil.copyfileobj(f, g)
    plain, archived = load_run(log), load_run(packed)
    assert archived.steps == plain.steps and archived.series == plain.series
    assert cli(["report", str(packed)]) == 0
    assert (tmp_path / "run.html").is_file()


def test_cli(log, tmp_path, capsys):
    out = tmp_path / "cli.html"
    assert cli(["report", str(log), "-o", str(out)]) == 0
    assert out.is_file() and "wrote" in capsys.readouterr().out
    assert cli(["report", str(tmp_path / "missing.jsonl")]) == 1
    assert "no run log" in capsys.readouterr().err
    assert cli(["report", str(log), "-o", str(tmp_path)]) == 1  # a folder: was a traceback
    assert "Is a directory" in capsys.readouterr().err


def test_the_report_never_overwrites_the_run_log(log, tmp_path, capsys):
    """``numwatch report LOG -o LOG`` replaced the run log with the HTML page (exit 0)."""
    before = log.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(log)
    for target in (log, link, tmp_path / "." / log.name):
        assert cli(["report", str(log), "-o", str(target)]) == 1
        assert f"{str(target)!r} is the run log itself" in capsys.readouterr().err
    assert log.read_bytes() == before


def test_a_series_of_one_point_is_drawn(tmp_path):
    """A line through one point draws nothing: a run after its first flush had empty plots."""
    from matplotlib.figure import Figure

    from numwatch.sinks.report import _plot

    ax = Figure().subplots()
    _plot(ax, [(9, 3.0)], "loss")
    (line,) = ax.get_lines()
    assert line.get_marker() == "." and list(line.get_xdata()) == [9]


def test_python_dash_m_numwatch(log, tmp_path):
    out = tmp_path / "module.html"
    cmd = [sys.executable, "-m", "numwatch", "report", str(log), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and out.is_file(), done.stderr
    bad = subprocess.run([sys.executable, "-m", "numwatch", "nope"], capture_output=True)
    assert bad.returncode == 2


def test_without_matplotlib_says_what_to_install(log, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(NumwatchError, match=r"numwatch\[report\]"):
        write_report(log, tmp_path / "x.html")


def test_late_events_and_a_repeated_step_stay_in_the_run(tmp_path):
    """A manual flush with no new step repeats step 19; detach writes what its action did in a
    record of its own, with no metrics: one run, three flushes, every event."""
    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, "planted")
    sink.emit(flush(9, logit=10.0, repeated=0.0, stabilized=0.0, loss=3.0), [])
    sink.emit(flush(19, logit=40.0, repeated=0.3, stabilized=0.0, loss=2.0), [PRECURSOR])
    sink.emit(flush(19, logit=40.0, repeated=0.3, stabilized=0.0, loss=2.0), [])
    sink.emit_events([SWAP])
    sink.close()
    run = load_run(path)
    assert (run.skipped_runs, run.steps) == (0, [9, 19, 19])
    assert [e["kind"] for e in run.events] == ["precursor", "action"]
    assert "steps 9 .. 19 in 3 flushes" in text_of(render_html(run))


def test_a_log_cut_short_by_a_crash(log, tmp_path, capsys):
    log.write_bytes(log.read_bytes()[:-100])
    assert cli(["report", str(log), "-o", str(tmp_path / "r.html")]) == 0
    assert "steps 9 .. 29 in 3 flushes" in text_of((tmp_path / "r.html").read_text())


def test_names_are_drawn_verbatim(tmp_path):
    """'$...$' would be mathtext (an unknown command raises); a legend drops labels that begin
    with '_' (torch.compile's '_orig_mod.')."""
    from matplotlib.figure import Figure

    from numwatch.sinks.report import _legend, _plot

    names = ["cost$_{a}$", "bad$\\undefinedcmd$", "_orig_mod.w", "plain"]
    fig = Figure()
    ax = fig.subplots()
    for name in names:
        _plot(ax, [(1, 1.0), (2, 2.0)], name)
    _legend(ax, len(names))
    fig.savefig(io.BytesIO(), format="png")  # draws the text
    shown = [t._preprocess_math(t.get_text()) for t in ax.get_legend().get_texts()]
    assert [text.strip() for text, _ in shown] == names and not any(math for _, math in shown)
    path = tmp_path / "run.jsonl"
    metrics = [{"name": "grad_absmax", "labels": {"param": n}, "value": 1.0} for n in names]
    record = {"schema": 1, "run": "r", "step": 1, "time": 0.0, "rank": 0, "events": []}
    path.write_text(json.dumps(dict(record, metrics=metrics)) + "\n")
    assert cli(["report", str(path)]) == 0


def test_overhead_with_untimed_steps(tmp_path):
    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, "r")
    for step in (1, 2):
        records = [
            MetricRecord("step_seconds", {}, 0.0),
            MetricRecord("monitor_overhead_seconds", {}, 0.001),
        ]
        sink.emit(Snapshot(step, records, time=float(step)), [])
    sink.close()
    assert "monitor overhead 1.00 ms/step" in text_of(render_html(load_run(path)))


def test_skips_are_marked_at_their_steps_from_the_action_events(tmp_path, monkeypatch):
    """The markers came from increases of the counter between flushes: a skip in the first
    window was never marked, one at the last flush's step read 'skipped optimizer steps 0'."""
    from matplotlib.axes import Axes

    from numwatch.sinks import report

    def skip(step):
        return Event(
            kind="action",
            step=step,
            message=f"skip_step: skipped step {step}",
            severity="info",
            rule="nonfinite",
            evidence={"action": "skip_step"},
        )

    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, "skips")
    common = {"logit": 5.0, "repeated": 0.0, "stabilized": 0.0, "loss": 1.0}
    sink.emit(flush(1, **common), [skip(0)])  # the counter shows it from the next flush
    sink.emit(flush(3, **common, skipped=1), [])
    sink.emit(flush(5, **common, skipped=1), [skip(5)])  # the last flush: counter still 1
    sink.close()
    run = load_run(path)
    rows = dict(report.summary_rows(run))
    assert rows["skipped optimizer steps"] == "2"
    marked = []
    real = Axes.plot

    def plot(self, *args, **kwargs):
        if kwargs.get("marker") == "v":
            marked.append(args[0][0])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", plot)
    report._training_plot(run)
    assert sorted(set(marked)) == [0, 5]


def test_the_summary_names_each_routed_layers_kernel_mode(tmp_path):
    """A layer on plain_split read like a native one (only attn_kernel_stabilized was read),
    and stabilized_split like stabilized."""
    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, "modes")
    for step, modes in (
        (9, {"a": "plain_split"}),
        (19, {"a": "plain_split", "b": "stabilized_split"}),
    ):
        records = [MetricRecord("loss", {}, 1.0)]
        records += [MetricRecord("attn_kernel_mode", {"layer": layer, "mode": mode}, 1.0)
                    for layer, mode in modes.items()]  # fmt: skip
        sink.emit(Snapshot(step, records, time=float(step)), [])
    sink.close()
    rows = dict(summary_rows(load_run(path)))
    assert rows["numwatch kernel modes at the end"] == "a: plain_split, b: stabilized_split"


def _nan_loss_run(log, rules, *, steps, nan_at, flush_every=1, attach_optimizer=True):
    """A linear model whose loss is NaN at step ``nan_at``; the monitor's log at ``log``."""
    import torch

    import numwatch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = numwatch.Monitor(
        model, flush_every=flush_every, rules=rules, sinks__jsonl__path=str(log),
        sinks__console__enabled=False,
    )  # fmt: skip
    monitor.attach(opt if attach_optimizer else None)
    for step in range(steps):
        loss = model(torch.randn(2, 4)).sum() * (float("nan") if step == nan_at else 1.0)
        loss.backward()
        monitor.step(loss)
        opt.step()
        opt.zero_grad()
    monitor.detach()
    return monitor


def test_an_action_that_failed_at_the_last_flush_is_on_record(tmp_path):
    """The error count of the last flush before detach reached no flush record: a snapshot
    that failed at the NaN that ended a run read as 'monitor errors none' in the report."""
    from numwatch.sinks.jsonl import read_jsonl

    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the snapshot directory should be
    snapshot = {"type": "snapshot", "directory": str(blocked / "snaps")}
    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": [snapshot]}]}
    log = tmp_path / "run.jsonl"
    monitor = _nan_loss_run(log, rules, steps=3, nan_at=2)
    assert monitor.errors == {"actions": 1}
    failed = [e for r in read_jsonl(log) for e in r["events"] if e["evidence"].get("failed")]
    assert len(failed) == 1 and failed[0]["message"].startswith("snapshot: failed (")
    assert ("monitor errors", "actions: 1") in summary_rows(load_run(log))


def test_a_failed_skip_step_is_no_skipped_step(tmp_path):
    """A skip_step that failed (no optimizer attached) is an action event too, which the report
    counted as a withheld update while the weights went NaN and the counter stayed 0."""
    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]}
    log = tmp_path / "run.jsonl"
    _nan_loss_run(log, rules, steps=4, nan_at=1, flush_every=2, attach_optimizer=False)
    rows = dict(summary_rows(load_run(log)))
    assert rows["skipped optimizer steps"] == "0" and rows["monitor errors"].startswith("actions:")


def test_values_near_the_float64_maximum_are_drawn_at_a_bound(tmp_path, capsys):
    """matplotlib overflows on a log axis or a linear one near float64's maximum: a float64
    run whose gradient norm reached 1.7e308 (finite) got a traceback and no report."""
    from matplotlib.figure import Figure

    from numwatch.sinks.report import _plot

    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, "huge")
    for step, v in ((1, 1e308), (2, 1.7e308)):
        records = [MetricRecord("loss", {}, 1e308), MetricRecord("grad_norm", {}, v),
                   MetricRecord("grad_absmax", {"param": "w"}, v)]  # fmt: skip
        sink.emit(Snapshot(step, records, time=float(step)), [])
    sink.close()
    out = tmp_path / "r.html"
    assert cli(["report", str(path), "-o", str(out)]) == 0, capsys.readouterr().err
    page = out.read_text()
    assert len(re.findall(r"src='data:image/png;base64,", page)) == 2  # training, tensors
    assert "could not be drawn" not in page
    assert "largest |gradient| 1.7e+308 at step 2 (param=w)" in text_of(page)
    ax = Figure().subplots()
    _plot(ax, [(1, 1e308), (2, -1.7e308), (3, 5.0), (4, math.inf), (5, math.nan)], "g")
    (line,) = ax.get_lines()
    assert list(line.get_ydata())[:4] == [1e300, -1e300, 5.0, math.inf]
    assert math.isnan(line.get_ydata()[4])
    assert [t.get_text() for t in ax.texts] == ["|values| past 1e+300 drawn at 1e+300"]


def test_a_plot_that_cannot_be_drawn_costs_that_plot_only(log, tmp_path, monkeypatch):
    """One plot failing to draw (matplotlib on data it cannot scale) cost the whole report."""
    from matplotlib.axes import Axes

    real = Axes.plot

    def plot(self, *args, **kwargs):
        if kwargs.get("label") == "loss":
            raise OverflowError("cannot convert float infinity to integer")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", plot)
    page = write_report(log, tmp_path / "r.html").read_text()
    training = page.split("<h2>Training</h2>")[1].split("<h2>")[0]
    assert training == (
        "<p class='note'>This plot could not be drawn "
        "(OverflowError: cannot convert float infinity to integer).</p>"
    )
    assert len(re.findall(r"src='data:image/png;base64,", page)) == 3  # attention, tensors, cost
    assert "steps 9 .. 39 in 4 flushes" in text_of(page)


def drawn(monkeypatch, draw, run):
    """{axes title: {label: y values}} of the plot ``draw`` makes of ``run``."""
    from numwatch.sinks import report

    monkeypatch.setattr(report, "_finish", lambda fig, axes, run: axes)
    return {
        ax.get_title(loc="left"): {line.get_label(): list(line.get_ydata()) for line in ax.lines}
        for ax in draw(run)
    }


def test_the_entropy_plot_draws_the_mean_not_the_causal_zero_minimum(tmp_path, monkeypatch):
    """The plot drew attn_entropy_min, 0 in every causal layer: a flat line at 0."""
    from numwatch.sinks.report import _attention_plot

    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, "entropy")
    for step, low in ((9, 2.5), (19, 0.75)):
        records = []
        for head, mean in (("0", 3.0), ("1", low)):
            labels = {"layer": "h.0.attn", "head": head}
            records.append(MetricRecord("attn_entropy_min", labels, 0.0))
            records.append(MetricRecord("attn_entropy_mean", labels, mean))
        sink.emit(Snapshot(step, records, time=float(step)), [])
    sink.close()
    plots = drawn(monkeypatch, _attention_plot, load_run(path))
    assert plots == {"Mean softmax-row entropy, nats (lowest head)": {"h.0.attn": [2.5, 0.75]}}


def test_a_loss_spike_between_flushes_shows_in_the_plot_and_the_summary(tmp_path, monkeypatch):
    """Only each flush's last-step loss was read: a spike, even an Inf, at a step between two
    flushes was in the log (loss_max, loss_mean) and nowhere in the report."""
    from numwatch.sinks.report import _training_plot

    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, "spike")
    windows = [(9, 3.0, 4.0, 3.5), (19, 2.75, 232.0, 25.5), (29, 2.5, 3.0, 2.75)]
    for step, last, top, mean in windows:
        records = [MetricRecord(n, {}, v) for n, v in zip(LOSSES, (last, top, mean), strict=True)]
        sink.emit(Snapshot(step, records, time=float(step)), [])
    assert dict(summary_rows(load_run(path)))["loss"] == (
        "last 2.5, lowest 2.5, largest 232 at flush step 19"
    )
    inf = math.inf
    records = [MetricRecord(n, {}, v) for n, v in zip(LOSSES, (2.25, inf, inf), strict=True)]
    sink.emit(Snapshot(39, records, time=39.0), [])
    sink.close()
    run = load_run(path)
    assert dict(summary_rows(run))["loss"] == "last 2.25, lowest 2.25, largest inf at flush step 39"
    assert drawn(monkeypatch, _training_plot, run) == {
        "Loss": {
            "loss": [3.0, 2.75, 2.5, 2.25],
            "loss_max": [4.0, 232.0, 3.0, inf],
            "loss_mean": [3.5, 25.5, 2.75, inf],
            "loss_max NaN/Inf": [1.0],
        }
    }


LOSSES = ("loss", "loss_max", "loss_mean")
