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

The sender groups the HF-named stream by these parameters (`Fuser`: one item per fused
parameter, a layer's experts together), and the receiver side cuts each into the part an
engine rank holds (`rank_tensors`); `unfuse` gives the HF-named views back (the checksums
and the embedded engine, which holds HF names).

One pass over the bytes (`FusedParts`, `rank_pieces`): the sender's stream does not assemble
a fused tensor; it keeps the members as exported, and each engine rank's payload buffer (one
shared-memory segment or CUDA buffer per rank and bucket, `wire.direct_payloads_from_pieces`)
is written once, each member's rank shard copied (and cast) straight to its place in it. A
fused tensor's bytes are its members' bytes back to back in SGLang's order, and so are a
rank's (its shards of the members, in the same order), which is what makes that possible.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import torch

from megatron_gspo.engines.sglang_loader import is_slice_name, slice_name
from megatron_gspo.engines.weight_fused import is_fused_name, tensors_only, unfuse
from megatron_gspo.engines.weight_group import host_views
from megatron_gspo.engines.weight_names import SGLangChecksums, sglang_slot
from megatron_gspo.engines.weight_shards import EngineLayout, engine_shard
from megatron_gspo.engines.wire import fused_checksum

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


def member_names(group: str, keys: list[tuple[int, int]]) -> list[str]:
    """The HF names of a fused parameter's members in `keys` order (`sglang_slot`'s inverse)."""
    if group.endswith((".qkv_proj.weight", ".qkv_proj.bias")):
        stem, leaf = group.rsplit(".qkv_proj.", 1)
        return [f"{stem}.{m}_proj.{leaf}" for m in "qkv"]
    if group.endswith((".gate_up_proj.weight", ".gate_up_proj.bias")):
        stem, leaf = group.rsplit(".gate_up_proj.", 1)
        return [f"{stem}.gate_proj.{leaf}", f"{stem}.up_proj.{leaf}"]
    stem = group.rsplit(".", 1)[0]  # <mlp>.experts
    if group.endswith(".w2_weight"):
        return [f"{stem}.{e}.down_proj.weight" for e, _ in keys]
    return [f"{stem}.{e}.{('gate', 'up')[i]}_proj.weight" for e, i in keys]


class FusedParts:
    """One SGLang fused parameter as its HF-named members, not assembled (`Fuser(lazy=True)`).

    Stands where the whole tensor would in a bucket (`numel`, `element_size`, `dtype` of what
    is sent); `cast` only records the send dtype: the members are cast while they are copied
    into each engine rank's payload buffer (`rank_pieces`), so the bytes are moved once.
    `members()` gives them as sent (cast), `whole()` the assembled tensor (tests, checks).
    """

    __slots__ = ("name", "parts", "dtype", "shape")

    def __init__(
        self,
        name: str,
        parts: list[tuple[str, torch.Tensor]],
        dtype: torch.dtype | None = None,
    ) -> None:
        if not parts or any(t.dtype != parts[0][1].dtype for _, t in parts):
            raise ValueError(f"{name}: members differ in dtype or are missing")
        self.name, self.parts = name, parts
        self.dtype: torch.dtype = dtype or parts[0][1].dtype
        self.shape = _fused_shape(name, [t.shape for _, t in parts])

    def numel(self) -> int:
        return sum(t.numel() for _, t in self.parts)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def device(self) -> torch.device:
        return self.parts[0][1].device

    def cast(self, dtype: torch.dtype | None) -> FusedParts:
        """The same members, sent as `dtype` (None: as they are)."""
        return self if dtype is None else FusedParts(self.name, self.parts, dtype)

    def members(self) -> list[tuple[str, torch.Tensor]]:
        """The HF-named members as sent (cast to `dtype`; no copy when they already are)."""
        return [(n, t.to(self.dtype)) for n, t in self.parts]

    def whole(self) -> torch.Tensor:
        """The assembled fused tensor (a copy)."""
        return _assemble(self.name, [t for _, t in self.members()])


class RankCut(FusedParts):
    """One engine rank's part of an SGLang parameter, already cut on the trainer, for that
    rank only (the colocated home path, `weights.owners_home`: the trainer rank on the engine
    rank's GPU sends it; every other rank of the engine gets nothing of it, `rank_piece`).

    `parts` are the rank's shards in SGLang's order (views of the sender's tensors, or of what
    it received from its peers), `hf` the HF-named tensors the engines that report HF names
    (one-rank engines) hash; `numel` counts the rank's part only."""

    __slots__ = ("rank", "tp_size", "hf")

    def __init__(
        self,
        name: str,
        parts: list[tuple[str, torch.Tensor]],
        *,
        rank: int,
        tp_size: int,
        hf: list[tuple[str, torch.Tensor]],
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(name, parts, dtype)
        self.rank, self.tp_size, self.hf = rank, tp_size, hf

    def cast(self, dtype: torch.dtype | None) -> RankCut:
        if dtype is None:
            return self
        return RankCut(
            self.name, self.parts, rank=self.rank, tp_size=self.tp_size, hf=self.hf, dtype=dtype
        )

    def members(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, t.to(self.dtype)) for n, t in self.hf]

    def whole(self) -> torch.Tensor:
        """The rank's part, assembled (a copy)."""
        return _assemble(self.name, [t.to(self.dtype) for _, t in self.parts])

    def piece(self) -> RankPiece:
        """What the rank loads: the parts' bytes back to back."""
        shape = _fused_shape(self.name, [t.shape for _, t in self.parts])
        return RankPiece(self.name, shape, self.dtype, [t for _, t in self.parts])

    def to_host(self) -> RankCut:
        """The same cut with its tensors in host memory (the gloo / disk paths)."""
        parts = [(n, t.cpu()) for n, t in self.parts]
        hf = [(n, t.cpu()) for n, t in self.hf]
        return RankCut(
            self.name, parts, rank=self.rank, tp_size=self.tp_size, hf=hf, dtype=self.dtype
        )


Sendable = torch.Tensor | FusedParts
"""What a bucket holds in SGLang's layout: a whole tensor or a fused parameter's members
(`RankCut`: one engine rank's part)."""


def _fused_shape(name: str, shapes: Sequence[torch.Size]) -> tuple[int, ...]:
    """The shape of the fused tensor of members of `shapes` (in order): w13 stacks
    `[gate_e; up_e]` per expert, w2 stacks `down_e`, the rest concatenate along dim 0."""
    first = tuple(shapes[0])
    if name.endswith(".w13_weight"):
        return (len(shapes) // 2, 2 * first[0], *first[1:])
    if name.endswith(".w2_weight"):
        return (len(shapes), *first)
    return (sum(s[0] for s in shapes), *first[1:])


@dataclasses.dataclass(frozen=True, slots=True)
class RankPiece:
    """One tensor of an engine rank's `direct` payload: its SGLang name, shape and dtype, and
    the tensors whose bytes, back to back in order (each cast to `dtype`), make it up."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sources: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def rank_piece(
    name: str, item: torch.Tensor | FusedParts, rank: int, lay: EngineLayout
) -> RankPiece | None:
    """What TP rank `rank` of an engine of layout `lay` loads of SGLang parameter `name`
    (`item`: the whole tensor or its `FusedParts`), as views of the sender's tensors: the
    same bytes as `rank_tensor`, never assembled here (None: nothing of it on that rank).
    A `RankCut` is that rank's part already: the others get nothing of it."""
    if isinstance(item, RankCut):
        same = rank == item.rank and lay.tp_size == item.tp_size
        return item.piece() if same else None
    if isinstance(item, FusedParts):
        members, dtype = item.parts, item.dtype
    else:
        members, dtype = unfuse(name, item, lay), item.dtype
    if not is_fused_name(name):
        one = engine_shard(name, members[0][1], rank, lay)
        return None if one is None else RankPiece(name, tuple(one[1].shape), dtype, [one[1]])
    if lay.tp_size == 1 and lay.ep_size == 1:
        kept = members
    else:
        cut = (engine_shard(n, m, rank, lay) for n, m in members)
        kept = [p for p in cut if p is not None]
    if not kept:
        return None
    shards = [t for _, t in kept]
    shape = _fused_shape(name, [s.shape for s in shards])
    return RankPiece(_expert_slice_name(name, kept, lay), shape, dtype, shards)


def _expert_slice_name(name: str, kept: list[tuple[str, torch.Tensor]], lay: EngineLayout) -> str:
    """`name`, or its slice name (`sglang_loader.slice_name`) when `kept` (an engine rank's
    members of stacked expert parameter `name`, named by the rank's local expert index) are
    some of the rank's experts only: one sender's share, when several send one rank's experts
    (`weights.expert_slices`)."""
    if not name.endswith((".w13_weight", ".w2_weight")) or not lay.num_experts:
        return name
    experts = sorted({slot[1][0] for n, _ in kept if (slot := sglang_slot(n)) is not None})
    if len(experts) == lay.num_experts // lay.ep_size:
        return name
    if experts != list(range(experts[0], experts[0] + len(experts))):
        raise ValueError(f"{name}: experts {experts} are not one contiguous slice")
    return slice_name(name, experts[0])


def rank_pieces(
    named: Iterable[tuple[str, Sendable]], rank: int, lay: EngineLayout
) -> list[RankPiece]:
    """`rank_piece` over a bucket: what rank `rank` loads, in order."""
    out = []
    for name, item in named:
        piece = rank_piece(name, item, rank, lay)
        if piece is not None:
            out.append(piece)
    return out


class Fuser:
    """Turn an HF-named tensor stream into SGLang's whole fused tensors (`add`, `close`).

    Members of one fused parameter are held until the last arrives (at most one layer's
    experts: megatron-bridge exports a layer's experts one after the other); names SGLang
    does not fuse pass straight through. The output's bytes are the members' bytes back to
    back in SGLang's order, so a fused tensor equals what SGLang assembles from HF names.
    """

    def __init__(self, num_experts: int = 0, *, lazy: bool = False) -> None:
        """num_experts: experts per MoE layer (0: unknown; experts are then held to `close`).
        lazy: a completed group comes out as its members (`FusedParts`, no copy) instead of
        one assembled tensor."""
        self.num_experts = num_experts
        self.lazy = lazy
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

    def add(self, name: str, t: torch.Tensor) -> list[tuple[str, Sendable]]:
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

    def _close(self, group: str, keys: list[tuple[int, int]]) -> tuple[str, Sendable]:
        parts = self._parts.pop(group)
        if sorted(parts) != keys:
            raise ValueError(f"{group}: members {sorted(parts)} arrived, expected {keys}")
        ordered = [parts[k] for k in keys]
        if self.lazy:
            names = member_names(group, keys)
            return group, FusedParts(group, list(zip(names, ordered, strict=True)))
        return group, _assemble(group, ordered)

    def close(self) -> list[tuple[str, Sendable]]:
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
    named: Iterable[tuple[str, torch.Tensor]], *, num_experts: int = 0, lazy: bool = False
) -> Iterator[tuple[str, Sendable]]:
    """An HF-named stream as SGLang's whole fused tensors, each as soon as it is complete
    (lazy: as `FusedParts`, the members uncopied; names SGLang does not fuse stay tensors)."""
    fuser = Fuser(num_experts, lazy=lazy)
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
    if len(fused) != 1 or fused[0][0] != name or not isinstance(fused[0][1], torch.Tensor):
        raise ValueError(f"{name}: rank {rank}'s parts fused into {[n for n, _ in fused]}")
    return name, fused[0][1]


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


class RankChecksums:
    """What the engines report of what ONE sender sent in SGLang's layout, when several
    senders each send some engine ranks' parameters (`weights.senders=owners`): per engine TP
    size and rank, `{sglang_name: checksum}` of each piece it sent that rank, hashed as the
    rank holds it (the piece's bytes back to back, SGLang's function on the engines' device:
    `wire.fused_checksum`), and the members' HF-named checksums (engines that report HF
    names). Feeds like `weight_shards.EngineChecksums` (`add_bucket`, `hf`, `per_rank`,
    `ranks`); a rank's dict covers only what this sender sent it (rank 0 takes the union)."""

    def __init__(
        self,
        model: EngineLayout,
        tp_sizes: Sequence[int],
        *,
        namings: frozenset[str] = frozenset({"hf", "sglang"}),
        device: str = "cpu",
    ) -> None:
        self.namings, self.device = namings, device
        self.plain = SGLangChecksums(fused=False, device="cpu")  # the embedded engine's
        sglang = "sglang" in namings
        self.layouts = {tp: engine_layout(model, tp) for tp in tp_sizes} if sglang else {}
        self._ranks: dict[int, list[dict[str, str]]] = {
            tp: [{} for _ in range(tp)] for tp in self.layouts
        }

    @property
    def hf(self) -> dict[str, str]:
        return self.plain.hf

    @property
    def per_rank(self) -> bool:
        return "sglang" in self.namings

    def add_bucket(self, named: Sequence[tuple[str, Sendable]]) -> None:
        """Account a bucket as sent (fused parameters as `FusedParts` or whole tensors)."""
        if "hf" in self.namings:
            members = [
                m
                for n, t in named
                for m in (t.members() if isinstance(t, FusedParts) else [(n, t)])
            ]
            for name, t in host_views(tensors_only(members)):
                self.plain.add(name, t)
        for tp, lay in self.layouts.items():
            for r in range(tp):
                for piece in rank_pieces(named, r, lay):
                    if is_slice_name(piece.name):  # the engine hashes whole parameters only
                        raise ValueError(
                            f"{piece.name}: an expert slice cannot be verified on its own "
                            "(verified pushes send whole parameters: weights.expert_slices)"
                        )
                    parts = [s.to(piece.dtype) for s in piece.sources]
                    self._ranks[tp][r][piece.name] = fused_checksum(parts, self.device)

    def ranks(self, tp_size: int) -> list[dict[str, str]]:
        """Per TP rank, `{sglang_name: checksum}` of what this sender sent that rank."""
        if tp_size not in self._ranks:
            raise KeyError(f"no checksums computed for engines of TP size {tp_size}")
        return [dict(r) for r in self._ranks[tp_size]]


__all__ = [
    "LAYOUTS",
    "FusedParts",
    "RankChecksums",
    "member_names",
    "RankCut",
    "RankPiece",
    "Sendable",
    "tensors_only",
    "rank_piece",
    "rank_pieces",
    "engine_layout",
    "Fuser",
    "fused_stream",
    "is_fused_name",
    "rank_tensor",
    "rank_tensors",
    "unfuse",
    "unfuse_all",
]
