"""Blockwise FP8 (e4m3) quantise-on-send, in the layout of FP8 Qwen3 / DeepSeek-V3 checkpoints.

The layout itself (names, shapes, `quantise_blockwise`, `dequantise_blockwise`) is SGLang's and
lives in `engines/fp8_blocks.py`, which the embedded engine's FP8 emulation reads too; it is
re-exported here. This module adds what the sender needs: the error bound checked on every
quantised tensor and `quantise_named`; the checkpoint's `quantization_config` is re-exported too.

The format (block scales, `weight_scale_inv`, which weights are quantised, the shape legend) is
described once, in `engines/fp8_blocks.py`.

Error bound (what `check_dequantised` enforces per block): e4m3 has 3 mantissa bits, so
round-to-nearest of a normal value has relative error <= 2^-4; values below the smallest normal
(2^-6 in scaled units) are rounded on a fixed grid of 2^-9, i.e. absolute error <= 2^-10 * s.
"""

from __future__ import annotations

import torch

from megatron_gspo.engines.fp8_blocks import (
    BLOCK,
    E4M3_MAX,
    SCALE_SUFFIX,
    dequantise_blockwise,
    is_quantised_name,
    not_converted_modules,
    quantisation_config,
    quantise_blockwise,
    quantization_config_for,
    scale_name,
    scale_shape,
)
from megatron_gspo.engines.fp8_blocks import to_blocks as _blocks

REL_BOUND = 2.0**-4
"""Half an ulp of a 3-bit mantissa: the worst relative rounding error of a normal e4m3 value."""
SUBNORMAL_ABS_BOUND = 2.0**-10
"""Half the subnormal spacing (2^-9) of e4m3, in units of the block scale."""


def block_error_ratio(
    x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK
) -> torch.Tensor:
    """Per block, the worst `|deq - x| / bound` with bound = 2^-4 |x| + 2^-10 s  ([Nb, Kb]).

    A value <= 1 everywhere means every element is within e4m3's rounding bound.
    """
    xf = x.float()
    err = _blocks((dequantise_blockwise(q, scale_inv, block) - xf).abs(), block)
    bound = REL_BOUND * _blocks(xf.abs(), block) + SUBNORMAL_ABS_BOUND * scale_inv[:, None, :, None]
    # fp32 rounding of x / s and q * s adds a few ulps on top of the e4m3 rounding.
    bound = bound * (1 + 1e-5) + 1e-30
    return (err / bound).amax(dim=(1, 3))


def check_dequantised(
    name: str, x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK
) -> float:
    """Raise if any element of `q * scale_inv` is outside e4m3's bound; return the worst ratio."""
    expected = scale_shape(x.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"{name}: scale shape {tuple(scale_inv.shape)} != {expected}")
    ratio = block_error_ratio(x, q, scale_inv, block)
    worst = float(ratio.max())
    if not worst <= 1.0:
        bad = divmod(int(ratio.argmax()), ratio.size(1))
        raise ValueError(
            f"{name}: FP8 dequantisation error {worst:.3f}x the e4m3 bound in block {bad}"
        )
    return worst


def error_ratio_max(
    name: str, x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK
) -> torch.Tensor:
    """`max(block_error_ratio(x, q, scale_inv))` as a 0-d fp32 tensor on x's device, with no
    host synchronisation (a bucket's worth is read at once by `check_ratios`); raises only on a
    wrong scale shape, which is known without reading the device."""
    expected = scale_shape(x.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"{name}: scale shape {tuple(scale_inv.shape)} != {expected}")
    return block_error_ratio(x, q, scale_inv, block).amax()


def check_ratios(named: list[tuple[str, torch.Tensor]]) -> float:
    """Raise naming the worst tensor if any of the 0-d ratios of `error_ratio_max` exceeds 1
    (or is NaN); return the worst. One device->host read for the whole list (a bucket)."""
    if not named:
        return 0.0
    stacked = torch.stack([r.float() for _, r in named])
    worst, where = torch.stack([stacked.max(), stacked.argmax().float()]).tolist()
    if not worst <= 1.0:
        raise ValueError(
            f"{named[int(where)][0]}: FP8 dequantisation error {worst:.3f}x the e4m3 bound"
        )
    return float(worst)


def quantise_named(
    name: str,
    tensor: torch.Tensor,
    *,
    block: int = BLOCK,
    pow2_scale: bool = False,
    other_dtype: torch.dtype = torch.bfloat16,
    check: bool = False,
) -> list[tuple[str, torch.Tensor]]:
    """What FP8 rollout sends for one HF tensor: `[(name, q), (name_scale_inv, s)]` for a
    decoder linear weight, `[(name, tensor in other_dtype)]` for everything else."""
    if not is_quantised_name(name, tensor):
        return [(name, tensor.to(other_dtype))]
    q, s = quantise_blockwise(tensor, block, pow2_scale=pow2_scale)
    if check:
        check_dequantised(name, tensor, q, s, block)
    return [(name, q), (scale_name(name), s)]


__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "REL_BOUND",
    "SCALE_SUFFIX",
    "SUBNORMAL_ABS_BOUND",
    "block_error_ratio",
    "check_dequantised",
    "check_ratios",
    "dequantise_blockwise",
    "error_ratio_max",
    "is_quantised_name",
    "not_converted_modules",
    "quantisation_config",
    "quantise_blockwise",
    "quantise_named",
    "quantization_config_for",
    "scale_name",
    "scale_shape",
]
