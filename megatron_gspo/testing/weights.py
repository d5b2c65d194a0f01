"""Whole-model weight views for tests and demos (small models only): the HF state in memory
from a Megatron model or from a safetensors directory, and the FP8 blocks' relative error."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_gspo.weights.convert import hf_tensors
from megatron_gspo.weights.fp8 import BLOCK, _blocks, dequantise_blockwise

if TYPE_CHECKING:
    from megatron.bridge import AutoBridge

__all__ = ["block_relative_error", "hf_state", "load_hf_state"]


def hf_state(bridge: AutoBridge, model: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The full HF-named state in memory on EVERY rank (tests, small models): the same stream
    as `export_hf`, with the bridge's expert all-gather so that each rank receives it all."""
    return {
        name: t.cpu().clone()
        for name, t in hf_tensors(bridge, model, cpu=True, experts_to_first=False)
    }


def load_hf_state(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF safetensors directory (tests and tools; small models only)."""
    from safetensors.torch import load_file

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def block_relative_error(
    x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK
) -> torch.Tensor:
    """Per block, `max |deq - x| / max |x|` ([Nb, Kb]); <= 2^-4 for e4m3."""
    xf = x.float()
    err = _blocks((dequantise_blockwise(q, scale_inv, block) - xf).abs(), block).amax(dim=(1, 3))
    amax = _blocks(xf.abs(), block).amax(dim=(1, 3)).clamp(min=1e-30)
    return err / amax
