"""Block FP8 (e4m3) tensors in the layout of SGLang's FP8 checkpoints (`weight_block_size:
[128, 128]`, Qwen3 / DeepSeek-V3 FP8 releases): which HF weights are quantised, their
`_scale_inv` names and shapes, quantisation and dequantisation.

A weight `W [N, K]` is cut into 128x128 blocks; each block gets one fp32 scale
`s = amax(|block|) / 448` and is stored as `q = round_e4m3(W / s)`. The scales are published as
`<module>.weight_scale_inv` with shape `[ceil(N/128), ceil(K/128)]`, and dequantisation is
`W ~= q * s` (the "inverse" in the name is historical: it is the multiplier of `q`).
Only decoder linear weights are quantised; norms, the MoE router, embeddings and lm_head stay
BF16, as in the published FP8 checkpoints.

The format is SGLang's, so it lives with the engines: the weight sync quantises with it on send
(`weights/fp8.py` adds its error bounds) and the embedded engine's FP8
emulation (`engines/embedded/fp8_emulation.py`) holds and loads the same tensors.

torch is imported by the functions that compute: the names and the checkpoint's
`quantization_config` serve the planner's checks (`topology.py`), which load no torch.

Shape legend: N rows (output features), K columns (input features), B = 128 block edge,
Nb = ceil(N/B), Kb = ceil(K/B).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from megatron_gspo.layout import HFConfigLike, hf_value

if TYPE_CHECKING:
    import torch

E4M3_MAX = 448.0
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"

# Decoder linear weights (attention q/k/v/o, dense/shared/expert gate/up/down, MLA projections).
# `mlp.gate.weight` (the router) and `shared_expert_gate.weight` do not end in `_proj.weight`.
_QUANTISED = re.compile(r"\.layers\.\d+\..*_proj\.weight$")


def is_quantised_name(name: str, tensor: torch.Tensor | None = None) -> bool:
    """Whether an HF weight is sent as block FP8 (2-D decoder linear weights only)."""
    return bool(_QUANTISED.search(name)) and (tensor is None or tensor.dim() == 2)


def scale_name(name: str) -> str:
    """`...q_proj.weight` -> `...q_proj.weight_scale_inv` (the FP8 Qwen3 checkpoint name)."""
    return name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...] | torch.Size, block: int = BLOCK) -> tuple[int, int]:
    """Shape of the per-block scale of a `[N, K]` weight: `[ceil(N/B), ceil(K/B)]`."""
    n, k = shape
    return math.ceil(n / block), math.ceil(k / block)


def to_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[N, K] -> zero-padded [Nb, B, Kb, B] (fp32)."""
    import torch

    n, k = x.shape
    nb, kb = scale_shape(x.shape, block)
    padded = x.new_zeros((nb * block, kb * block), dtype=torch.float32)
    padded[:n, :k] = x
    return padded.view(nb, block, kb, block)


def quantise_blockwise(
    x: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise `x [N, K]` to e4m3 with one scale per `block x block` tile.

    Returns `(q [N, K] float8_e4m3fn, scale_inv [Nb, Kb] float32)` with `x ~= q * scale_inv`.
    pow2_scale: round scales up to a power of two (what DeepGEMM's UE8M0 layout requires).
    """
    import torch

    if x.dim() != 2:
        raise ValueError(f"block FP8 needs a 2-D weight, got shape {tuple(x.shape)}")
    n, k = x.shape
    xb = to_blocks(x, block)
    # An all-zero block would give scale 0 and 0/0; any positive scale represents it exactly.
    amax = xb.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [Nb, Kb]
    scale = amax / E4M3_MAX
    if pow2_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xb / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.view(-1, q.size(2) * block)[:n, :k].contiguous()
    return q, scale.contiguous()


def dequantise_blockwise(
    q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK
) -> torch.Tensor:
    """`q [N, K] e4m3` * per-block `scale_inv [Nb, Kb]` -> fp32 `[N, K]`."""
    n, k = q.shape
    qb = to_blocks(q.float(), block)
    return (qb * scale_inv[:, None, :, None]).view(qb.size(0) * block, -1)[:n, :k]


def quantisation_config(block: int = BLOCK, not_converted: list[str] | None = None) -> dict:
    """The `quantization_config` of an FP8 block checkpoint's config.json (SGLang reads it)."""
    cfg: dict = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    if not_converted:
        cfg["modules_to_not_convert"] = sorted(not_converted)
    return cfg


def not_converted_modules(hf_config: HFConfigLike) -> list[str]:
    """HF linear modules that stay BF16 under FP8 (what `is_quantised_name` does not quantise):
    lm_head, and per decoder layer of a MoE model the router (`mlp.gate`) and, where the model
    has one, the shared-expert gate. Listed so that the engine builds them unquantised too."""
    names = ["lm_head"]
    n_layers = int(hf_value(hf_config, "num_hidden_layers", 0) or 0)
    moe = any(
        hf_value(hf_config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
    )
    shared_gate = bool(hf_value(hf_config, "shared_expert_intermediate_size"))
    for i in range(n_layers if moe else 0):
        names.append(f"model.layers.{i}.mlp.gate")
        if shared_gate:
            names.append(f"model.layers.{i}.mlp.shared_expert_gate")
    return names


def quantization_config_for(hf_config: HFConfigLike, block: int = BLOCK) -> dict:
    """The `quantization_config` an engine needs to serve what FP8 sync sends for this model
    (quant_method fp8, e4m3, `[block, block]` weight blocks, dynamic activation scales), from
    its HF config (a `PretrainedConfig` or a config.json dict)."""
    return quantisation_config(block, not_converted=not_converted_modules(hf_config))
