"""MonitorConfig: every source, precedence, and errors that name the field and the fix."""

import pytest

from numwatch import MonitorConfig, NumwatchConfigError


def test_defaults_are_valid():
    cfg = MonitorConfig.load(env={})
    assert cfg.flush_every == 50
    assert cfg.kernel_backend == "auto"
    assert cfg.gradients.params == ["*"]
    assert cfg.sinks.jsonl.enabled


def test_dict_yaml_env_and_overrides_with_precedence(tmp_path):
    path = tmp_path / "nw.yaml"
    path.write_text("flush_every: 3\nstrict: true\nactivations:\n  every: 7\n  modules: ['a.*']\n")
    env = {"NUMWATCH_FLUSH_EVERY": "4", "NUMWATCH_ACTIVATIONS__EXCLUDE": "[a.b]"}
    cfg = MonitorConfig.load(str(path), env=env, activations__every=9)
    assert cfg.flush_every == 4  # env beats the file
    assert cfg.strict is True  # file beats defaults
    assert cfg.activations.every == 9  # keyword beats everything
    assert cfg.activations.modules == ["a.*"]  # nested file value kept beside env/keyword ones
    assert cfg.activations.exclude == ["a.b"]  # env parsed as YAML

    from_dict = MonitorConfig.load({"gradients": {"every": 2}}, env={})
    assert from_dict.gradients.every == 2
    from_obj = MonitorConfig.load(MonitorConfig(flush_every=5), env={}, strict=True)
    assert (from_obj.flush_every, from_obj.strict) == (5, True)


def test_nested_keyword_dict_merges():
    cfg = MonitorConfig.load(env={}, sinks={"jsonl": {"path": "x.jsonl"}})
    assert cfg.sinks.jsonl.path == "x.jsonl"
    assert cfg.sinks.console.enabled


def test_invalid_literal_names_field_and_allowed_values():
    with pytest.raises(NumwatchConfigError) as err:
        MonitorConfig.load(env={}, kernel_backend="cuda")
    msg = str(err.value)
    assert "kernel_backend" in msg and "'cuda'" in msg
    assert "'auto', 'torch' or 'triton'" in msg


def test_invalid_number_and_unknown_field():
    with pytest.raises(NumwatchConfigError, match=r"flush_every: got 0"):
        MonitorConfig.load(env={}, flush_every=0)
    with pytest.raises(NumwatchConfigError, match=r"flush_evry: unknown setting"):
        MonitorConfig.load(env={}, flush_evry=3)
    with pytest.raises(NumwatchConfigError, match=r"sinks.jsonl.pth: unknown setting"):
        MonitorConfig.load(env={"NUMWATCH_SINKS__JSONL__PTH": "x"})


def test_bad_sources():
    with pytest.raises(NumwatchConfigError, match="does not exist"):
        MonitorConfig.load("/nonexistent/nw.yaml", env={})
    with pytest.raises(NumwatchConfigError, match="MonitorConfig, a dict or a path"):
        MonitorConfig.load(42, env={})


def test_cuda_graphs_switch_from_env_reaches_the_kernels(monkeypatch):
    """NUMWATCH_CUDA_GRAPHS=false turns the graph replays off process-wide when attached."""
    import torch

    import numwatch
    from numwatch.kernels import launch

    monkeypatch.setattr(launch, "CUDA_GRAPHS", True)
    monkeypatch.setenv("NUMWATCH_CUDA_GRAPHS", "false")
    monitor = numwatch.Monitor(torch.nn.Linear(2, 2), sinks__jsonl__enabled=False)
    assert monitor.config.cuda_graphs is False
    assert launch.CUDA_GRAPHS is True  # nothing changes before attach
    monitor.attach()
    assert launch.CUDA_GRAPHS is False
    monitor.detach()
