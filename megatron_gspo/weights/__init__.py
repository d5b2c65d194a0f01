"""Trainer -> rollout engine weights, and HF <-> Megatron checkpoint conversion.

Per RL step, on every trainer rank, after the optimizer step:

    from megatron_gspo.weights.sync import WeightSync
    from megatron_gspo.weights.config import WeightSyncConfig

    sync = WeightSync(bridge, engines, WeightSyncConfig(transport="tensor", fp8=False))
    report = sync.push(model)        # -> SyncReport(version=sync.version, seconds, stats, ...)

`engines` is a weight receiver (`engines.protocols`) or a list of them on the sender rank and
may be `[]` elsewhere. Modules: `config` (the `weights:` section), `stream` (bridge export ->
size-bounded buckets; what is gathered where), `fp8` (block e4m3 quantise-on-send + bound
check), `transports` (tensor / distributed / disk), `group` (the weight-update process group),
`checksum`, `sync` (version counter, checks), `hf_io` (HF directories), `convert` (torch_dist
conversion). This file imports nothing, so `weights.config` stays light.
"""
