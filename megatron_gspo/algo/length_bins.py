"""Per-sequence metrics split by response length, to see how engine/trainer mismatch scales
with the length of a response (the study in docs/evidence.md).

For a per-sequence value `v_i` and response length `|y_i|`, the metric of bin [lo, hi] is

    sum_{i valid, lo <= |y_i| <= hi} v_i  /  #{i valid, lo <= |y_i| <= hi}

returned as the [sum, count] pairs `algo.losses` returns for every metric (reduced over
micro-batches and ranks by `megatron.step.reduce_metrics`; a bin no sequence fell in has count
0 and is left out of the step's metrics). Bins double from 16 tokens: 1-15, 16-31, ..., 256+.
Measurement only: nothing here enters the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LENGTH_BINS", "bin_label", "by_length"]

LENGTH_BINS: tuple[tuple[int, int | None], ...] = (
    (1, 15),
    (16, 31),
    (32, 63),
    (64, 127),
    (128, 255),
    (256, None),
)


def bin_label(lo: int, hi: int | None) -> str:
    """The label of a bin: "32-63", or "256+" for the open last bin."""
    return f"{lo}+" if hi is None else f"{lo}-{hi}"


def by_length(values: dict[str, Tensor], lengths: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """`{name}_len/{bin}` -> stacked [sum, count] (float32) for each per-sequence `values[name]`
    ([S]), binned by `lengths` ([S], response tokens of each whole sequence); only sequences
    with `valid` ([S] bool) count."""
    lengths = lengths.detach()
    out: dict[str, Tensor] = {}
    for lo, hi in LENGTH_BINS:
        inside = valid & (lengths >= lo)
        if hi is not None:
            inside = inside & (lengths <= hi)
        n = inside.float().sum()
        for name, v in values.items():
            total = torch.where(inside, v.detach().float(), 0.0).sum()
            out[f"{name}_len/{bin_label(lo, hi)}"] = torch.stack([total, n])
    return out
