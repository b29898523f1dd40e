"""Rules turn metric series into typed events: threshold, growth, z-score, trend, persistence,
non-finite. ``default_rules()`` is the precursor set of DESIGN.md §1 (README, 'Rules')."""

from typing import Annotated

from pydantic import Field

from numwatch.rules.base import Finding, Rule
from numwatch.rules.defaults import configured_rules, default_rules
from numwatch.rules.engine import STEP_METRICS, RuleEngine, at_flush, is_origin, unadopted
from numwatch.rules.growth import GrowthRule
from numwatch.rules.nonfinite import NonfiniteRule
from numwatch.rules.persistence import PersistenceRule
from numwatch.rules.threshold import ThresholdRule
from numwatch.rules.trend import TrendRule
from numwatch.rules.zscore import ZScoreRule

RuleConfig = Annotated[
    ThresholdRule | GrowthRule | ZScoreRule | TrendRule | PersistenceRule | NonfiniteRule,
    Field(discriminator="type"),
]

__all__ = [
    "STEP_METRICS",
    "Finding",
    "GrowthRule",
    "NonfiniteRule",
    "PersistenceRule",
    "Rule",
    "RuleConfig",
    "RuleEngine",
    "ThresholdRule",
    "TrendRule",
    "ZScoreRule",
    "at_flush",
    "configured_rules",
    "default_rules",
    "is_origin",
    "unadopted",
]
