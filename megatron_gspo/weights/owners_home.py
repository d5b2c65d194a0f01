"""Colocated pushes that never cross GPUs: each engine rank fed from its own GPU.

With `weights.senders=owners`, the tensor transport and SGLang's own layout, the per-parameter
senders of `weights.owners_fused` write every engine rank's part of a parameter into buffers
on THEIR OWN GPU: each engine process then opens CUDA-IPC handles onto up to 7 other GPUs of
the node (a CUDA context each, ~0.5 GiB) and copies across NVLink. Here, when the engines are
colocated, every engine rank has a home: the trainer rank whose device is the engine rank's
GPU (`--base-gpu-id` + TP rank as `engines.launch` starts them; the trainer's device index,
`LOCAL_RANK`). That trainer rank alone writes and sends that engine rank's part
(`weight_layout.RankCut`), in its own request to the engine with the other ranks' entries
empty (SGLang 0.5.23's TP rank reads only its own entry of `serialized_named_tensors`,
`TpModelWorker.deserialize_own_rank`, and `direct` with an empty list loads nothing):

* non-expert parameters reach every trainer rank already (the bridge's TP gathers and PP
  broadcasts): each home cuts its engine rank's part locally (`rank_piece`), no traffic;
* an engine rank's experts (its EP range, its expert-TP slice) come from the trainer ranks
  holding them, point to point, only that rank's slice: from the home itself when it holds
  them (trainer EP = engine EP: one TP-8 / EP-8 engine over a node of 8 EP ranks moves no
  byte between trainer ranks), else from the least loaded replica of the EP rank that does.

It applies when every engine rank of every node's engines has exactly one home on that node
and no trainer rank is home to two (`HomePath.plan` says why not, once in the log, and the
push takes the per-parameter senders). Every guarantee of the owners push holds unchanged:
rank 0 opens and closes the session and stamps the version after every sender's last bucket,
each sender hashes per engine rank what it sent (`RankChecksums`: a `RankCut` hashes on its
own rank only) and rank 0 compares the union, and engine faults are handled as before.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_gspo import dist
from megatron_gspo.engines.protocols import WeightReceiver
from megatron_gspo.engines.weight_layout import (
    FusedParts,
    Fuser,
    RankCut,
    Sendable,
    engine_layout,
    member_names,
    rank_piece,
)
from megatron_gspo.engines.weight_shards import EngineLayout, engine_shard
from megatron_gspo.weights.owners_fused import (
    ExpertRoute,
    _Loads,
    collect_expert,
    local_stream,
)
from megatron_gspo.weights.stream import StreamStats

if TYPE_CHECKING:
    from megatron.bridge import AutoBridge

    from megatron_gspo.weights.owners import SenderGrid

__all__ = ["EngineRank", "HomePath", "HomePlan", "Transfer", "expert_transfers", "home_fused"]

logger = logging.getLogger(__name__)


def device_index() -> int:
    """The GPU this process trains on: the job's CUDA device, else the slot it would take
    on a GPU node (`LOCAL_RANK`; else the rank within `LOCAL_WORLD_SIZE`)."""
    device = dist.device()
    if device.type == "cuda" and device.index is not None:
        return int(device.index)
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return rank % local if local else rank


def engines_of(receivers: Sequence[WeightReceiver]) -> list[tuple[int, tuple[int, ...] | None]]:
    """Each engine behind `receivers` (in order): (TP size, the GPU of each TP rank on its
    node, or None when unknown: `engine_gpu_ids` of the receiver)."""
    out: list[tuple[int, tuple[int, ...] | None]] = []
    for receiver in receivers:
        gpus = getattr(receiver, "engine_gpu_ids", None)
        for i, tp in enumerate(receiver.engine_tp_sizes()):
            out.append((tp, tuple(gpus[i]) if gpus is not None else None))
    return out


Reported = tuple[int, list[tuple[int, tuple[int, ...] | None]], bool]
"""What each rank reports once: its GPU, its send engines' (TP size, GPU of each TP rank), and
whether its receivers can address one engine alone."""


@dataclass(frozen=True, slots=True)
class EngineRank:
    """One TP rank of one engine of a node, and its home trainer rank."""

    engine: int
    """Index among the node's engines (the senders' `send_engines`, in order)."""
    tp_size: int
    rank: int
    home: int
    """Global trainer rank whose device is this engine rank's GPU."""


@dataclass(frozen=True, slots=True)
class HomePlan:
    """Who feeds which engine rank, on every node (the same on every rank)."""

    homes: tuple[tuple[EngineRank, ...], ...]
    """Per node (scope order of `SenderGrid.nodes`), its engine ranks in engine, rank order."""
    mine: EngineRank | None
    """The engine rank this trainer rank feeds (None: it only passes experts on)."""
    receivers: tuple[WeightReceiver, ...]
    """This rank's receiver of its engine rank's engine (empty when `mine` is None)."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """One engine rank's experts of one trainer EP rank (all of one stacked parameter)."""

    home: EngineRank
    trainer_ep: int
    source: int
    """Global rank that holds them and sends them (== home.home: no traffic)."""
    experts: tuple[int, ...]
    """Global expert indices, ascending."""


def _plan(
    grid: SenderGrid,
    gathered: list[Reported],
) -> tuple[tuple[tuple[EngineRank, ...], ...], str]:
    """Every node's engine ranks with their homes, or () and why not. `gathered`: per global
    rank, (its GPU, its send engines' (TP size, GPU per TP rank), whether its receivers can
    address one engine alone)."""
    if not grid.per_node:
        return (), "not the tensor transport (engines are fed over CUDA IPC only there)"
    if not all(alone for *_, alone in gathered):
        return (), "a client cannot address one of its engines alone"
    out = []
    for node in sorted(set(grid.nodes)):
        ranks = [r for r, n in enumerate(grid.nodes) if n == node]
        engines = gathered[ranks[0]][1]
        if any(gathered[r][1] != engines for r in ranks):
            return (), f"the ranks of node {node} push to different engines"
        by_gpu: dict[int, int] = {}
        for r in ranks:
            if gathered[r][0] in by_gpu:
                return (), f"ranks {by_gpu[gathered[r][0]]} and {r} train on one GPU"
            by_gpu[gathered[r][0]] = r
        homes: list[EngineRank] = []
        for i, (tp, gpus) in enumerate(engines):
            if gpus is None:
                return (), f"node {node}'s engine {i} does not say which GPUs it runs on"
            for rank, gpu in enumerate(gpus):
                if gpu not in by_gpu:
                    return (), (
                        f"node {node}'s engine {i} TP rank {rank} is on GPU {gpu}, where no "
                        "trainer rank runs (engines not colocated)"
                    )
                homes.append(EngineRank(i, tp, rank, by_gpu[gpu]))
        fed = [h.home for h in homes]
        if len(set(fed)) != len(fed):
            return (), f"a trainer rank of node {node} shares its GPU with two engine ranks"
        out.append(tuple(homes))
    return tuple(out), ""


class HomePath:
    """Decides, per push, whether the home path applies (collective on the first call), and
    keeps this rank's one-engine receiver; says once in the log which path pushes take."""

    def __init__(self) -> None:
        self._gathered: list[Reported] | None = None
        self._told: str | None = None
        self._receivers: dict[tuple[int, int], WeightReceiver] = {}

    def plan(
        self,
        grid: SenderGrid,
        route: ExpertRoute | None,
        send_engines: Sequence[WeightReceiver],
        *,
        log: bool,
    ) -> HomePlan | None:
        """The plan, or None (the per-parameter senders of `owners_fused`, or HF names when
        `route` is None). Collective the first time (every rank calls `push`)."""
        if self._gathered is None:
            # Whether each receiver can address one of its engines alone (decided from what
            # every rank reports, so that all ranks take the same path).
            alone = all(
                len(r.engine_tp_sizes()) == 1 or hasattr(r, "one_engine") for r in send_engines
            )
            mine = (device_index(), engines_of(send_engines), alone)
            every: list[Reported] = [mine]
            if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                every = [mine] * torch.distributed.get_world_size()  # placeholders
                torch.distributed.all_gather_object(every, mine)
            self._gathered = every
        if route is None:
            return None
        homes, why = _plan(grid, self._gathered)
        plan = None
        if homes:
            me = grid.rank
            node = sorted(set(grid.nodes)).index(grid.nodes[me])
            mine_er = next((h for h in homes[node] if h.home == me), None)
            one = [] if mine_er is None else [self._receiver(send_engines, mine_er)]
            plan = HomePlan(homes, mine_er, tuple(r for r in one if r is not None))
        said = (
            "each engine rank fed by the trainer rank on its GPU (no IPC handle crosses GPUs)"
            if plan is not None
            else f"per-parameter senders, engine ranks read other GPUs' buffers: {why}"
        )
        if log and said != self._told:
            self._told = said
            logger.warning("weights.senders=owners in SGLang's layout: %s", said)
        return plan

    def _receiver(
        self, send_engines: Sequence[WeightReceiver], er: EngineRank
    ) -> WeightReceiver | None:
        """The receiver of engine `er.engine` alone (engines of one client: `one_engine`)."""
        i = er.engine
        for receiver in send_engines:
            count = len(receiver.engine_tp_sizes())
            if i >= count:
                i -= count
                continue
            if count == 1:
                return receiver
            key = (id(receiver), i)
            if key not in self._receivers:
                one = getattr(receiver, "one_engine", None)
                if one is None:
                    return None
                self._receivers[key] = one(i)
            return self._receivers[key]
        return None


def expert_transfers(
    homes: Sequence[EngineRank],
    ep_ranks: Sequence[int],
    scope: Sequence[int],
    model: EngineLayout,
    trainer_ep: int,
    loads: _Loads,
    expert_bytes: int,
) -> list[Transfer]:
    """For one stacked expert parameter, in a fixed order (the same on every rank): which
    trainer rank sends each engine rank's experts of each trainer EP rank. `expert_bytes`:
    one expert's bytes of the parameter (whole, before the engine's expert-TP split); the
    chosen sources' loads grow by what they send."""
    n = model.num_experts
    per_t = n // trainer_ep
    out = []
    for h in homes:
        lay = engine_layout(model, h.tp_size)
        ep_e, per_e = h.rank // lay.moe_tp, n // lay.ep_size
        wanted = range(ep_e * per_e, (ep_e + 1) * per_e)
        for q in range(wanted[0] // per_t, (wanted[-1]) // per_t + 1):
            experts = tuple(e for e in wanted if e // per_t == q)
            if ep_ranks[h.home] == q:
                source = h.home
            else:
                source = loads.pick([r for r in scope if ep_ranks[r] == q])
                loads.add(source, len(experts) * expert_bytes // lay.moe_tp)
            out.append(Transfer(h, q, source, experts))
    return out


def _shards(
    group: str,
    experts: Sequence[int],
    tensors: dict[tuple[int, int], torch.Tensor],
    h: EngineRank,
    lay: EngineLayout,
) -> list[tuple[str, str, torch.Tensor]]:
    """(HF name, engine-local name, the engine rank's slice) of each member of `experts`, in
    SGLang's stacking order (w13: gate, up per expert)."""
    per = 1 if group.endswith(".w2_weight") else 2
    out = []
    for e in experts:
        for i in range(per):
            hf = member_names(group, [(e, i)])[0]
            cut = engine_shard(hf, tensors[(e, i)], h.rank, lay)
            assert cut is not None, f"{hf}: not on engine rank {h.rank}"
            out.append((hf, cut[0], cut[1]))
    return out


def _exchange(
    group: str,
    mine: dict[tuple[int, int], torch.Tensor],
    grid: SenderGrid,
    plan: HomePlan,
    model: EngineLayout,
    route: ExpertRoute,
    loads: _Loads,
) -> RankCut | None:
    """Run this rank's part of one stacked parameter's transfers (blocking point to point in
    the order every rank computes alike: the earliest unfinished transfer always has both
    ends at it, so none waits forever); returns this rank's engine rank's cut when it is a
    home."""
    node = sorted(set(grid.nodes)).index(grid.nodes[grid.rank])
    sample = next(iter(mine.values()))
    per = 1 if group.endswith(".w2_weight") else 2
    expert_bytes = per * sample.numel() * sample.element_size()
    moves = expert_transfers(
        plan.homes[node], grid.ep_ranks, grid.scope(), model, route.trainer_ep, loads,
        expert_bytes,
    )  # fmt: skip
    me = grid.rank
    got: list[tuple[str, str, torch.Tensor]] = []
    for move in moves:
        h = move.home
        if me not in (h.home, move.source):
            continue
        lay = engine_layout(model, h.tp_size)
        if move.source == me and h.home == me:
            got += _shards(group, move.experts, mine, h, lay)
        elif move.source == me:
            flat = torch.cat(
                [t.reshape(-1) for *_, t in _shards(group, move.experts, mine, h, lay)]
            )
            torch.distributed.send(flat, dst=h.home)
        else:  # this rank is the home: shapes from its own experts (every expert alike)
            meta = torch.empty(sample.shape, dtype=sample.dtype, device="meta")
            fake = {(e, i): meta for e in move.experts for i in range(per)}
            shapes = _shards(group, move.experts, fake, h, lay)
            total = sum(t.numel() for *_, t in shapes)
            flat = torch.empty(total, dtype=sample.dtype, device=sample.device)
            torch.distributed.recv(flat, src=move.source)
            pos = 0
            for hf, local, t in shapes:
                got.append((hf, local, flat[pos : pos + t.numel()].view(t.shape)))
                pos += t.numel()
    if plan.mine is None or not got:
        return None
    h = plan.mine
    # HF-named hashes only where the cut is the whole expert (a one-rank engine: the only kind
    # that reports HF names); a slice under the expert's HF name would clash in rank 0's union.
    whole = h.tp_size == 1
    return RankCut(
        group,
        [(local, t) for _, local, t in got],
        rank=h.rank,
        tp_size=h.tp_size,
        hf=[(hf, t) for hf, _, t in got] if whole else [],
    )


def _cut(name: str, item: Sendable, h: EngineRank, model: EngineLayout) -> RankCut | None:
    """The home's engine rank's part of a parameter every trainer rank holds (no traffic)."""
    piece = rank_piece(name, item, h.rank, engine_layout(model, h.tp_size))
    if piece is None:
        return None
    hf = item.parts if isinstance(item, FusedParts) else [(name, item)]
    parts = [(f"{name}#{j}", s) for j, s in enumerate(piece.sources)]
    return RankCut(name, parts, rank=h.rank, tp_size=h.tp_size, hf=hf, dtype=piece.dtype)


def home_fused(
    bridge: AutoBridge,
    model: list[torch.nn.Module],
    grid: SenderGrid,
    route: ExpertRoute,
    plan: HomePlan,
    layout: EngineLayout,
    *,
    cpu: bool,
    stats: StreamStats,
    grouped: bool = False,
) -> Iterator[tuple[str, Sendable]]:
    """This rank's engine rank's parts (`RankCut`), SGLang-named (collective: every rank
    exhausts it; the expert transfers run inside). Counts every exported HF tensor in
    `stats.tensors_seen` (iterate the result with `count_seen=False`). grouped: the local
    experts straight from the Megatron parameters where `weights.grouped` allows."""
    fuser = Fuser(lazy=True)
    loads = _Loads(grid.scope())
    n_local = route.num_experts // route.trainer_ep if route.num_experts else 0
    parts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}

    def out(cut: RankCut | None) -> Iterator[tuple[str, Sendable]]:
        if cut is not None:
            yield cut.name, cut.to_host() if cpu else cut

    for name, t, expert in local_stream(bridge, model, grouped=grouped, stats=stats):
        if not expert:
            for fused, item in fuser.add(name, t):
                if plan.mine is not None:
                    yield from out(_cut(fused, item, plan.mine, layout))
            continue
        group = collect_expert(parts, name, t, n_local)
        if group is not None:
            cut = _exchange(group, parts.pop(group), grid, plan, layout, route, loads)
            yield from out(cut)
    if parts:
        raise ValueError(f"expert parameters left incomplete: {sorted(parts)[:3]}")
    for fused, item in fuser.close():
        if plan.mine is not None:
            yield from out(_cut(fused, item, plan.mine, layout))
