"""The demo runs end to end and leaves a JSONL log that a planted NaN shows up in."""

from numwatch.demo import main
from numwatch.sinks.jsonl import read_jsonl


def test_demo_short_run_with_planted_nan(tmp_path, capsys):
    log = tmp_path / "demo.jsonl"
    assert main(["--steps", "8", "--flush-every", "4", "--jsonl", str(log), "--nan-at", "5"]) == 0
    records = read_jsonl(log)
    assert [r["step"] for r in records] == [3, 7]
    events = [e for r in records for e in r["events"]]
    assert events[0]["kind"] == "nonfinite" and events[0]["step"] == 5
    assert events[0]["labels"] == {"param": "blocks.1.mlp.2.weight"}
    assert "8 steps" in capsys.readouterr().out
