"""The examples run (tiny settings, CPU) and the overhead benchmark's harness works."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from numwatch.events import Event
from numwatch.sinks.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("attention", ["sdpa", "eager", "stabilized"])
def test_gpt2_example_trains_with_the_monitor(tmp_path, attention):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import gpt2
    finally:
        sys.path.pop(0)
    log = tmp_path / "run.jsonl"
    args = f"--preset tiny --steps 4 --batch 2 --attention {attention} --flush-every 2"
    out = gpt2.main([*args.split(), "--jsonl", str(log)])
    assert out["loss"] > 0
    records = read_jsonl(log)
    assert [r["step"] for r in records] == [1, 3]
    layers = {m["labels"]["layer"] for m in records[0]["metrics"] if m["name"] == "attn_rows"}
    assert layers == {"h.0.attn", "h.1.attn"}


def test_gpt2_example_keeps_the_configs_flush_every(tmp_path):
    """--config's flush_every was overridden by --flush-every's default of 10."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import gpt2
    finally:
        sys.path.pop(0)
    config = tmp_path / "nw.yaml"
    config.write_text("flush_every: 2\n")
    log = tmp_path / "run.jsonl"
    gpt2.main(["--preset", "tiny", "--steps", "6", "--batch", "2", "--config", str(config),
               "--jsonl", str(log)])  # fmt: skip
    assert [r["step"] for r in read_jsonl(log)] == [1, 3, 5]


def test_a_healthy_eager_warm_up_raises_no_default_event(tmp_path):
    """attn_saturated at 10 % fired on this healthy run (its first three attention samples, max
    logits 0.2-0.35: near-uniform rows of small heads)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import gpt2
    finally:
        sys.path.pop(0)
    log = tmp_path / "run.jsonl"
    gpt2.main(["--preset", "tiny", "--steps", "110", "--attention", "eager", "--jsonl", str(log)])
    assert [e for r in read_jsonl(log) for e in r["events"]] == []


def test_gpt2_example_nope_sinks_make_repeated_maxima(tmp_path):
    """--data sinks with --no-pos-emb: every sequence starts with identical BOS tokens whose
    layer-0 keys are bitwise equal, so the probe sees rows with a repeated maximum; with the
    position embedding the same data gives distinct keys."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import gpt2
    finally:
        sys.path.pop(0)
    n = gpt2.SINK_TOKENS
    keys = {}
    for flag in ("--no-pos-emb", ""):
        args = gpt2.parse(f"--preset tiny --data sinks --device cpu {flag}".split())
        model, _ = gpt2.build(args)
        assert (model.wpe is None) == bool(flag)
        x, _ = next(gpt2.batches(model.cfg, 2, "sinks", 0, "cpu"))
        assert (x[:, :n] == 0).all() and (x[:, n:] != 0).all()
        c = model.cfg.n_embd
        h = model.wte(x) + (model.wpe(torch.arange(x.shape[1])) if model.wpe is not None else 0)
        keys[flag] = model.h[0].attn.c_attn(model.h[0].ln_1(h))[:, :n, c : 2 * c]
    nope = keys["--no-pos-emb"]
    assert torch.equal(nope, nope[:, :1].expand_as(nope))
    assert not torch.equal(keys[""][:, 1], keys[""][:, 0])
    log = tmp_path / "run.jsonl"
    args = "--preset tiny --steps 2 --batch 2 --data sinks --no-pos-emb --flush-every 2"
    gpt2.main([*args.split(), "--jsonl", str(log), "--device", "cpu"])
    (record,) = read_jsonl(log)
    repeated = [m["value"] for m in record["metrics"] if m["name"] == "attn_repeated_max_rows"
                and m["labels"]["layer"] == "h.0.attn"]  # fmt: skip
    assert sum(repeated) > 0


def test_overhead_benchmark_harness(tmp_path):
    out = tmp_path / "overhead.json"
    args = "--preset tiny --device cpu --steps 2 --warmup 1 --rounds 1"
    args += " --configs baseline,default,nan_check_hooks"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_overhead.py"), *args.split()]
    cmd += ["--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"baseline", "default", "nan_check_hooks"}
    assert report["results"]["default"]["steps"] == 2
    assert len(report["results"]["default"]["round_overheads"]) == 1
    assert report["results"]["baseline"]["round_overheads"] == [0.0]
    assert report["results"]["baseline"]["host_issue_overhead_ms"] == 0.0


def test_overhead_harness_interleaved(tmp_path):
    out = tmp_path / "overhead_interleaved.json"
    args = "--interleave --preset demo --device cpu --batch 2 --steps 3 --warmup 1"
    args += " --configs baseline,default,detect_anomaly,default_plain_launches"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_overhead.py"), *args.split()]
    subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True, timeout=600)
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == {"baseline", "default", "detect_anomaly", "default_plain_launches"}
    # the mean overhead splits by kind of step: the warm-up step 0 sampled, 1-3 did neither
    phases = results["default"]["by_phase"]
    assert {k: v["steps"] for k, v in phases.items()} == {"other": 3}
    shares = sum(v["share_of_mean_overhead_pct"] for v in phases.values())
    assert shares == pytest.approx(100 * results["default"]["mean_overhead"])
    lo, hi = results["default"]["paired_overhead_median_ci95"]
    assert lo <= results["default"]["paired_overhead_median"] <= hi
    graphs = report["graphs_vs_plain_launches"]["default"]
    assert graphs["median_ci95"][0] <= graphs["median"] <= graphs["median_ci95"][1]
    # the statistics can be recomputed from the per-step times alone (kept to the microsecond)
    subprocess.run([*cmd[:2], "--reanalyze", str(out)], check=True, timeout=600)
    again = json.loads(out.read_text())
    for name, r in results.items():
        got = again["results"][name]
        for key in ("paired_overhead_median", "mean_overhead"):
            assert got[key] == pytest.approx(r[key], rel=1e-3, abs=1e-4)
    assert again["graphs_vs_plain_launches"]["default"]["median"] == pytest.approx(
        graphs["median"], rel=1e-3, abs=1e-4
    )
    assert results["baseline"]["paired_overhead_median"] == 0.0
    assert results["default"]["steps"] == 3
    # issuing a step is part of it (step by step, so the medians keep the order)
    assert all(0 < r["issue_median_ms"] <= r["median_ms"] for r in results.values())
    assert 0 < report["baseline_issue_fraction"] <= 1


def test_step_profile_harness(tmp_path):
    out = tmp_path / "profile.json"
    args = f"--preset tiny --device cpu --steps 3 --out {out}"
    args += " --configs baseline,default,attention_every_step --cprofile attention_every_step"
    cmd = [sys.executable, str(ROOT / "bench" / "profile_step.py"), *args.split()]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"baseline", "default", "attention_every_step"}
    assert results["baseline"]["monitor_step_host_ms"] is None
    assert results["default"]["monitor_step_host_ms"] > 0
    assert results["default"]["table_builds"] == 0  # the CPU path builds no tables
    for r in results.values():  # each against a baseline block timed right before it
        assert r["baseline_step_ms"] > 0
        assert r["extra_ms"] == pytest.approx(r["step_ms"] - r["baseline_step_ms"])
    text = (tmp_path / "profile.profiles.txt").read_text()
    assert text.startswith("===== attention_every_step") and "monitor.step, cProfile" in text


def test_host_path_profile_harness(tmp_path):
    out = tmp_path / "host_path.json"
    cmd = [sys.executable, str(ROOT / "bench" / "profile_host_path.py"), "--preset", "tiny"]
    subprocess.run([*cmd, "--calls", "5", "--out", str(out)], check=True, timeout=600)
    report = json.loads(out.read_text())
    host = report["host_us"]
    parts = {"monitor_step_with_loss", "record_loss", "gradient_probe_on_step",
             "tensor_stats_same_addresses", "tensor_stats_moved"}  # fmt: skip
    assert report["gradients"] > 0 and set(host) >= parts
    # No order between the parts' times: at 5 calls they are within host noise of each other
    # (the probe's step measured 17.7 against a tensor_stats call's 20.1 us once on 2 CPU cores).
    assert all(us > 0 for us in host.values())


def test_flush_collectives_harness(tmp_path):
    """Its stand-in for Aggregator.aggregate fell behind the real signature: every flush failed
    and bench/run_all.sh cpu stopped there."""
    out = tmp_path / "fc.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_flush_collectives.py"), "--out", str(out)]
    subprocess.run([*cmd, "--steps", "4", "--reps", "2"], check=True, timeout=600)
    report = json.loads(out.read_text())
    assert report["notes"].startswith("2 processes")


def test_flash_ab_loads_a_revisions_kernel_next_to_this_one():
    """bench/ab_flash_gluon.py imports git's copy of the Gluon forward as a sibling module (its
    relative imports resolve to this tree) and leaves no file behind."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import ab_flash_gluon as ab
    finally:
        sys.path.pop(0)
    from numwatch.kernels import flash_attention_gluon as fag

    old = ab.load_revision("HEAD")
    assert old.__name__ == "numwatch.kernels._ab_flash_gluon_old" and old is not fag
    assert callable(old.gluon_forward) and old.AVAILABLE == fag.AVAILABLE
    assert not Path(fag.__file__).with_name("_ab_flash_gluon_old.py").exists()
    with pytest.raises(subprocess.CalledProcessError):
        ab.load_revision("no-such-revision")


@pytest.mark.parametrize("script", ["hf_trainer", "lightning_train"])
def test_framework_examples_train_with_the_monitor(tmp_path, script):
    pytest.importorskip("transformers" if script == "hf_trainer" else "lightning")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        module = __import__(script)
    finally:
        sys.path.pop(0)
    log = tmp_path / "run.jsonl"
    loss = module.main(["--steps", "10", "--batch", "4", "--jsonl", str(log)])
    assert loss == loss and loss > 0  # finite
    records = read_jsonl(log)
    assert records[0]["step"] == 9  # flush_every=10
    names = {m["name"] for m in records[0]["metrics"]}
    assert {"grad_norm", "attn_rows", "loss"} <= names


def test_divergence_definition_and_repro_harness(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import _repro as repro
    finally:
        sys.path.pop(0)
    flat = [3.0] * 60
    assert repro.divergence_step(flat, settle=20) is None
    assert repro.divergence_step([*flat, 7.0], settle=20) == 60  # > 2x the running median
    assert repro.divergence_step([*flat[:30], float("nan")], settle=20) == 30
    # regression: the 100-step mean falls to 3.0 at step 199, then 3.7s pull it past 3.3 (10 %
    # above) at the 43rd of them (3.301; 3.294 at the 42nd)
    descent = [4.0] * 100 + [3.0] * 100
    assert repro.regression_step(descent) is None
    assert repro.regression_step([*descent, *[3.7] * 60]) == 199 + 43
    assert repro.regression_step([*descent, float("inf")]) == 200
    assert repro.regression_step([*descent, *[3.2] * 300]) is None  # 6.7 % up: not a regression
    acted = [
        Event(kind=kind, step=step, message="", evidence={"action": action})
        for kind, step, action in [
            ("action", 40, "skip_step"), ("action", 30, "lr_backoff"), ("action", 20, "skip_step"),
            ("spike", 10, "skip_step"), ("action", 40, "skip_step"),
        ]
    ]  # fmt: skip
    assert repro.skipped_steps(acted) == [20, 40]
    common = "--device cpu --preset tiny --steps 12 --batch 2 --flush-every 4"
    scripts = {
        "repro_logit_growth.py": ("--lr 0.05 --mitigation spike", {"control", "unstable"}),
        "repro_paper_mechanism.py": ("", {"paper_repro", "stabilized"}),
    }
    for script, (extra, must) in scripts.items():
        out = tmp_path / f"{script}.json"
        cmd = [sys.executable, str(ROOT / "bench" / script), *common.split(), *extra.split()]
        subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True, timeout=600)
        runs = json.loads(out.read_text())["runs"]
        assert must | {"mitigated"} == set(runs)
        assert runs["mitigated"]["actions"] is True and runs[min(must)]["actions"] is False
        assert (tmp_path / f"{script}" / "mitigated.jsonl.gz").exists()


def test_gpt2_example_bursts_data_and_their_aftermath():
    """--data bursts: BURST_LEN repeated-n-gram batches every BURST_EVERY steps, ordinary
    bigram batches (those of --data bigram, in order) between them; the harness reads a burst's
    aftermath on the ordinary steps around it."""
    sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "bench")]
    try:
        import _repro as repro
        import gpt2
    finally:
        del sys.path[:2]
    cfg, every, n = gpt2.PRESETS["tiny"], gpt2.BURST_EVERY, gpt2.BURST_NGRAM
    assert [t for t in range(2 * every + 5) if gpt2.is_burst(t)] == [
        *range(every, every + gpt2.BURST_LEN),
        *range(2 * every, 2 * every + gpt2.BURST_LEN),
    ]
    bursts = gpt2.batches(cfg, 3, "bursts", 0, "cpu")
    bigram = gpt2.batches(cfg, 3, "bigram", 0, "cpu")
    for step in range(every + gpt2.BURST_LEN + 2):
        x, y = next(bursts)
        if gpt2.is_burst(step):
            assert (x[:, 0] == 0).all() and (x[:, 1 + n :] == x[:, 1:-n]).all()
            assert torch.equal(x[:, 1:], y[:, :-1])
        else:
            x_ref, y_ref = next(bigram)
            assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    losses = [2.0] * (every + 100)
    losses[every : every + gpt2.BURST_LEN] = [9.0] * gpt2.BURST_LEN
    losses[every + gpt2.BURST_LEN + 3] = 5.0  # the damage: 2.5x the median before the burst
    (effect,) = repro.burst_effects(losses)
    assert effect["step"] == every and effect["burst_losses"] == [9.0] * gpt2.BURST_LEN
    assert effect["max_after_step"] == every + gpt2.BURST_LEN + 3
    assert effect["spike_ratio"] == 2.5


def test_distributed_example_with_a_fault_and_uneven_inputs(tmp_path):
    """torchrun, 2 gloo ranks, DDP: rank 1's NaN at step 5 skips the update on both ranks (the
    decision on global values), then rank 0 runs out of data 6 steps early under Join, the
    monitors stop aggregating instead of hanging, and the replicas end identical."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(ROOT / "examples" / "distributed_train.py"), "--steps", "20"]
    cmd += ["--nan-step", "5", "--uneven", "6"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = run.stdout
    if run.returncode != 0:
        # gloo's C++ threads can outlive the destroyed group and race the interpreter's
        # teardown (SIGABRT after everything ran; see the workers of test_distributed.py): that
        # is torch's, not the example's, as long as the example got to its last line
        teardown = "terminate called without an active exception" in run.stderr
        assert teardown and "JSONL log (global values)" in out, run.stderr[-3000:]
    assert "skipped optimizer updates: 1" in out
    assert "NaN/Inf first seen in the loss (loss) at step 5 on rank 1" in out
    assert "steps on rank 0: 14; aggregation stopped at step 14" in out
    assert "DDP replicas bitwise identical: True" in out
    assert "monitor errors: {}" in out
