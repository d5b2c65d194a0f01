"""megatron-gspo: GSPO reinforcement learning for Mixture-of-Experts models on Megatron-LM.

A plugin, not a fork: it drives megatron-core through its public contracts and SGLang through its
HTTP API. Importing this package has no side effects; the CPU runtime fixes for megatron-core are
applied only by an explicit call (`megatron_gspo.patches.apply_cpu_runtime()`).
"""

__version__ = "0.1.0"
