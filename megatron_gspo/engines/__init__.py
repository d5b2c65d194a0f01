"""Everything that knows SGLang or serves its API: the protocols the rest of the package
depends on (`protocols.py`), request/response types (`types.py`), the wire format (`wire.py`),
the HTTP client (`client.py`: generation; `client_control.py`: control calls and health;
`client_weights.py`: weight calls) and its engine pool (`pool.py`), server launch and the engine's
interpreter (`launch.py`), SGLang's version rules and defaults for the config, the planner and
the preflight (`sglang_rules.py`), the embedded CPU engine (`embedded/`), and what an engine
wants of pushed weights: SGLang's parameter names, per-rank shards and own layout, and the
update group's byte layout (`weight_names.py`, `weight_shards.py`, `weight_layout.py`,
`weight_group.py`).

An SGLang upgrade touches this package only. Importing it is cheap: SGLang's modules are
imported only by the functions that need them. It imports no Megatron.
"""

from megatron_gspo.engines.protocols import EngineError, NoEnginesLeft, RolloutEngine
from megatron_gspo.engines.types import (
    RolloutResult,
    RolloutStats,
    Sample,
    SampleValidationError,
    SamplingParams,
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
]
