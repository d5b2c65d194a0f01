"""The Megatron adapter: models from HF configs through megatron-bridge (`model`), packed
micro-batches (`packing`), the policy step (`step`), checkpoints (`checkpoint`), routing probes
(`routing`) and the CPU attention kernel (`cpu_attention`).

Submodules import megatron-core and are imported by name; this file keeps the directory a
package, so it ships in the wheel.
"""
