"""The Megatron adapter: its config sections and `PolicySpec` (`config`, no torch), models
from HF configs through megatron-bridge (`model`), the planner's parameter counts
(`param_count`), packed micro-batches (`packing`), the policy step (`step`), checkpoints
(`checkpoint`), routing probes (`routing`) and the CPU attention kernel (`cpu_attention`).

Submodules (but `config`) import megatron-core and are imported by name; this file keeps the
directory a package, so it ships in the wheel.
"""
