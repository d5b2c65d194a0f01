"""SGLang 0.5.23's own parameter layout, for pushes with `load_format="direct"`.

A Qwen3(-MoE) model in SGLang holds fused parameters where the HF checkpoint has several
tensors (`engines/weight_names.py` names them; `engines/weight_shards.py` says what each TP
rank holds). `update_weights_from_tensor` with `load_format="direct"`
(`model_runner_components/weight_updater.py` `_model_load_weights_direct`) looks each sent name
up in `model.named_parameters()` and copies the tensor in whole (`default_weight_loader`: shape
must match): no per-name mapping, no expert-name scan, no per-expert copy. Each TP rank reads
its own entry of `serialized_named_tensors`, so every rank gets the tensors it holds, already
sharded. Only that route takes it: `update_weights_from_distributed` and `_from_disk` always
run the model's `load_weights` (HF names), and `flattened_bucket` is another `load_format`.

Shape legend: E experts (E_l local to an engine rank), I expert intermediate size, H hidden,
Hq / Hkv query / kv heads, d head dim.

    <attn>.qkv_proj.{weight,bias}  [(Hq + 2 Hkv) d, H] = cat(q_proj, k_proj, v_proj)
    <mlp>.gate_up_proj.{weight,bias}               = cat(gate_proj, up_proj)      (dense MLP)
    <mlp>.experts.w13_weight       [E, 2I, H]      = stack_e(cat(gate_e, up_e))
    <mlp>.experts.w2_weight        [E, H, I]       = stack_e(down_e)

The sender fuses the HF-named stream into these whole tensors (`Fuser`: one tensor per fused
parameter, a layer's experts stacked once), and the receiver side cuts each into the part an
engine rank holds (`rank_tensors`); `unfuse` gives the HF-named views back (the checksums
and the embedded engine, which holds HF names).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from megatron_gspo.engines.weight_fused import is_fused_name, unfuse
from megatron_gspo.engines.weight_names import sglang_slot
from megatron_gspo.engines.weight_shards import EngineLayout, engine_shard

LAYOUTS: tuple[str, ...] = ("hf", "engine")
"""How a push names its tensors: HF checkpoint names (every transport, SGLang's per-name
`load_weights`) or SGLang's own fused parameters (`load_format="direct"`, tensor transport)."""

def unfuse_all(
    named: Iterable[tuple[str, torch.Tensor]], lay: EngineLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """`unfuse` over a stream: HF names throughout (views, no copies)."""
    for name, t in named:
        yield from unfuse(name, t, lay)


def _assemble(sglang_name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The fused tensor of members in order: experts stacked (w13: gate then up per expert),
    the rest concatenated along dim 0; one copy, into a fresh contiguous tensor."""
    if sglang_name.endswith(".w13_weight"):
        gates, ups = parts[0::2], parts[1::2]
        rows = gates[0].shape[0]
        out = parts[0].new_empty((len(gates), 2 * rows, *gates[0].shape[1:]))
        for e, (g, u) in enumerate(zip(gates, ups, strict=True)):
            out[e, :rows].copy_(g)
            out[e, rows:].copy_(u)
        return out
    if sglang_name.endswith(".w2_weight"):
        return torch.stack(parts)
    return torch.cat(parts)


class Fuser:
    """Turn an HF-named tensor stream into SGLang's whole fused tensors (`add`, `close`).

    Members of one fused parameter are held until the last arrives (at most one layer's
    experts: megatron-bridge exports a layer's experts one after the other); names SGLang
    does not fuse pass straight through. The output's bytes are the members' bytes back to
    back in SGLang's order, so a fused tensor equals what SGLang assembles from HF names.
    """

    def __init__(self, num_experts: int = 0) -> None:
        """num_experts: experts per MoE layer (0: unknown; experts are then held to `close`)."""
        self.num_experts = num_experts
        self._parts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}

    def _members(self, group: str) -> list[tuple[int, int]] | None:
        if group.endswith((".qkv_proj.weight", ".qkv_proj.bias")):
            return [(0, 0), (0, 1), (0, 2)]
        n = self.num_experts
        if group.endswith(".w13_weight"):
            return [(e, i) for e in range(n) for i in (0, 1)] if n else None
        if group.endswith(".w2_weight"):
            return [(e, 0) for e in range(n)] if n else None
        return [(0, 0), (0, 1)]  # gate_up_proj

    def add(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Account one HF tensor; returns the tensors now complete (SGLang names)."""
        slot = sglang_slot(name)
        if slot is None:
            return [(name, t)]
        group, key = slot
        parts = self._parts.setdefault(group, {})
        if key in parts:
            raise ValueError(f"{name}: sent twice into {group}")
        parts[key] = t
        keys = self._members(group)
        if keys is None or len(parts) < len(keys):
            return []
        return [self._close(group, keys)]

    def _close(self, group: str, keys: list[tuple[int, int]]) -> tuple[str, torch.Tensor]:
        parts = self._parts.pop(group)
        if sorted(parts) != keys:
            raise ValueError(f"{group}: members {sorted(parts)} arrived, expected {keys}")
        return group, _assemble(group, [parts[k] for k in keys])

    def close(self) -> list[tuple[str, torch.Tensor]]:
        """The groups still open (experts of unknown count: as many as arrived, no gaps);
        raises when a group misses a member (q and v but no k)."""
        out = []
        for group in list(self._parts):
            keys = self._members(group)
            if keys is None:
                n = 1 + max(e for e, _ in self._parts[group])
                per = 1 if group.endswith(".w2_weight") else 2
                keys = [(e, i) for e in range(n) for i in range(per)]
            out.append(self._close(group, keys))
        return out


def fused_stream(
    named: Iterable[tuple[str, torch.Tensor]], *, num_experts: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """An HF-named stream as SGLang's whole fused tensors, each as soon as it is complete."""
    fuser = Fuser(num_experts)
    for name, t in named:
        yield from fuser.add(name, t)
    yield from fuser.close()


def rank_tensor(
    name: str, t: torch.Tensor, rank: int, lay: EngineLayout
) -> tuple[str, torch.Tensor] | None:
    """What TP rank `rank` of an engine of layout `lay` holds of the whole SGLang tensor
    `name` (None: nothing, e.g. another rank's experts), exactly as its weight loaders would
    have built it from HF names: the members are cut as `engine_shard` cuts them and fused
    again. One TP rank without EP: the tensor itself (the vocabulary padded)."""
    if not is_fused_name(name):
        return engine_shard(name, t, rank, lay)
    if lay.tp_size == 1 and lay.ep_size == 1:
        return name, t
    parts = [engine_shard(n, m, rank, lay) for n, m in unfuse(name, t, lay)]
    kept = [p for p in parts if p is not None]
    if not kept:
        return None
    local_experts = lay.num_experts // lay.ep_size if lay.num_experts else 0
    fused = list(fused_stream(kept, num_experts=local_experts))
    if len(fused) != 1 or fused[0][0] != name:
        raise ValueError(f"{name}: rank {rank}'s parts fused into {[n for n, _ in fused]}")
    return fused[0]


def engine_layout(model: EngineLayout, tp_size: int) -> EngineLayout:
    """`model`'s layout for an engine of `tp_size` ranks (its expert-parallel size kept only
    when the engine is sharded at all, as SGLang's `--ep-size` needs `--tp-size` ranks)."""
    return dataclasses.replace(model, tp_size=tp_size, ep_size=model.ep_size if tp_size > 1 else 1)


def rank_tensors(
    named: Iterable[tuple[str, torch.Tensor]], rank: int, lay: EngineLayout
) -> list[tuple[str, torch.Tensor]]:
    """`rank_tensor` over a bucket: the `(sglang_name, tensor)` list rank `rank` loads."""
    out = []
    for name, t in named:
        part = rank_tensor(name, t, rank, lay)
        if part is not None:
            out.append(part)
    return out


__all__ = [
    "LAYOUTS",
    "engine_layout",
    "Fuser",
    "fused_stream",
    "is_fused_name",
    "rank_tensor",
    "rank_tensors",
    "unfuse",
    "unfuse_all",
]
