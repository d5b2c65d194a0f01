"""SGLang's fused parameter names (`qkv_proj`, `gate_up_proj`, the experts' `w13_weight` /
`w2_weight`) and their HF-named members: a leaf that `weight_shards.py` (checksums of what was
sent) and `weight_layout.py` (what is sent) both use, so neither imports the other for it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from megatron_gspo.engines.sglang_loader import split_slice_name

if TYPE_CHECKING:
    from megatron_gspo.engines.weight_layout import Sendable
    from megatron_gspo.engines.weight_shards import EngineLayout

__all__ = ["is_fused_name", "tensors_only", "unfuse"]

_QKV = re.compile(r"^(?P<p>.*\.self_attn)\.qkv_proj\.(?P<leaf>weight|bias)$")
_GATE_UP = re.compile(r"^(?P<p>.*\.mlp)\.gate_up_proj\.(?P<leaf>weight|bias)$")
_W13 = re.compile(r"^(?P<p>.*\.experts)\.w13_weight$")
_W2 = re.compile(r"^(?P<p>.*\.experts)\.w2_weight$")


def is_fused_name(name: str) -> bool:
    """Whether `name` is one of SGLang's fused parameters (not an HF checkpoint name)."""
    return any(r.match(name) for r in (_QKV, _GATE_UP, _W13, _W2))


def unfuse(name: str, t: torch.Tensor, lay: EngineLayout) -> list[tuple[str, torch.Tensor]]:
    """The HF-named members of a whole (unsharded) SGLang tensor, as views in its byte order;
    `[(name, t)]` for a name SGLang does not fuse. `lay` gives the head counts. An expert
    slice (`sglang_loader.slice_name`: experts `first`, `first + 1`, ...) names its members
    by their expert index in the whole parameter."""
    name, first = split_slice_name(name)
    if first is not None and not (_W13.match(name) or _W2.match(name)):
        raise ValueError(f"{name}: only stacked expert parameters are sent in slices")
    first = first or 0
    if m := _QKV.match(name):
        q, kv = lay.num_heads * lay.head_dim, lay.num_kv_heads * lay.head_dim
        if t.shape[0] != q + 2 * kv:
            raise ValueError(f"{name}: {t.shape[0]} rows, expected {q} + 2 x {kv} (q, k, v)")
        p, leaf = m["p"], m["leaf"]
        return [
            (f"{p}.q_proj.{leaf}", t[:q]),
            (f"{p}.k_proj.{leaf}", t[q : q + kv]),
            (f"{p}.v_proj.{leaf}", t[q + kv :]),
        ]
    if m := _GATE_UP.match(name):
        half = _half(name, t, 0)
        p, leaf = m["p"], m["leaf"]
        return [(f"{p}.gate_proj.{leaf}", t[:half]), (f"{p}.up_proj.{leaf}", t[half:])]
    if m := _W13.match(name):
        half = _half(name, t, 1)
        out = []
        for e in range(t.shape[0]):
            out.append((f"{m['p']}.{first + e}.gate_proj.weight", t[e, :half]))
            out.append((f"{m['p']}.{first + e}.up_proj.weight", t[e, half:]))
        return out
    if m := _W2.match(name):
        return [(f"{m['p']}.{first + e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
    return [(name, t)]


def _half(name: str, t: torch.Tensor, dim: int) -> int:
    if t.shape[dim] % 2:
        raise ValueError(f"{name}: dim {dim} of {tuple(t.shape)} is not gate + up")
    return t.shape[dim] // 2


def tensors_only(named: Sequence[tuple[str, Sendable]]) -> list[tuple[str, torch.Tensor]]:
    """`named` as plain tensors, for the paths that send HF names only (a `FusedParts` there
    is a bug upstream: raise, naming it)."""
    out = []
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: SGLang's fused layout reached a path that sends HF names")
        out.append((name, t))
    return out
