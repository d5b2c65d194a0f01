"""Trainer -> rollout engine weights, and HF <-> Megatron checkpoint conversion.

Per RL step, on every trainer rank, after the optimizer step:

    from megatron_gspo.weights import WeightSync, WeightSyncConfig

    sync = WeightSync(bridge, engines, WeightSyncConfig(transport="tensor", fp8=False))
    report = sync.push(model)        # -> SyncReport(version=sync.version, seconds, stats, ...)

`engines` is a `RolloutEngine` (or a list of them) on the sender rank and may be `[]` elsewhere.
Modules: `stream` (bridge export -> size-bounded buckets; what is gathered where), `fp8` (block
e4m3 quantise-on-send + bound check), `transports` (tensor / distributed / disk), `checksum`,
`sync` (version counter, checks), `hf_io` (HF directories), `convert` (torch_dist conversion).
"""

from megatron_gspo.weights.checksum import WeightIntegrityError
from megatron_gspo.weights.stream import DEFAULT_BUCKET_BYTES, Bucket, StreamStats, model_buckets
from megatron_gspo.weights.sync import (
    SyncReport,
    WeightSync,
    WeightSyncConfig,
    WeightSyncError,
    make_weight_sync,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "StreamStats",
    "SyncReport",
    "WeightIntegrityError",
    "WeightSync",
    "WeightSyncConfig",
    "WeightSyncError",
    "make_weight_sync",
    "model_buckets",
]
