"""The default rule set: conservative thresholds for the precursors of DESIGN.md §1.

Each threshold is set well above what healthy runs show (DESIGN.md §1b): healthy small GPTs keep
max logits at 10-120 and no exact ties in fp32 scores; the diverging ones pass 1e3 logits tens
of steps before they blow up, and tie in 2-20 % of rows once logits reach 1e5.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from numwatch.rules.base import Rule
from numwatch.rules.growth import GrowthRule
from numwatch.rules.nonfinite import NonfiniteRule
from numwatch.rules.persistence import PersistenceRule
from numwatch.rules.threshold import ThresholdRule
from numwatch.rules.trend import TrendRule
from numwatch.rules.zscore import ZScoreRule

if TYPE_CHECKING:  # numwatch.config imports the rules
    from numwatch.config import RulesConfig

__all__ = ["configured_rules", "default_rules"]


def configured_rules(cfg: RulesConfig) -> dict[str, Rule]:
    """The rules ``cfg`` asks for, by name, with fresh state: the defaults (unless
    ``defaults=False``) less ``disable``, plus ``add`` (a rule named like a default replaces it,
    README's way to change a default). ``RulesConfig`` checked the names: ``disable`` names
    default rules, ``add`` has no name twice."""
    rules = {
        r.name: r for r in (default_rules() if cfg.defaults else []) if r.name not in cfg.disable
    }
    for rule in cfg.add:
        rules[rule.name] = type(rule).model_validate(rule.model_dump())  # fresh state
    return rules


def default_rules() -> list[Rule]:
    """Fresh instances (rules keep per-series history)."""
    swap = ["swap_attention_kernel"]
    return [
        NonfiniteRule(name="nonfinite"),
        # Small heads (d <= 32) at initialisation tie in a few % of rows by chance; the diverging
        # runs of DESIGN.md tie in 2-20 %. Swapping kernels is harmless, so it acts, but only on
        # a sustained 5 %.
        ThresholdRule(
            name="attn_repeated_max",
            metric="attn_repeated_max_fraction",
            threshold=0.05,
            for_flushes=3,
            cooldown=10,
            actions=swap,
        ),
        # Near-uniform rows (all logits within 0.002 of the max, e.g. at initialisation) are
        # saturated without harm; report only. Small heads (d 32, T 64) read 0.09-0.17 in
        # healthy warm-ups (10 % fired on an eager tiny GPT-2 at its first three samples), the
        # healthy controls of bench/results/repro_* at most 0.16, the diverging runs 0.38-0.996.
        ThresholdRule(
            name="attn_saturated",
            metric="attn_saturated_fraction",
            threshold=0.25,
            for_flushes=3,
            cooldown=10,
        ),
        # Report only: the signed bias cancels across output dims when V's signs differ, and in
        # the NoPE + sink CPU runs (bench/results/repro_paper_mechanism_sinks_cpu_lr_scan.json)
        # it never fired on the BF16-accumulating kernel but did once on the stabilized one.
        PersistenceRule(
            name="attn_output_bias_persistent",
            metric="attn_output_bias",
            flushes=5,
            min_abs=0.5,
            cooldown=10,
        ),
        # The output error beyond correct rounding that keeps one sign per output dim: the
        # paper's biased rounding whatever V's signs. Same runs: the BF16-accumulating kernel
        # 0.7-0.95 once logits grow (fires at steps 69-79), the stabilized one 0.002-0.17 on
        # average (never fires).
        ThresholdRule(
            name="attn_output_systematic",
            metric="attn_output_systematic_error",
            threshold=0.5,
            for_flushes=5,
            cooldown=10,
            actions=swap,
        ),
        ThresholdRule(
            name="attn_max_logit_high", metric="attn_max_logit", threshold=1e3, cooldown=10
        ),
        TrendRule(
            name="attn_max_logit_growth",
            metric="attn_max_logit",
            window=10,
            min_slope=math.log(1.1),  # > 10 %/flush: the slope is of ln(value)
            min_r2=0.8,
            min_value=100.0,
            cooldown=10,
        ),
        ZScoreRule(name="grad_norm_spike", metric="grad_norm", sigma=6.0, window=50),
        ZScoreRule(name="loss_spike", metric="loss", sigma=6.0, window=50),
        # The loss at twice its median of the last 5 flushes. Replayed over the 23 H200 logs of
        # bench/results/repro_*h200* (bench/replay_rules.py): no event in the 16 runs that never
        # diverged, at their own cadence (10 steps; 50 in two) or thinned to the default 50; 6 of
        # the 7 divergences caught at either cadence (at 50: two 439 steps early, the others
        # 4-39 steps after; the seventh is one step no flush sampled). Session 13's 20-flush
        # window caught 1 within 50 steps at cadence 50 (it spans 1,000 steps there, still high
        # from the early descent); loss_spike none, and 3 false alarms at cadence 10.
        GrowthRule(name="loss_rise", metric="loss", factor=2.0, window=5, kind="spike"),
        ThresholdRule(
            name="activation_overflow_risk",
            metric="activation_headroom",
            threshold=0.5,
            kind="anomaly",
            cooldown=10,
        ),
        ThresholdRule(
            name="grad_underflow",
            metric="grad_underflow_fraction",
            threshold=0.1,
            for_flushes=3,
            kind="anomaly",
            cooldown=10,
        ),
    ]
