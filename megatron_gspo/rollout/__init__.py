"""Rollout: the `RolloutEngine` interface, the SGLang HTTP client and the embedded CPU engine.

This package knows SGLang and nothing of Megatron. Importing it is cheap: SGLang's modules are
imported only by the functions that need them (weight payloads, validation, the embedded
engine).
"""

from megatron_gspo.rollout.engine import EngineError, NoEnginesLeft, RolloutEngine
from megatron_gspo.rollout.types import (
    RolloutResult,
    RolloutStats,
    Sample,
    SampleValidationError,
    SamplingParams,
    abs_logp_diff,
    mismatch_metrics,
)

__all__ = [
    "EngineError",
    "NoEnginesLeft",
    "RolloutEngine",
    "RolloutResult",
    "RolloutStats",
    "Sample",
    "SampleValidationError",
    "SamplingParams",
    "abs_logp_diff",
    "mismatch_metrics",
]
