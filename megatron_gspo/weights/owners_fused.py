"""`weights.senders=owners` in SGLang's own layout: every rank sends its shard as the engine
ranks' fused parameters (`load_format="direct"`, `engines/weight_layout.py`).

SGLang's `direct` loader copies whole parameters only, so an engine rank's stacked
`w13_weight` / `w2_weight` (all of that rank's experts of one layer) must leave from ONE
sender. With trainer EP size T and engine EP size E (experts split into E contiguous ranges,
as each engine rank's loaders keep them):

* E a multiple of T (T = E included: e.g. one TP-8 / EP-8 engine over a node of 8 trainer EP
  ranks, each engine rank's experts on the trainer rank of its GPU): a trainer EP rank's
  local experts are whole engine EP ranges, so it builds those engine ranks' `w13_weight` /
  `w2_weight` from its own experts, no communication;
* T a multiple of E, k = T / E: an engine range is held by k trainer EP ranks (E = 1, a
  TP-only or one-rank engine, as the 30B recipe's TP-2 engines: all of them); per layer and
  parameter they send their experts
  to one of them (point to point, one message per peer, the receiver chosen per parameter
  as below), which builds it: the only communication of the push;
* otherwise (neither divides) this path does not apply and `WeightSync` sends HF names.

Who sends what is decided per parameter, for the least loaded rank of the send scope so far
(bytes sent, received and passed on; ties to the lower rank): among the expert-data-parallel
replicas of the EP ranks holding it (DP, expert-TP, PP stages: every rank of the send scope
with that EP rank) for an expert parameter, among all ranks of the scope for the tensors every
rank sees (attention, norms, embeddings, the router: fused on every rank, members kept, no
copy: `FusedParts`). Every rank sees the bridge's stream in the same order and the same sizes,
so every rank takes the same decisions without communication.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_gspo.engines.weight_layout import (
    FusedParts,
    Fuser,
    Sendable,
    engine_layout,
    member_names,
)
from megatron_gspo.engines.weight_names import sglang_slot
from megatron_gspo.engines.weight_shards import EngineLayout
from megatron_gspo.weights.stream import StreamStats

if TYPE_CHECKING:
    from megatron.bridge import AutoBridge

    from megatron_gspo.weights.owners import SenderGrid

__all__ = [
    "ExpertRoute",
    "collect_expert",
    "engine_eps",
    "expert_route",
    "local_stream",
    "owned_fused",
    "route_for",
]


@dataclass(frozen=True, slots=True)
class ExpertRoute:
    """How one engine EP range's experts reach one sender."""

    trainer_ep: int
    """Trainer EP size (T)."""
    engine_ep: int
    """Engine EP size (E) of every engine the senders feed."""
    num_experts: int
    """Routed experts per MoE layer (0: a dense model)."""
    slices: bool = False
    """Each holder sends its own experts as a slice of the engine rank's parameter (the
    engines load slices: `engines.sglang_loader`), instead of to one of them first."""

    @property
    def peers(self) -> int:
        """Trainer EP ranks that together hold one engine EP range (k; 1 when E >= T)."""
        return self.trainer_ep // self.engine_ep if self.trainer_ep > self.engine_ep else 1


def expert_route(
    grid: SenderGrid, engine_eps: set[int], num_experts: int
) -> tuple[ExpertRoute | None, str]:
    """The route for this grid, or None and why not (the same answer on every rank)."""
    if len(engine_eps) != 1:
        return None, f"the engines differ in expert-parallel size ({sorted(engine_eps)})"
    (e,) = engine_eps
    t = max(grid.ep_ranks) + 1
    if num_experts and (t % e and e % t or num_experts % max(t, e)):
        return None, (
            f"trainer EP {t} and engine EP {e} do not nest (neither divides the other, or "
            f"{num_experts} experts do not split in {max(t, e)})"
        )
    scopes = {tuple(grid.scope_of(r)) for r in range(len(grid.ep_ranks))}
    for scope in scopes:
        counts = {sum(grid.ep_ranks[r] == ep for r in scope) for ep in range(t)}
        if len(counts) != 1:
            return None, "the expert-parallel ranks of a send scope differ in replica count"
    return ExpertRoute(t, e, num_experts), ""


def engine_eps(model: EngineLayout | None, tp_sizes: list[int]) -> frozenset[int]:
    """The expert-parallel sizes of engines of `tp_sizes` in SGLang's layout (none without
    the model's shape)."""
    if model is None:
        return frozenset()
    return frozenset(engine_layout(model, tp).ep_size for tp in tp_sizes)


def route_for(
    layout: str, model: EngineLayout | None, grid: SenderGrid
) -> tuple[ExpertRoute | None, str]:
    """`expert_route` when the push is in SGLang's layout (`layout` "engine", the model's shape
    known), over every rank's engines; (None, "") for HF-named pushes."""
    if layout != "engine" or model is None:
        return None, ""
    eps: set[int] = set().union(*grid.engine_eps)
    return expert_route(grid, eps, model.num_experts)


class _Loads:
    """Bytes each rank of the send scope has been given so far (sent to engines, received
    from peers, sent to peers): the same on every rank of the scope, since all see the same
    stream, so each decision (who sends the next parameter: the least loaded, ties to the
    lower rank) needs no communication and the busiest rank stays near model/n."""

    def __init__(self, scope: list[int]) -> None:
        self.by_rank = dict.fromkeys(scope, 0)

    def pick(self, candidates: list[int]) -> int:
        return min(candidates, key=lambda r: (self.by_rank[r], r))

    def add(self, rank: int, nbytes: int) -> None:
        self.by_rank[rank] += nbytes


def collect_expert(
    parts: dict[str, dict[tuple[int, int], torch.Tensor]],
    name: str,
    t: torch.Tensor,
    n_local: int,
) -> str | None:
    """File local expert tensor `name` under its SGLang stacked parameter in `parts`; the
    parameter's name once all `n_local` experts of it (gate and up for `w13_weight`) are in."""
    slot = sglang_slot(name)
    if slot is None:  # an expert tensor SGLang does not stack
        raise ValueError(f"{name}: a local expert tensor outside w13_weight / w2_weight")
    group, key = slot
    held = parts.setdefault(group, {})
    if key in held:
        raise ValueError(f"{name}: exported twice into {group}")
    held[key] = t
    if not n_local:
        raise ValueError(f"{name}: an expert of a model whose expert count is unknown")
    per = 1 if group.endswith(".w2_weight") else 2
    return group if len(held) == n_local * per else None


def local_stream(
    bridge: AutoBridge, model: list[torch.nn.Module], *, grouped: bool, stats: StreamStats
) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """Every HF tensor this rank exports with the bridge's EP step off (`ep_local_experts`:
    each EP rank its own experts), detached, and whether it is one of this rank's local
    experts (collective: every rank exhausts it). Counts each in `stats.tensors_seen`.
    grouped: the local experts straight from the Megatron parameters (`weights.grouped`)."""
    from megatron_gspo.patches.bridge import ep_local_experts
    from megatron_gspo.patches.cpu_runtime import without_cuda_mode
    from megatron_gspo.weights.grouped import local_export

    with ep_local_experts() as local:
        exported = local_export(bridge, model, local, grouped=grouped, stats=stats)
        for name, tensor in without_cuda_mode(exported):
            stats.tensors_seen += 1
            yield name, tensor.detach(), local.pop(name, None) is not None


class _Experts:
    """This rank's local experts, grouped per engine fused parameter (collective: the
    gathers); `add` returns a fused parameter this rank sends once it is complete."""

    def __init__(
        self, grid: SenderGrid, route: ExpertRoute, loads: _Loads, dtype: torch.dtype | None = None
    ) -> None:
        self.grid, self.route, self.loads, self.dtype = grid, route, loads, dtype
        self.me = grid.ep_ranks[grid.rank]
        self.n_local = route.num_experts // route.trainer_ep if route.num_experts else 0
        scope = grid.scope()
        self.holders = {
            ep: [r for r in scope if grid.ep_ranks[r] == ep] for ep in range(route.trainer_ep)
        }
        self.parts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}

    def add(self, name: str, t: torch.Tensor) -> tuple[str, FusedParts] | None:
        group = collect_expert(self.parts, name, t, self.n_local)
        return None if group is None else self._close(group)

    def _assign(self, share: int) -> tuple[int, list[int]]:
        """(receiver, peers in EP order) of this rank's unit, deciding every unit's in turn
        (every rank of the scope takes the same decisions). `share`: one EP rank's bytes of
        the parameter (every EP rank's are the same size)."""
        k = self.route.peers
        mine: tuple[int, list[int]] | None = None
        for first in range(0, self.route.trainer_ep, k):
            units = [self.holders[first + j] for j in range(k)]
            receiver = self.loads.pick([r for held in units for r in held])
            replica = self.holders[self.grid.ep_ranks[receiver]].index(receiver)
            peers = [held[replica] for held in units]
            for p in peers:  # each sends its share (to the receiver, or to the engines)
                self.loads.add(p, share)
            self.loads.add(receiver, 2 * (k - 1) * share)  # receives them, sends them on
            if first <= self.me < first + k:
                mine = (receiver, peers)
        assert mine is not None
        return mine

    def _assign_slices(self, share: int) -> int:
        """Who sends this rank's experts of the parameter as a slice: the least loaded replica
        of its EP rank, deciding every EP rank's in turn (the same on every rank)."""
        mine = -1
        for ep in range(self.route.trainer_ep):
            sender = self.loads.pick(self.holders[ep])
            self.loads.add(sender, share)
            if ep == self.me:
                mine = sender
        return mine

    def _close(self, group: str) -> tuple[str, FusedParts] | None:
        parts = self.parts.pop(group)
        keys = sorted(parts)
        mine = [parts[k] for k in keys]
        share = sum(m.numel() * m.element_size() for m in mine)
        if self.route.slices and self.route.peers > 1:
            if self._assign_slices(share) != self.grid.rank:
                return None  # another replica sends this one
            # A slice of the engine rank's parameter (`rank_piece` names it by its experts).
            named = list(zip(member_names(group, keys), mine, strict=True))
            return group, FusedParts(group, named)
        receiver, peers = self._assign(share)
        if self.grid.rank not in peers:
            return None  # another replica sends this one
        if self.dtype is not None and self.route.peers > 1:
            mine = [m.to(self.dtype) for m in mine]  # the gather moves what the engine takes
        if self.grid.rank != receiver:
            # One message per peer: this rank's experts of the parameter back to back. A
            # blocking send cannot deadlock: the receiver posts its recv at this same place of
            # the same stream, before any later collective.
            flat = torch.cat([m.reshape(-1) for m in mine])
            torch.distributed.send(flat, dst=receiver)
            return None
        first = self.me - self.me % len(peers)
        members: list[tuple[str, torch.Tensor]] = []
        for j, peer in enumerate(peers):
            if peer == self.grid.rank:
                members += zip(member_names(group, keys), mine, strict=True)
                continue
            flat = torch.empty(
                sum(m.numel() for m in mine), dtype=mine[0].dtype, device=mine[0].device
            )
            torch.distributed.recv(flat, src=peer)
            shift = (first + j - self.me) * self.n_local
            theirs = [(e + shift, i) for e, i in keys]
            views, pos = [], 0
            for m in mine:  # every expert of a parameter has the same shape
                views.append(flat[pos : pos + m.numel()].view(m.shape))
                pos += m.numel()
            members += zip(member_names(group, theirs), views, strict=True)
        # Peers in EP-rank order hold ascending expert ranges: SGLang's stacking order.
        return group, FusedParts(group, members)


def _host(item: Sendable) -> Sendable:
    if isinstance(item, FusedParts):
        return FusedParts(item.name, [(n, t.cpu()) for n, t in item.parts], item.dtype)
    return item.cpu()


def owned_fused(
    bridge: AutoBridge,
    model: list[torch.nn.Module],
    grid: SenderGrid,
    route: ExpertRoute,
    *,
    cpu: bool,
    stats: StreamStats,
    grouped: bool = False,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, Sendable]]:
    """The fused parameters (and unfused tensors) this rank sends, SGLang-named, as members
    (collective: every rank exhausts it). Counts every HF tensor exported to this rank in
    `stats.tensors_seen` (iterate the result with `count_seen=False`). grouped: the local
    experts straight from the Megatron parameters where `weights.grouped` allows, not from the
    bridge's walk. dtype: what the engines take (the experts gathered to one holder are cast
    before they move; None: as exported)."""
    replicated = grid.replicated_senders()
    fuser = Fuser(lazy=True)  # the replicated stream: no expert enters it
    loads = _Loads(grid.scope())
    experts = _Experts(grid, route, loads, dtype)

    def mine(items: list[tuple[str, Sendable]]) -> Iterator[tuple[str, Sendable]]:
        for name, item in items:
            owner = loads.pick(replicated)
            loads.add(owner, item.numel() * item.element_size())
            if owner == grid.rank:
                yield name, _host(item) if cpu else item

    for name, t, expert in local_stream(bridge, model, grouped=grouped, stats=stats):
        if not expert:
            yield from mine(fuser.add(name, t))
            continue
        done = experts.add(name, t)  # the gathers run on the tensors' device
        if done is not None:
            yield done[0], _host(done[1]) if cpu else done[1]
    if experts.parts:
        raise ValueError(f"expert parameters left incomplete: {sorted(experts.parts)[:3]}")
    yield from mine(fuser.close())
