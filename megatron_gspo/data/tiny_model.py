"""Tiny Hugging Face models built locally (never downloaded) for tests and the CPU demo.

The shape mirrors Qwen3-MoE (GQA, qk-norm, RoPE, SwiGLU experts, top-k router, untied
embeddings) at a size that trains in milliseconds on one CPU core.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

TINY_QWEN3_MOE: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.0,
    output_router_logits=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_qwen3_moe_config(**overrides: object) -> Qwen3MoeConfig:
    """A `transformers.Qwen3MoeConfig` for the tiny test model; `overrides` replace fields."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})


def build_tiny_hf_model(
    seed: int = 0, perturb_norms: bool = True, **overrides: object
) -> Qwen3MoeForCausalLM:
    """A randomly initialised tiny `Qwen3MoeForCausalLM` in fp32.

    With `perturb_norms`, RMSNorm weights are moved away from 1 so that a weight mapping that
    skips a norm cannot go unnoticed in a comparison.
    """
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_qwen3_moe_config(**overrides)).float().eval()
    if perturb_norms:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def save_tiny_hf_checkpoint(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random Qwen3-MoE checkpoint (safetensors + config.json) to `path`."""
    path = Path(path)
    model = build_tiny_hf_model(seed=seed, **overrides)
    model.save_pretrained(path)
    return path
