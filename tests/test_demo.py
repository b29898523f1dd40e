"""The demo runs end to end and leaves a JSONL log that a planted NaN shows up in."""

import pytest
import torch

from numwatch.demo import main
from numwatch.sinks.jsonl import read_jsonl, run_starts


def test_demo_short_run_with_planted_nan(tmp_path, capsys):
    log = tmp_path / "demo.jsonl"
    assert main(["--steps", "8", "--flush-every", "4", "--jsonl", str(log), "--nan-at", "5"]) == 0
    records = read_jsonl(log)
    assert [r["step"] for r in records] == [3, 7]
    events = [e for r in records for e in r["events"]]
    assert events[0]["kind"] == "nonfinite" and events[0]["step"] == 5
    assert events[0]["labels"] == {"param": "blocks.1.mlp.2.weight"}
    assert "8 steps" in capsys.readouterr().out


def test_two_demos_on_one_log_are_two_runs(tmp_path, monkeypatch):
    """Every demo wrote run 'demo': a second one appending to the same log at higher steps read
    back as the first one continued (report, replay, tail)."""
    import numwatch.demo as demo

    log = tmp_path / "demo.jsonl"
    names = iter(["demo-20261130T100000Z", "demo-20261130T100100Z"])
    monkeypatch.setattr(demo, "_run_name", lambda: next(names))
    common = ["--flush-every", "4", "--jsonl", str(log), "--no-metrics"]
    assert main(["--steps", "4", *common]) == 0
    assert main(["--steps", "8", *common]) == 0
    records = read_jsonl(log)
    assert [r["step"] for r in records] == [3, 3, 7]
    assert run_starts(records) == [0, 1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--flush-every", "0"], "--flush-every: must be >= 1, got 0"),
        (["--steps", "-5"], "--steps: must be >= 1, got -5"),
        (["--batch", "0"], "--batch: must be >= 1, got 0"),
        (["--metrics-port", "70000"], "--metrics-port: must be a TCP port in [0, 65535]"),
        (["--device", "bogus"], "--device: Expected one of"),
        pytest.param(
            ["--device", "cuda"],
            "--device: 'cuda': this torch has no usable CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here"),
        ),
        (["--steps", "ten"], "--steps: invalid integer >= 1 value: 'ten'"),
        # tracebacks from torch until session 24
        (["--lr", "-1"], "--lr: must be a finite number >= 0, got -1"),
        (["--lr", "nan"], "--lr: must be a finite number >= 0, got nan"),
        (["--seed", str(2**70)], "--seed: must be in [-2**63, 2**64)"),
        (["--device", "meta"], "--device: 'meta': the demo trains on cpu or cuda"),
        # planted nothing, silently
        (["--steps", "3", "--nan-at", "10"], "--nan-at: step 10 is past the last step (2)"),
    ],
)
def test_bad_demo_arguments_are_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--seed", "-1"], ["--seed", str(2**64 - 1)], ["--lr", "0"]])
def test_the_edges_of_torchs_seed_range_and_a_zero_learning_rate_run(tmp_path, args):
    assert main(["--steps", "1", "--batch", "1", "--no-metrics", "--jsonl",
                 str(tmp_path / "d.jsonl"), *args]) == 0  # fmt: skip


def test_a_log_path_that_is_a_directory_is_a_message_not_a_traceback(tmp_path, capsys):
    assert main(["--steps", "1", "--no-metrics", "--jsonl", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "--jsonl PATH writes another log" in err


def test_a_port_in_use_is_a_message_not_a_traceback(tmp_path, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["--steps", "2", "--jsonl", str(tmp_path / "d.jsonl"), "--metrics-port", str(port)]
        assert main(args) == 2
    err = capsys.readouterr().err
    assert str(port) in err and "--metrics-port N picks another port" in err
