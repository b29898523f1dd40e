"""MonitorConfig: every source, precedence, and errors that name the field and the fix."""

import re

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


def test_config_object_edited_after_construction_is_honoured():
    """Nested assignments and in-place edits do not mark the section as set in its parent."""
    from pydantic import ValidationError

    from numwatch.rules import ThresholdRule

    cfg = MonitorConfig()
    cfg.gradients.every = 10
    cfg.sinks.console.enabled = False
    cfg.activations.exclude.append("head")
    cfg.rules.add = [ThresholdRule(name="big_loss", metric="loss", threshold=9.0)]
    loaded = MonitorConfig.load(cfg, env={"NUMWATCH_SINKS__JSONL__EVERY": "3"})
    assert loaded.gradients.every == 10
    assert loaded.sinks.console.enabled is False
    assert loaded.activations.exclude == ["head"]
    assert [(r.type, r.name, r.threshold) for r in loaded.rules.add] == [
        ("threshold", "big_loss", 9.0)
    ]
    assert loaded.sinks.jsonl.every == 3  # env still beats the object
    assert MonitorConfig.load(cfg, env={}, gradients__every=4).gradients.every == 4
    with pytest.raises(ValidationError):
        cfg.gradients.every = 0


def test_section_objects_merge_field_by_field():
    """A section object counts for the fields it was given, like the equivalent dict."""
    from numwatch.config import GradientConfig

    cfg = MonitorConfig.load(
        {"gradients": GradientConfig(every=7)}, env={"NUMWATCH_GRADIENTS__EXCLUDE": "[bias]"}
    )
    assert (cfg.gradients.every, cfg.gradients.exclude) == (7, ["bias"])
    env = {"NUMWATCH_GRADIENTS__EVERY": "5", "NUMWATCH_GRADIENTS__PARAMS": "[h.*]"}
    cfg = MonitorConfig.load(
        None, env=env, gradients=GradientConfig(every=1), gradients__exclude=["bias"]
    )
    assert cfg.gradients.every == 1  # given explicitly, so it beats env even at its default
    assert (cfg.gradients.params, cfg.gradients.exclude) == (["h.*"], ["bias"])


def test_the_kernels_own_variables_are_no_monitor_settings(monkeypatch):
    """README tells users to set NUMWATCH_FLASH_GLUON=0; every Monitor() then failed with
    'flash_gluon: unknown setting'."""
    env = {"NUMWATCH_FLASH_GLUON": "0", "NUMWATCH_FLASH_CONFIGS": "/tmp/c.json"}
    assert MonitorConfig.load(env=env) == MonitorConfig()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    import torch

    import numwatch

    numwatch.Monitor(torch.nn.Linear(2, 2))


def test_env_text_fields_are_taken_verbatim():
    env = {
        "NUMWATCH_RUN_NAME": "0042",
        "NUMWATCH_SINKS__PROMETHEUS__HOST": "::",
        "NUMWATCH_SINKS__JSONL__PATH": "/data/run #3.jsonl",
        "NUMWATCH_UNDERFLOW_DTYPE": "null",
        "NUMWATCH_SINKS__JSONL__ENABLED": "no",
    }
    cfg = MonitorConfig.load({"underflow_dtype": "float16"}, env=env)
    assert cfg.run_name == "0042"
    assert cfg.sinks.prometheus.host == "::"
    assert cfg.sinks.jsonl.path == "/data/run #3.jsonl"
    assert cfg.underflow_dtype is None  # not a str field: still YAML
    assert cfg.sinks.jsonl.enabled is False
    assert MonitorConfig.load(env={"NUMWATCH_RUN_NAME": "123456"}).run_name == "123456"


def test_unreadable_yaml_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("flush_every: 5\nattention:\n  every: [1\n")
    with pytest.raises(NumwatchConfigError) as err:
        MonitorConfig.load(bad, env={})
    assert str(err.value) == (
        f"config file {str(bad)!r} is not valid YAML: while parsing a flow sequence (line 3, "
        "column 10); expected ',' or ']', but got '<stream end>' (line 4, column 1)"
    )
    bad.write_text("flush_every: !!python/object:os.system x\n")
    with pytest.raises(NumwatchConfigError, match=r"bad\.yaml' is not valid YAML: .*\(line 1, "):
        MonitorConfig.from_yaml(bad)
    bad.write_bytes(b"flush_every: \xff\n")
    with pytest.raises(NumwatchConfigError, match=r"bad\.yaml' is not UTF-8 text: .* position 13"):
        MonitorConfig.load(bad, env={})


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"sinks.jsonl.path": "x.jsonl"}, "is not a setting name: nest dicts, or join names"),
        ({1: 2}, "config keys are setting names (text), got 1"),
    ],
)
def test_keys_that_are_not_setting_names_say_what_to_write(source, message):
    with pytest.raises(NumwatchConfigError, match=re.escape(message)):
        MonitorConfig.load(source)


@pytest.mark.parametrize("text", ["false\n", "[]\n", "0\n"])
def test_a_yaml_file_of_a_falsy_value_is_refused_not_read_as_empty(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(NumwatchConfigError, match="must hold a mapping at top level"):
        MonitorConfig.load(path)
    path.write_text("# nothing set yet\n")
    assert MonitorConfig.load(path).flush_every == 50
    with pytest.raises(NumwatchConfigError, match="is not a file"):
        MonitorConfig.load(tmp_path)


def test_an_env_list_of_unquoted_globs_says_to_quote_them():
    with pytest.raises(NumwatchConfigError, match="quote items that start with"):
        MonitorConfig.load(env={"NUMWATCH_WEIGHTS__EXCLUDE": "[*embed*, *wte*]"})
    cfg = MonitorConfig.load(env={"NUMWATCH_WEIGHTS__EXCLUDE": "['*embed*', '*wte*']"})
    assert cfg.weights.exclude == ["*embed*", "*wte*"]


def test_a_bad_value_names_where_it_came_from(tmp_path):
    """A bad NUMWATCH_* value or YAML value was reported as if the code had set it: the
    variable (or the file) was never named. An empty variable reads as unset."""
    env = {"NUMWATCH_GRADIENTS__EXCLUDE": "*embed*", "NUMWATCH_FLUSH_EVERY": ""}
    with pytest.raises(NumwatchConfigError) as err:
        MonitorConfig.load(env=env)
    assert str(err.value).endswith(
        "gradients.exclude: got '*embed*'; Input should be a valid list (a list in YAML: "
        "['*embed*']) (from NUMWATCH_GRADIENTS__EXCLUDE)"
    )
    assert MonitorConfig.load(env={"NUMWATCH_FLUSH_EVERY": ""}).flush_every == 50
    path = tmp_path / "bad.yaml"
    path.write_text("flush_every: x\nsinks: {jsonl: {evry: 2}}\n")
    with pytest.raises(NumwatchConfigError) as err:
        MonitorConfig.load(path, env={})
    text, where = str(err.value), f"(from config file {str(path)!r})"
    assert f"flush_every: got 'x'; Input should be a valid integer, unable to parse string as " \
        f"an integer {where}" in text  # fmt: skip
    assert f"sinks.jsonl.evry: unknown setting (check the spelling; env names use '__') " \
        f"{where}" in text  # fmt: skip
    with pytest.raises(NumwatchConfigError) as err:  # a keyword override wins: the code's
        MonitorConfig.load(path, env={}, flush_every="y", sinks__jsonl__evry=None)
    assert "integer (from" not in str(err.value)


def test_env_numbers_are_decimal():
    """YAML 1.1 read zero-padded numbers as octal and time-like ones as base 60: a job script's
    NUMWATCH_FIRST_STEP=000500 started at step 320, NUMWATCH_FLUSH_EVERY=1:30 flushed every 90."""
    env = {"NUMWATCH_FIRST_STEP": "000500", "NUMWATCH_FLUSH_EVERY": "010",
           "NUMWATCH_SINKS__PROMETHEUS__PORT": "07070", "NUMWATCH_GRADIENTS__EVERY": "+08",
           "NUMWATCH_DISTRIBUTED__ATTACH_TIMEOUT": "0.5"}  # fmt: skip
    cfg = MonitorConfig.load(env=env)
    assert (cfg.first_step, cfg.flush_every, cfg.sinks.prometheus.port) == (500, 10, 7070)
    assert (cfg.gradients.every, cfg.distributed.attach_timeout) == (8, 0.5)
    with pytest.raises(NumwatchConfigError) as err:
        MonitorConfig.load(
            env={"NUMWATCH_FLUSH_EVERY": "1:30", "NUMWATCH_DISTRIBUTED__ATTACH_TIMEOUT": "5:00"}
        )
    assert "flush_every: got '1:30'" in str(err.value)
    assert "attach_timeout: got '5:00'" in str(err.value)


def test_a_section_given_whole_in_one_variable_is_named_by_it():
    """The source was rebuilt from the leaf's path: a variable that does not exist was named."""
    with pytest.raises(NumwatchConfigError, match=r"\(from NUMWATCH_SINKS\)$"):
        MonitorConfig.load(env={"NUMWATCH_SINKS": "{jsonl: {every: 0}}"})
    with pytest.raises(NumwatchConfigError) as err:  # a keyword override of it: the code's
        MonitorConfig.load(env={"NUMWATCH_SINKS": "{jsonl: {every: 0}}"}, sinks__jsonl__every=-1)
    assert "(from" not in str(err.value)


def test_a_sections_own_validator_names_the_source_too(tmp_path):
    """weights.alternate (refused by the section's validator) lost its source: the error's
    place is the section, the source's the setting under it."""
    path = tmp_path / "alt.yaml"
    path.write_text("weights:\n  alternate: true\n")
    with pytest.raises(NumwatchConfigError, match=r"from config file .*alt\.yaml"):
        MonitorConfig.load(path, env={})
    with pytest.raises(NumwatchConfigError, match=r"from NUMWATCH_WEIGHTS__ALTERNATE"):
        MonitorConfig.load(env={"NUMWATCH_WEIGHTS__ALTERNATE": "true"})
    # a neighbour set by a variable: it was named alone, as the higher-precedence source
    with pytest.raises(NumwatchConfigError) as err:
        MonitorConfig.load(path, env={"NUMWATCH_WEIGHTS__EVERY": "7"})
    assert str(err.value).endswith(f"(from config file {str(path)!r}, NUMWATCH_WEIGHTS__EVERY)")
    with pytest.raises(NumwatchConfigError) as err:  # the same neighbour from code: not named
        MonitorConfig.load(path, env={}, weights__every=7)
    assert str(err.value).endswith(f"(from config file {str(path)!r})")


def test_an_action_type_that_is_not_a_name_is_a_config_error(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(
        "rules:\n  add:\n    - {type: threshold, name: clip, metric: attn_max_logit,"
        " threshold: 100, actions: [{type: {qk_clip: {tau: 100}}}]}\n"
    )
    with pytest.raises(NumwatchConfigError, match="unknown action"):  # was a raw TypeError
        MonitorConfig.load(path, env={})


def test_rule_names_are_checked_with_the_config_and_name_their_source(tmp_path):
    """A disable naming no default rule and two added rules of one name passed load/from_yaml
    (what a CI check runs); Monitor refused them later, naming neither file nor variable."""
    path = tmp_path / "dup.yaml"
    path.write_text("rules:\n  add:\n    - {type: threshold, name: x, metric: loss, threshold: 5}\n"
                    "    - {type: zscore, name: x, metric: loss, sigma: 6}\n")  # fmt: skip
    with pytest.raises(NumwatchConfigError) as err:
        MonitorConfig.from_yaml(path)
    assert str(err.value) == (
        "invalid numwatch config: rules.add: duplicate rule names ['x']; names are ids "
        f"(from config file {str(path)!r})"
    )
    with pytest.raises(NumwatchConfigError) as err:
        MonitorConfig.load(env={"NUMWATCH_RULES__DISABLE": "[attn_saturate]"})
    assert str(err.value).startswith(
        "invalid numwatch config: rules.disable: no default rule named 'attn_saturate'; the "
        "defaults are ['activation_overflow_risk', "
    )
    assert str(err.value).endswith("(from NUMWATCH_RULES__DISABLE)")
    with pytest.raises(NumwatchConfigError, match=r"'loss_spike'; rules\.defaults is false"):
        MonitorConfig.load(rules={"defaults": False, "disable": ["loss_spike"]}, env={})
    added = {"type": "zscore", "name": "loss_spike", "metric": "loss", "sigma": 3}
    cfg = MonitorConfig.load(rules={"disable": ["loss_spike"], "add": [added]}, env={})
    assert cfg.rules.disable == ["loss_spike"]  # disabled and added again: valid


def test_from_yaml_reads_joined_names_as_load_does(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rules__disable: [attn_saturated]\n")
    assert MonitorConfig.from_yaml(path).rules.disable == ["attn_saturated"]
    assert MonitorConfig.load(path, env={}).rules.disable == ["attn_saturated"]


def test_paths_expand_home_and_variables(tmp_path, monkeypatch):
    """Written in YAML, '~/runs/x.jsonl' made a folder named '~' in the working directory."""
    from numwatch.actions.library import ForensicSnapshot

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RUNDIR", str(tmp_path / "runs"))
    cfg = MonitorConfig.load({"sinks": {"jsonl": {"path": "~/logs/{run_name}.jsonl"}}}, env={})
    assert cfg.sinks.jsonl.path == f"{tmp_path}/logs/{{run_name}}.jsonl"
    cfg = MonitorConfig.load(env={"NUMWATCH_SINKS__JSONL__PATH": "$RUNDIR/{run_name}.jsonl"})
    assert cfg.sinks.jsonl.path == f"{tmp_path}/runs/{{run_name}}.jsonl"
    assert ForensicSnapshot(directory="~/snap").directory == f"{tmp_path}/snap"
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "nw.yaml").write_text("flush_every: 7\n")  # the config file's own path
    assert MonitorConfig.load("$RUNDIR/nw.yaml", env={}).flush_every == 7
    assert MonitorConfig.from_yaml("${RUNDIR}/nw.yaml").flush_every == 7


@pytest.mark.parametrize(
    ("path", "problem"),
    [("x{foo}.jsonl", "unknown field(s) 'foo'"), ("x{rank[0]}.jsonl", "unknown field(s) 'rank[0]'"),
     ("x{rank.real.bad}", "unknown field(s) 'rank.real.bad'"),
     ("x{run_name.upper}", "unknown field(s) 'run_name.upper'"), ("x{rank:s}", "ValueError"),
     ("x{.jsonl", "ValueError")],
)  # fmt: skip
def test_a_jsonl_path_field_other_than_run_name_and_rank_is_a_config_error(path, problem):
    """'{rank[0]}' and '{rank.real.bad}' escaped as a raw TypeError/AttributeError at attach,
    '{run_name.upper}' named the log after a method's repr."""
    with pytest.raises(NumwatchConfigError) as err:
        MonitorConfig.load(sinks__jsonl__path=path, env={})
    assert f"sinks.jsonl.path: {path!r}: {problem}" in str(err.value)
    assert "the path may use {run_name} and {rank}" in str(err.value)
    cfg = MonitorConfig.load(sinks__jsonl__path="r{rank:03d}-{{x}}-{run_name}.jsonl", env={})
    assert cfg.sinks.jsonl.path.format(run_name="a", rank=7) == "r007-{x}-a.jsonl"


@pytest.mark.parametrize(
    ("yaml_text", "error"),
    [("flush_every: true\n", "flush_every: a number is expected, got the boolean True"),
     ("sinks: {prometheus: {port: false}}\n", "port: a number is expected"),
     ("flush_every: yes\n", "flush_every: got 'yes'; Input should be a valid integer"),
     ("attention: {batch: off}\n", "attention.batch: got 'off'; Input should be a valid integer")],
)  # fmt: skip
def test_a_boolean_is_not_taken_for_a_number(tmp_path, yaml_text, error):
    """pydantic took booleans as 1/0 (a flush every step, a random port, every batch element
    for 'off'); yes/no/on/off are text (YAML 1.2), which a count refuses too."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(NumwatchConfigError, match=error):
        MonitorConfig.load(path, env={})


def test_yaml_scalars_are_read_as_yaml_1_2(tmp_path):
    """PyYAML reads YAML 1.1: 1e-3 and 5e-1 (no dot) were text (an action's factor stayed '5e-1'
    in the config), yes/no/on/off booleans (a run named 'no', a glob 'on' or a label value
    were refused as "got False"), 010 octal (8) and a date a date. Now 1e-3 is a number,
    those words are the text written (a bool field still reads them), numbers are decimal."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "run_name: no\nfirst_step: 010\nstrict: yes\n"
        "gradients: {params: [on, yes], enabled: off}\n"
        "attention: {layers: [off]}\n"
        "distributed: {attach_timeout: 1e2}\n"
        "sinks: {console: {enabled: false}}\n"
        "rules: {add: [{name: r, type: threshold, metric: grad_rms, threshold: 1e-3,\n"
        "               labels: {param: on}, actions: [{type: lr_backoff, factor: 5e-1}]}]}\n"
    )
    cfg = MonitorConfig.from_yaml(path)
    assert (cfg.run_name, cfg.first_step, cfg.strict) == ("no", 10, True)
    assert (cfg.gradients.params, cfg.gradients.enabled) == (["on", "yes"], False)
    assert cfg.attention.layers == ["off"]
    assert cfg.distributed.attach_timeout == 100.0 and not cfg.sinks.console.enabled
    [rule] = cfg.rules.add
    assert (rule.threshold, rule.labels) == (1e-3, {"param": "on"})
    assert rule.actions == [{"type": "lr_backoff", "factor": 0.5}]
    path.write_text("run_name: 2026-01-01\n")
    assert MonitorConfig.from_yaml(path).run_name == "2026-01-01"
    path.write_text("flush_every: 0x10\nfirst_step: 0o10\n")  # YAML 1.2's other integers
    cfg = MonitorConfig.from_yaml(path)
    assert (cfg.flush_every, cfg.first_step) == (16, 8)
    env = {"NUMWATCH_GRADIENTS__PARAMS": "[on, no]", "NUMWATCH_SINKS__PROMETHEUS__EXCLUDE": "[off]"}
    cfg = MonitorConfig.load(env=env)
    assert (cfg.gradients.params, cfg.sinks.prometheus.exclude) == (["on", "no"], ["off"])


def test_a_boolean_count_names_only_its_own_source(tmp_path):
    """The check ran on the whole section: its error was placed at '<root>' and named every
    source that set something (the good file along with the bad variable)."""
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("run_name: exp1\nsinks: {prometheus: {host: x}}\n")
    bad.write_text("flush_every: true\n")
    with pytest.raises(NumwatchConfigError) as err:
        MonitorConfig.load(good, env={"NUMWATCH_FLUSH_EVERY": "true"})
    assert str(err.value) == (
        "invalid numwatch config: flush_every: a number is expected, got the boolean True "
        "(from NUMWATCH_FLUSH_EVERY)"
    )
    with pytest.raises(NumwatchConfigError) as err:
        MonitorConfig.load(bad, env={"NUMWATCH_RUN_NAME": "exp1", "NUMWATCH_STRICT": "true"})
    assert str(err.value).endswith(f"flush_every: a number is expected, got the boolean True "
                                   f"(from config file {str(bad)!r})")  # fmt: skip
    with pytest.raises(NumwatchConfigError) as err:
        MonitorConfig.load(good, env={"NUMWATCH_SINKS__PROMETHEUS__PORT": "false"})
    assert str(err.value).endswith(
        "sinks.prometheus.port: a number is expected, got the boolean False "
        "(from NUMWATCH_SINKS__PROMETHEUS__PORT)"
    )


@pytest.mark.parametrize(
    ("setting", "field", "value"),
    [("for_flushes: true", "for_flushes", True), ("cooldown: true", "cooldown", True),
     ("window: true", "window", True),
     ("actions: [{type: lr_backoff, min_interval_steps: true}]", "min_interval_steps", True),
     ("actions: [{type: lr_backoff, steps: true}]", "steps", True),
     ("actions: [{type: snapshot, max_bytes: false}]", "max_bytes", False)],
)  # fmt: skip
def test_a_rule_or_action_count_refuses_a_boolean(tmp_path, setting, field, value):
    """Rules and actions missed the sections' check: 'for_flushes: true' was 1 and a
    snapshot's 'max_bytes: false' saved no tensor."""
    path = tmp_path / "c.yaml"
    path.write_text(
        f"rules: {{add: [{{name: r, type: threshold, metric: loss, threshold: 1, {setting}}}]}}\n"
    )
    with pytest.raises(
        NumwatchConfigError, match=f"{field}: a number is expected, got the boolean {value}"
    ):
        MonitorConfig.load(path, env={})
