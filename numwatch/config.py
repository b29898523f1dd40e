"""Monitor configuration: validated pydantic models, loadable from code, a dict, YAML or env.

Precedence, lowest first: built-in defaults < ``config`` (a ``MonitorConfig``, a dict or a YAML
file) < ``NUMWATCH_*`` environment variables < keyword overrides. Nested fields are reached with a
double underscore in both env names and keywords: ``NUMWATCH_SINKS__JSONL__PATH=run.jsonl`` or
``Monitor(model, sinks__jsonl__path="run.jsonl")``. An env value for a text field is taken as is
(``NUMWATCH_RUN_NAME=0042``); others are parsed as YAML, so ``NUMWATCH_FLUSH_EVERY=5`` is an int
and ``NUMWATCH_GRADIENTS__PARAMS="[h.*]"`` a list. Files and values are read as YAML 1.2
(``_ConfigLoader``): ``1e-3`` is a float, ``010`` is 10, yes/no/on/off are text. Section
objects (``GradientConfig(every=7)``) count for the fields they were given, like the equivalent
dict.
"""

from __future__ import annotations

import os
import re
import string
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from numwatch.counts import NoBoolCounts
from numwatch.errors import NumwatchConfigError
from numwatch.rules import Rule, RuleConfig, default_rules
from numwatch.rules.engine import check_step_rule

__all__ = [
    "ActivationConfig",
    "AttentionConfig",
    "ConsoleSinkConfig",
    "DistributedConfig",
    "GradientConfig",
    "JsonlSinkConfig",
    "MonitorConfig",
    "OptimizerProbeConfig",
    "PrometheusSinkConfig",
    "RulesConfig",
    "SinksConfig",
    "WeightsConfig",
]

ENV_PREFIX = "NUMWATCH_"
# Variables of the kernels (numwatch.kernels reads them at import), not monitor settings.
KERNEL_ENV = frozenset({"NUMWATCH_FLASH_GLUON", "NUMWATCH_FLASH_CONFIGS"})


class _Section(NoBoolCounts):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class GradientConfig(_Section):
    """Statistics of each selected parameter's gradient, taken at step time."""

    enabled: bool = Field(True, description="Collect gradient statistics.")
    every: PositiveInt = Field(1, description="Steps between gradient statistics (1 = every step).")
    params: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Glob patterns over model.named_parameters() names to include.",
    )
    exclude: list[str] = Field(
        default_factory=list, description="Glob patterns of parameter names to leave out."
    )


class ActivationConfig(_Section):
    """Statistics of selected modules' forward outputs (all floating tensors in the output)."""

    enabled: bool = Field(True, description="Collect forward-output statistics.")
    every: PositiveInt = Field(
        50, description="Steps between sampled forwards; steps where step % every == 0 are sampled."
    )
    modules: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Glob patterns over model.named_modules() names (the root model is excluded).",
    )
    module_types: list[str] = Field(
        default_factory=list,
        description="Only modules of these class names (e.g. 'Linear' or 'torch.nn.Linear'); "
        "empty = any type.",
    )
    exclude: list[str] = Field(
        default_factory=list, description="Glob patterns of module names to leave out."
    )
    training_only: bool = Field(
        True,
        description="Skip forwards of modules in eval mode, and forwards of the model under "
        "no_grad or inference_mode (validation passes).",
    )
    max_pending_bytes: PositiveInt = Field(
        256 * 2**20,
        description="Outputs held for the fused per-forward measurement before it runs early; "
        "bounds the memory they keep alive (activation checkpointing frees them otherwise).",
    )


class AttentionConfig(_Section):
    """Per-head statistics of attention calls (SDPA and eager softmax attention)."""

    enabled: bool = Field(True, description="Intercept attention calls on sampled steps.")
    every: PositiveInt = Field(
        50, description="Steps between sampled forwards; steps where step % every == 0 are sampled."
    )
    layers: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Glob patterns over the module path that makes the attention call.",
    )
    exclude: list[str] = Field(default_factory=list, description="Layer globs to leave out.")
    batch: int = Field(
        1, ge=0, description="Batch elements sampled per call (the first ones); 0 = all."
    )
    rows: int = Field(
        0, ge=0, description="Query rows sampled per call (uniformly at random); 0 = all."
    )
    entropy: bool = Field(True, description="Also compute the softmax-row entropy.")
    training_only: bool = Field(
        True,
        description="Skip forwards of the model in eval mode or under no_grad / "
        "inference_mode (validation passes).",
    )
    output_error: bool = Field(
        True,
        description="Recompute the attention output in fp32 (float64 on CPU) on sampled SDPA "
        "calls and measure the signed error of the real kernel's output (not on calls with "
        "dropout_p > 0: the error would be the dropout's).",
    )
    saturation_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Dtype the kernel rounds P to, which sets the saturation threshold; 'auto' "
        "= the attention input dtype (the autocast dtype under autocast).",
    )
    sdpa: bool = Field(
        True,
        description="Measure calls of F.scaled_dot_product_attention (False: they are still "
        "intercepted, so that swap_attention can route them, but not measured).",
    )
    eager_softmax: bool = Field(
        True,
        description="Intercept softmax over materialized scores: 4-D inputs over the last dim, "
        "and 3-D inputs inside nn.MultiheadAttention.",
    )


class WeightsConfig(_Section):
    """Spectral norms by warm-started power iteration (weights and attention heads' W_Q, W_K)."""

    enabled: bool = Field(True, description="Estimate spectral norms.")
    every: PositiveInt = Field(50, description="Steps between power-iteration updates.")
    iters: PositiveInt = Field(
        1,
        description="Power iterations per update (warm-started: 1 tracks trained weights); each "
        "reads every selected weight once.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_alternate(cls, data: Any) -> Any:
        if isinstance(data, dict) and "alternate" in data:
            raise ValueError(
                "weights.alternate was removed: every update now reads each weight once and runs "
                "a whole iteration (alternate ran half of one); drop the setting"
            )
        return data

    params: list[str] = Field(
        default_factory=lambda: ["*"], description="Globs of 2-D parameters to include."
    )
    exclude: list[str] = Field(default_factory=list, description="Globs of parameters left out.")
    embeddings: bool = Field(
        False,
        description="Include the tables of nn.Embedding / nn.EmbeddingBag modules (left out by "
        "default, by module type: a lookup table's norm is not a precursor, and it is the "
        "largest matrix).",
    )
    attention_heads: bool = Field(
        True, description="Per-head norms of W_Q and W_K of recognised attention modules."
    )
    layers: list[str] = Field(
        default_factory=lambda: ["*"], description="Globs of attention modules for per-head norms."
    )


class OptimizerProbeConfig(_Section):
    """Update-to-weight ratios, absorbed updates and loss scale (needs attach(optimizer))."""

    enabled: bool = Field(True, description="Measure optimizer updates.")
    every: PositiveInt = Field(
        50,
        description="Optimizer steps between measured updates.",
    )
    max_bytes: PositiveInt = Field(
        256 * 2**20,
        description="Parameter bytes copied per measured update (the copy lives during that "
        "optimizer step); larger models are covered in rotation over several measurements.",
    )


class RulesConfig(_Section):
    """Which rules run at each flush (README, 'Rules and actions')."""

    defaults: bool = Field(True, description="Start from the default precursor rule set.")
    act: bool = Field(
        True, description="Run the rules' actions; False = events only (a dry run of mitigation)."
    )
    disable: list[str] = Field(default_factory=list, description="Names of rules to turn off.")
    add: list[RuleConfig] = Field(
        default_factory=list,
        description="Rules to add; one named like a default rule replaces it.",
    )

    @field_validator("disable")
    @classmethod
    def _disable_names_defaults(cls, names: list[str], info: ValidationInfo) -> list[str]:
        """A misspelled name would leave the rule on; only ``Monitor`` refused it, without
        naming the file or variable it came from."""
        known = {rule.name for rule in default_rules()} if info.data.get("defaults") else set()
        if unknown := [name for name in names if name not in known]:
            have = f"the defaults are {sorted(known)}" if known else "rules.defaults is false"
            raise ValueError(f"no default rule named {', '.join(map(repr, unknown))}; {have}")
        return names

    @field_validator("add")
    @classmethod
    def _add_names_are_unique(cls, rules: list[Rule]) -> list[Rule]:
        """Names are ids (events' ``rule``, ``disable``): two with one name are an error, not
        a silent choice of the last."""
        names = [rule.name for rule in rules]
        if dupes := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"duplicate rule names {dupes}; names are ids")
        return rules

    @model_validator(mode="after")
    def _actions_are_valid(self) -> RulesConfig:
        """The actions' settings, and what a rule deciding every step (skip_step) needs, are
        checked with the rest (``numwatch replay --config`` and ``MonitorConfig.load`` accepted
        what ``Monitor`` then refused)."""
        from numwatch.actions.library import build_action  # the actions import this

        for rule in self.add:
            for action in rule.actions:
                build_action(action, f"rules[{rule.name}].actions")
            if rule.skips_steps:
                check_step_rule(rule)
        return self


class JsonlSinkConfig(_Section):
    """The JSONL run log: one JSON object per flush (schema in README, 'JSONL schema')."""

    enabled: bool = Field(True, description="Write the JSONL run log.")
    path: str = Field(
        "numwatch-runs/{run_name}.rank{rank}.jsonl",
        description="File path; {run_name} and {rank} are filled in, ~ and $VARIABLES expanded. "
        "Parent folders are created.",
    )

    @field_validator("path")
    @classmethod
    def _expand(cls, path: str) -> str:
        """Refused here, not at attach: a field that indexes or reads an attribute
        ('{rank[0]}', '{run_name.upper}') raised a raw TypeError or named the file after a repr."""
        path = expand_path(path)
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(path) if f is not None}
            unknown = ", ".join(map(repr, sorted(fields - {"run_name", "rank"})))
            problem = unknown and f"unknown field(s) {unknown}"
            if not problem:
                path.format(run_name="run", rank=0)  # a spec that does not fit: {rank:s}
        except (KeyError, IndexError, ValueError) as e:
            problem = f"{type(e).__name__} {e}"
        if problem:
            raise ValueError(
                f"{path!r}: {problem}; the path may use {{run_name}} and {{rank}} "
                "(write {{ and }} for literal braces)"
            )
        return path

    every: PositiveInt = Field(
        1,
        description="Flushes between written records; a flush with events is always written "
        "(a long run's log shrinks by this factor).",
    )
    exclude: list[str] = Field(
        default_factory=list,
        description="Globs of metric names left out of the log (e.g. 'grad_min', 'activation_*'); "
        "events are always written.",
    )


class ConsoleSinkConfig(_Section):
    """A one-line summary per flush on stderr (Rich on a terminal, plain lines otherwise)."""

    enabled: bool = Field(True, description="Print flush summaries (rank 0 only).")
    every: PositiveInt = Field(1, description="Flushes between printed summaries.")


# --- sinks.prometheus (exporter; numwatch/sinks/prometheus.py) ---------------------------------
# Per-parameter/per-module statistics left out of the exposition by default (cardinality): the
# rest (absmax, rms, nonfinite, zero/underflow fractions, headroom) is what the dashboard shows.
_PROMETHEUS_EXCLUDE = [
    f"{prefix}_{stat}"
    for prefix in ("grad", "activation")
    for stat in ("numel", "min", "max", "mean", "nan", "posinf", "neginf", "zeros", "subnormal")
]


class PrometheusSinkConfig(_Section):
    """Prometheus exporter: serves the latest flush on http://host:port/metrics (README,
    'Prometheus'). Off by default: a library should not open a port unasked."""

    enabled: bool = Field(False, description="Serve metrics over HTTP while attached.")
    host: str = Field(
        "127.0.0.1",
        description="Address to bind; '0.0.0.0' (or '::') exposes the metrics to the network.",
    )
    port: int = Field(
        9710,
        ge=0,
        le=65535,
        description="Port to bind; 0 = an ephemeral port (see Monitor.prometheus_url). With "
        "ranks='each', rank LOCAL_RANK binds port + LOCAL_RANK (the global rank where "
        "LOCAL_RANK is not set, as under torch.multiprocessing.spawn).",
    )
    ranks: Literal["each", "rank0"] = Field(
        "each",
        description="'each': every process serves (label rank) what its monitor holds: the "
        "cross-rank aggregate, the same on every rank, when distributed.aggregate is on (query "
        "one rank; a sum over ranks counts it once per rank), else its own values; 'rank0': "
        "only global rank 0 serves.",
    )
    heads: Literal["layer", "top_k", "all"] = Field(
        "layer",
        description="Per-head attention series: 'layer' = one series per layer, the worst "
        "head's value (plus numwatch_worst_head); 'top_k' = the top_k worst heads of each "
        "layer; 'all' = every head (48 layers x 64 heads = 3072 series per metric).",
    )
    top_k: PositiveInt = Field(4, description="Heads per layer kept with heads='top_k'.")
    include: list[str] = Field(
        default_factory=lambda: ["*"], description="Globs of metric names (no prefix) to export."
    )
    exclude: list[str] = Field(
        default_factory=lambda: list(_PROMETHEUS_EXCLUDE),
        description="Globs of metric names left out; [] exports everything.",
    )


# --- end sinks.prometheus ---------------------------------------------------------------------


class SinksConfig(_Section):
    jsonl: JsonlSinkConfig = Field(default_factory=JsonlSinkConfig)
    console: ConsoleSinkConfig = Field(default_factory=ConsoleSinkConfig)
    prometheus: PrometheusSinkConfig = Field(default_factory=PrometheusSinkConfig)


# --- distributed (numwatch/distributed.py) -----------------------------------------------------
class DistributedConfig(_Section):
    """Under torch.distributed (README, 'Distributed'); nothing changes in a single process."""

    aggregate: bool = Field(
        True,
        description="Combine every flush's statistics over all ranks (a few collectives per "
        "flush) and the per-step values skip_step decides on (one small all-reduce per step), "
        "so all ranks see the same global values and take the same actions at the same step. "
        "False: each rank sees and acts on its own values only.",
    )
    jsonl: Literal["rank0", "per_rank"] = Field(
        "rank0",
        description="'rank0': only rank 0 writes the JSONL log, with the global values; "
        "'per_rank': every rank writes its own file ({rank} in sinks.jsonl.path) with its own, "
        "un-aggregated values (the events are the global ones).",
    )
    attach_timeout: PositiveFloat = Field(
        300.0,
        description="Seconds attach() waits until every rank has attached its monitor "
        "(aggregation needs one on each), then raises NumwatchConfigError instead of hanging "
        "in the first collective (a monitor attached on rank 0 only, or disabled on some rank).",
    )


# --- end distributed ---------------------------------------------------------------------------


class MonitorConfig(_Section):
    """Everything a ``Monitor`` can be told. Every field has a safe default."""

    enabled: bool = Field(True, description="False makes attach() a no-op (no hooks at all).")
    run_name: str | None = Field(
        None,
        description="Name of the run in logs; default: run-<UTC timestamp> of the Monitor's "
        "creation (-2, -3... for more monitors made in that second in one process).",
    )
    first_step: NonNegativeInt = Field(
        0,
        description="Number of the first step: a run resumed from a checkpoint at optimizer "
        "step N gives N, so its steps, events and logs keep the run's numbering (the HF Trainer "
        "and Lightning callbacks pass the framework's global step).",
    )
    flush_every: PositiveInt = Field(
        50,
        description="Steps between host reads of the device-side statistics. Each flush costs "
        "host time that grows with the number of series (see README, 'Overhead').",
    )
    strict: bool = Field(
        False, description="Re-raise exceptions from probes and sinks instead of counting them."
    )
    kernel_backend: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="'triton' = fused Triton kernels, 'torch' = reference ops, 'auto' = Triton "
        "on CUDA tensors, torch elsewhere (tensor statistics of CPU tensors: a short path for "
        "tensors without NaN/Inf).",
    )
    cuda_graphs: bool = Field(
        True,
        description="Replay the power iteration's launches (spectral norms) as CUDA graphs once "
        "a layout has run twice: less host time per step. Process-wide: the last monitor "
        "attached sets it.",
    )
    underflow_dtype: Literal["float16", "bfloat16", "float32"] | None = Field(
        None,
        description="Dtype whose smallest normal defines *_underflow_fraction; default: each "
        "tensor's own dtype. Set 'float16' to see fp32 values an fp16 cast would flush.",
    )
    gradients: GradientConfig = Field(default_factory=GradientConfig)
    activations: ActivationConfig = Field(default_factory=ActivationConfig)
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    optimizer: OptimizerProbeConfig = Field(default_factory=OptimizerProbeConfig)
    rules: RulesConfig = Field(default_factory=RulesConfig)
    history: PositiveInt = Field(20, description="Recent flushes kept for halt reports/snapshots.")
    events_kept: PositiveInt = Field(
        10_000,
        description="Most recent events kept in Monitor.events (a long run with a rule firing "
        "every flush would otherwise grow without bound); all are logged and counted.",
    )
    sinks: SinksConfig = Field(default_factory=SinksConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @model_validator(mode="after")
    def _step_rules_have_gradients(self) -> MonitorConfig:
        """A skip_step rule reading the step's gradient norm (``grad_norm``; ``nonfinite``, the
        norm plus the loss) with the gradient probe off had no norm to read: silent, it let a
        NaN gradient reach the weights without an event."""
        if not self.gradients.enabled:
            for rule in self.rules.add:
                if rule.enabled and rule.skips_steps and rule.metric in ("grad_norm", "nonfinite"):
                    raise ValueError(
                        f"rules[{rule.name}]: skip_step decides from the step's gradient norm "
                        f"(metric {rule.metric!r}), which gradients.enabled false leaves "
                        "unmeasured, so a NaN gradient would reach the weights unreported; "
                        "set gradients.enabled true, or use metric 'loss'"
                    )
        return self

    @classmethod
    def load(
        cls,
        config: MonitorConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> MonitorConfig:
        """Build a config from ``config`` (object, dict or YAML path), env and keyword overrides."""
        if config is None:
            base: dict[str, Any] = {}
        elif isinstance(config, MonitorConfig):
            base = _given(config)
        elif isinstance(config, Mapping):
            base = dict(config)
        elif isinstance(config, (str, os.PathLike)):
            base = _read_yaml(Path(config))
        else:
            raise NumwatchConfigError(
                f"config must be a MonitorConfig, a dict or a path to a YAML file, "
                f"got {type(config).__name__}"
            )
        from_env = _env_overrides(os.environ if env is None else env)
        from_code = _expand_dunder(overrides)
        merged = _deep_merge(_deep_merge(_expand_dunder(base), from_env), from_code)
        # Where each value came from, for the error message: (precedence, source) per key path.
        sources: dict[tuple[str, ...], tuple[int, str]] = {}
        if isinstance(config, (str, os.PathLike)):
            sources |= dict.fromkeys(_leaves(base), (0, f"config file {str(config)!r}"))
        for name in _env_names(os.environ if env is None else env):
            sources[tuple(name[len(ENV_PREFIX) :].lower().split("__"))] = (1, name)
        sources |= dict.fromkeys(_leaves(from_code), (2, ""))  # the code's: no source to name
        return cls.validated(merged, sources)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> MonitorConfig:
        """Config from a YAML file alone (no env, no overrides)."""
        data = _expand_dunder(_read_yaml(Path(path)))  # rules__disable, as ``load`` reads it
        return cls.validated(data, dict.fromkeys(_leaves(data), (0, f"config file {str(path)!r}")))

    @classmethod
    def validated(
        cls,
        data: Mapping[str, Any],
        sources: Mapping[tuple[str, ...], tuple[int, str]] | None = None,
    ) -> MonitorConfig:
        """Validate ``data``, turning pydantic's report into one readable NumwatchConfigError
        (naming where a bad value came from when ``sources`` knows: {key path: (precedence,
        source)}; a value under a path comes from its highest-precedence source)."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise NumwatchConfigError(_describe(exc, sources or {})) from None


def expand_path(path: str) -> str:
    """~ and $VARIABLES in a path setting, expanded: written in a YAML file or a quoted
    environment value, they were taken literally (a folder named '~' in the working
    directory)."""
    return os.path.expandvars(os.path.expanduser(path))


def _read_yaml(path: Path) -> dict[str, Any]:
    where = f"config file {str(path)!r}"
    path = Path(expand_path(str(path)))
    if not path.is_file():
        raise NumwatchConfigError(
            f"{where} " + ("is not a file" if path.exists() else "does not exist")
        )
    try:
        data = yaml.load(path.read_bytes().decode(), _ConfigLoader)  # a SafeLoader
    except UnicodeDecodeError as exc:
        raise NumwatchConfigError(f"{where} is not UTF-8 text: {exc}") from None
    except yaml.YAMLError as exc:
        raise NumwatchConfigError(f"{where} is not valid YAML: {_yaml_problem(exc)}") from None
    if data is None:  # empty, or comments only
        return {}
    if not isinstance(data, dict):
        raise NumwatchConfigError(f"{where} must hold a mapping at top level, not {data!r}")
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """pyyaml's message on one line, without the '<unicode string>' it names the text by."""
    if isinstance(exc, yaml.reader.ReaderError):  # a control character; other errors are marked
        return f"{exc.reason} (character #x{exc.character:04x} at offset {exc.position})"
    return "; ".join(
        f"{text} (line {mark.line + 1}, column {mark.column + 1})" if mark else text
        for text, mark in ((exc.context, exc.context_mark), (exc.problem, exc.problem_mark))
        if text
    )


def _given(model: BaseModel) -> dict[str, Any]:
    """The fields ``model`` was given, at any depth, as plain data. Not
    ``model_dump(exclude_unset=True)``: a nested section assigned to (``cfg.gradients.every = 10``)
    is not marked as set in its parent, a list edited in place is not marked at all, and a rule's
    default ``type`` (its discriminator) would be dropped."""
    dumped = model.model_dump()
    out: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, _Section):
            if given := _given(value):
                out[name] = given
        elif name in model.model_fields_set or value != field.get_default(
            call_default_factory=True
        ):
            out[name] = dumped[name]
    return out


def _expand_dunder(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{'sinks__jsonl__path': x} -> {'sinks': {'jsonl': {'path': x}}}."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if not isinstance(key, str):
            raise NumwatchConfigError(f"config keys are setting names (text), got {key!r}")
        if isinstance(value, _Section):
            value = _given(value)
        parts = key.split("__")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise NumwatchConfigError(f"config key {key!r} conflicts with a value at {part!r}")
        leaf = parts[-1]
        if isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
            node[leaf] = _deep_merge(node[leaf], _expand_dunder(value))
        else:
            node[leaf] = _expand_dunder(value) if isinstance(value, Mapping) else value
    return out


def _env_names(env: Mapping[str, str]) -> list[str]:
    """The NUMWATCH_* variables that configure the monitor (an empty one is unset, as a shell
    user means by `export NUMWATCH_FLUSH_EVERY=`)."""
    return [
        name
        for name, raw in env.items()
        if name.startswith(ENV_PREFIX)
        and len(name) > len(ENV_PREFIX)
        and name not in KERNEL_ENV
        and raw.strip()
    ]


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name in _env_names(env):
        raw, key = env[name], name[len(ENV_PREFIX) :].lower()
        if _takes_text(key):
            flat[key] = raw
            continue
        try:
            flat[key] = yaml.load(raw, _ConfigLoader)  # a SafeLoader
        except yaml.YAMLError as e:
            if raw.lstrip()[:1] in "[{":  # meant as a list or mapping: say why it is not one
                raise NumwatchConfigError(
                    f"{name}={raw!r} does not parse as YAML ({str(e).splitlines()[0]}); "
                    "quote items that start with * or & (e.g. ['*embed*', '*wte*'])"
                ) from None
            flat[key] = raw
    return _expand_dunder(flat)


class _ConfigLoader(yaml.SafeLoader):
    """YAML for config files and NUMWATCH_* values, with YAML 1.2's plain scalars (its core
    schema) instead of PyYAML's YAML 1.1 ones, which surprised:

    - ``lr_factor: 1e-3`` and ``5e-1`` (no dot) were text, a float only where pydantic
      converts it (not in an action's settings, a dict until the action is built);
    - yes/no/on/off were booleans: a text field given ``run_name: no`` or a glob ``[on]`` got
      False/True and failed as "got False"; only true/false are booleans now, the other words
      are the text written, which a bool field still takes (pydantic reads yes/no/on/off);
    - zero-padded numbers were octal (``first_step: 010`` was 8) and time-like ones base 60
      (``flush_every: 1:30`` was 90); numbers are decimal now (or YAML 1.2's ``0x``/``0o``),
      ``1:30`` is text;
    - dates were dates (``run_name: 2026-01-01`` failed as "got datetime.date").
    """


_BOOL, _INT, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_YAML11 = (_BOOL, _INT, _FLOAT, "tag:yaml.org,2002:timestamp")
_ConfigLoader.yaml_implicit_resolvers = {
    first: kept
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    if (kept := [(tag, regexp) for tag, regexp in resolvers if tag not in _YAML11])
}
_ConfigLoader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_ConfigLoader.add_implicit_resolver(  # YAML 1.2 core: decimal, 0o octal, 0x hexadecimal
    _INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_ConfigLoader.add_implicit_resolver(  # after the int: the pattern takes integers too
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)


def _core_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """A YAML 1.2 core integer: zero-padded decimals stay decimal (``010`` is 10)."""
    text = loader.construct_scalar(node)
    try:
        if text[:2] in ("0x", "0o"):
            return int(text, 0)
        return int(text, 10)
    except ValueError:  # an explicit !!int of another form
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not a YAML 1.2 integer", node.start_mark
        ) from None


_ConfigLoader.add_constructor(_INT, _core_int)


def _takes_text(key: str) -> bool:
    """Whether the field ``key`` (``sinks__jsonl__path``) names accepts a str: YAML would turn a
    job id ``0042`` into 34, a host ``::`` into a mapping and cut a path at `` #``. Unknown keys
    are parsed as before, so validation still reports them."""
    model: type[BaseModel] = MonitorConfig
    *sections, leaf = key.split("__")
    for part in sections:
        field = model.model_fields.get(part)
        section = field.annotation if field else None
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            return False
        model = section
    field = model.model_fields.get(leaf)
    if field is None:
        return False
    union = get_origin(field.annotation) in (Union, types.UnionType)
    return str in (get_args(field.annotation) if union else (field.annotation,))


def _deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _leaves(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The key paths of a nested dict's values (mappings are walked, other values are leaves)."""
    out = []
    for key, value in tree.items():
        path = (*prefix, str(key))
        out += _leaves(value, path) if isinstance(value, Mapping) and value else [path]
    return out


def _source(loc: tuple[Any, ...], sources: Mapping[tuple[str, ...], tuple[int, str]]) -> str:
    """' (from NUMWATCH_X)' / ' (from config file ...)' for an error at ``loc``; '' for code.
    A value's error names the source that set it; a section's own validator, which reads every
    value under it, names each source that set one (not only the highest: a neighbouring env
    variable was blamed for the config file's value)."""
    at = tuple(str(p) for p in loc)
    above = [
        (rank, len(path), name) for path, (rank, name) in sources.items() if at[: len(path)] == path
    ]
    if above:
        source = max(above)[2]
        return f" (from {source})" if source else ""
    below = sorted(
        {(rank, name) for path, (rank, name) in sources.items() if path[: len(at)] == at and name}
    )
    return f" (from {', '.join(name for _, name in below)})" if below else ""


def _describe(exc: ValidationError, sources: Mapping[tuple[str, ...], tuple[int, str]]) -> str:
    lines = []
    for err in exc.errors():
        kind = err["type"]
        if kind == "bool_count":  # a section's check of one of its fields: the field's source
            where = (*err["loc"], err["ctx"]["field"])
            lines.append(".".join([*map(str, err["loc"]), err["msg"]]) + _source(where, sources))
            continue
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        if kind == "extra_forbidden":
            key = str(err["loc"][-1]) if err["loc"] else ""
            if "." in key:  # a dotted name given as one key
                lines.append(
                    f"{key!r} is not a setting name: nest dicts, or join names with '__' "
                    f"({key.replace('.', '__')}=...)"
                )
                continue
            lines.append(
                f"{field}: unknown setting (check the spelling; env names use '__')"
                + _source(err["loc"], sources)
            )
            continue
        value = err.get("input")
        hint = err["msg"]
        if kind == "literal_error" and "expected" in err.get("ctx", {}):
            hint = f"allowed values: {err['ctx']['expected']}"
        if kind == "list_type" and isinstance(value, str):
            hint += f" (a list in YAML: ['{value}'])"
        if kind == "value_error":  # numwatch's own checks: the message says what was wrong
            got = hint.removeprefix("Value error, ")
        else:
            got = f"got {value!r}; {hint}"
        lines.append(f"{field}: {got}" + _source(err["loc"], sources))
    return "invalid numwatch config: " + "; ".join(lines)
