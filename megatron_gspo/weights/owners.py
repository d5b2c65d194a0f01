"""Every rank that holds a shard sends it (`weights.senders=owners`).

Today's push (`senders=one`) funnels every byte through trainer rank 0: experts are gathered
to it, then it sends them. Here no weight is gathered for the push at all:

* the export runs inside `patches.bridge.ep_local_experts()`, where the bridge does no EP
  collective and each EP rank yields only its own experts; everything else (attention, dense
  MLP, norms, embeddings, the router) reaches every rank as before (the bridge's TP gathers and
  PP broadcasts, unchanged);
* each exported tensor is kept by exactly ONE rank of its send scope and sent by it: a
  replicated tensor (every rank of the scope sees it) by the scope's ranks in turn (the k-th
  such tensor by candidate k mod n), a local expert by the ranks of the scope that hold that
  expert slot (the same EP rank: expert-data-parallel replicas, expert-TP ranks, PP stages)
  in turn. Every rank sees both streams in the same order (the bridge's task order), so the
  rule needs no communication during the export;
* the send scope is the node for the `tensor` transport (CUDA IPC reaches only engines on the
  node that made the handle: each node's ranks send the whole model to that node's engines,
  once per node) and the job for `distributed` (one copy in all: each sender has its own
  weight-update group to every engine).

Busiest rank: about (its experts + its share of the replicated tensors), i.e. ~1/n of the
model for n senders instead of rank 0 receiving and sending all of it (measured:
tests/weights/test_owners.py; docs/performance.md "Every rank sends its shard").

With `weights.layout=engine` (auto's choice for `tensor` without FP8) the senders send SGLang's
own fused parameters instead of HF names (`weights.owners_fused`: each engine rank's stacked
experts built by the trainer rank(s) holding them, gathered point to point only where an
engine rank's experts are spread over several trainer EP ranks; `load_format="direct"`).
Where that layout cannot be served (trainer and engine EP sizes that do not nest, engines of
different EP sizes, replica counts that differ) the push sends HF names, said once in the log.
Colocated (every engine rank of a node on a GPU a trainer rank of that node trains on, as
the engines the job launches are), no sender writes another GPU's engine rank's part: each
engine rank is fed only by the trainer rank on its GPU (`weights.owners_home`: non-expert
parameters cut locally, that engine rank's experts received point to point from the ranks
holding them, one request per sender with the other ranks' entries empty), so no engine
process opens a CUDA-IPC handle onto another GPU; elsewhere (disaggregated engines, engines
on GPUs no trainer rank uses, engines whose GPUs are unknown) the per-parameter senders of
`weights.owners_fused`; which of the two, said once in the log.

Rank 0 still coordinates the session (`begin_weight_update`, `end_weight_update`, the version
stamp after every sender's last bucket, verification, `commit_sync`): the senders only add
buckets inside the open session. Each sender hashes what it sent with SGLang's own function
in the engines' naming (SGLang's layout: per engine rank, the fused parameters it sent that
rank, `weight_layout.RankChecksums`; HF names: per HF tensor) and rank 0 compares the union
with the engines, so verification costs each rank about one shard's hash. One exception
remains, for HF-named pushes only: engines that report SGLang's fused per-rank names (a real
server) need all members of a fused parameter in one place, which no HF-named sender has, so
`WeightSync` sends those verified pushes (and the first push, before the naming is known)
through one sender per scope: the scope's first rank, experts gathered to it as with
`senders=one`, which hashes in both namings.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatron_gspo import dist
from megatron_gspo.engines.protocols import WeightReceiver
from megatron_gspo.engines.weight_layout import RankChecksums
from megatron_gspo.engines.weight_shards import EngineChecksums, EngineLayout
from megatron_gspo.weights.config import WeightSyncConfig
from megatron_gspo.weights.stream import StreamStats
from megatron_gspo.weights.transports import DistributedTransport, TensorTransport, Transport

if TYPE_CHECKING:
    from megatron.bridge import AutoBridge


def node_index() -> int:
    """This process's node: torchrun's GROUP_RANK (NODE_RANK), else its rank over
    LOCAL_WORLD_SIZE, else 0."""
    for key in ("GROUP_RANK", "NODE_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local and torch.distributed.is_initialized():
        return torch.distributed.get_rank() // local
    return 0


def expert_rank() -> int:
    """This rank's expert-parallel rank (0 without megatron-core's parallel state)."""
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return int(parallel_state.get_expert_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError):
        pass
    return 0


@dataclass(frozen=True, slots=True)
class SenderGrid:
    """Who sends what: every rank's (node, EP rank), gathered once per push."""

    rank: int
    nodes: tuple[int, ...]
    """Node of every global rank."""
    ep_ranks: tuple[int, ...]
    """Expert-parallel rank of every global rank."""
    per_node: bool
    """Send scope: True, each node's ranks send the whole model (to that node's engines);
    False, the job's ranks send it once."""
    sending: tuple[bool, ...] = ()
    """Whether each global rank has engines to send to."""
    engine_eps: tuple[frozenset[int], ...] = ()
    """The expert-parallel sizes of each global rank's engines (SGLang's layout)."""
    slices: tuple[bool, ...] = ()
    """Whether each global rank's engines load expert slices (`takes_expert_slices`)."""

    @classmethod
    def gather(
        cls,
        *,
        per_node: bool,
        sending: bool = True,
        engine_eps: frozenset[int] = frozenset(),
        slices: bool = False,
    ) -> SenderGrid:
        """Collective: every rank calls it (one small all_gather_object)."""
        mine = (node_index(), expert_rank(), sending, engine_eps, slices)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            every: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every, mine)
            rank = torch.distributed.get_rank()
        else:
            every, rank = [mine], 0
        return cls(
            rank=rank,
            nodes=tuple(one[0] for one in every),
            ep_ranks=tuple(one[1] for one in every),
            per_node=per_node,
            sending=tuple(bool(one[2]) for one in every),
            engine_eps=tuple(frozenset(one[3]) for one in every),
            slices=tuple(bool(one[4]) for one in every),
        )

    def all_take_slices(self) -> bool:
        """Whether every sending rank's engines load expert slices (the same on every rank)."""
        if len(self.slices) != len(self.sending):
            return False
        return all(t for t, s in zip(self.slices, self.sending, strict=True) if s)

    def scope(self) -> list[int]:
        """Global ranks that share this rank's send scope, in rank order."""
        return self.scope_of(self.rank)

    def scope_of(self, rank: int) -> list[int]:
        """Global ranks that share `rank`'s send scope, in rank order."""
        me = self.nodes[rank]
        return [r for r, n in enumerate(self.nodes) if n == me or not self.per_node]

    def replicated_senders(self) -> list[int]:
        """Who sends, in turn, the tensors every rank sees."""
        return self.scope()

    def expert_senders(self) -> list[int]:
        """Who sends, in turn, this rank's local experts (same EP rank, same scope)."""
        mine = self.ep_ranks[self.rank]
        return [r for r in self.scope() if self.ep_ranks[r] == mine]

    def missing_expert_ranks(self, ep_size: int) -> list[int]:
        """EP ranks with no rank in this rank's scope (their experts would never be sent)."""
        held = {self.ep_ranks[r] for r in self.scope()}
        return [e for e in range(ep_size) if e not in held]


def owned_tensors(
    bridge: AutoBridge,
    model: list[torch.nn.Module],
    grid: SenderGrid,
    *,
    cpu: bool,
    stats: StreamStats,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF-named tensors this rank sends (collective: every rank exhausts it). The ones it
    drops are counted in `stats.tensors_seen` (`iter_buckets` counts the ones it keeps)."""
    from megatron_gspo.patches.bridge import ep_local_experts
    from megatron_gspo.patches.cpu_runtime import without_cuda_mode

    replicated, experts = grid.replicated_senders(), grid.expert_senders()
    k_rep = k_exp = 0
    with ep_local_experts() as local:
        exported = bridge.export_hf_weights(model, cpu=False, show_progress=False)
        for name, tensor in without_cuda_mode(exported):
            if local.pop(name, None) is None:
                keep = replicated[k_rep % len(replicated)] == grid.rank
                k_rep += 1
            else:
                keep = experts[k_exp % len(experts)] == grid.rank
                k_exp += 1
            if keep:  # iter_buckets counts it as seen
                t = tensor.detach()
                yield name, t.cpu() if cpu else t
            else:
                stats.tensors_seen += 1


def prepare(
    engines: Sequence[WeightReceiver],
    send_engines: Sequence[WeightReceiver],
    coordinator: bool,
    transport: str,
    namings: frozenset[str] | None,
) -> tuple[bool, BaseException | None, frozenset[str] | None]:
    """Rank 0 asks the engines who re-joins (`prepare_sync`; not for `distributed`, whose
    groups have fixed members); every rank learns whether one did and what the engines'
    checksums are named in (rank 0 learnt it verifying), so all take the same path, and which
    engines rank 0 has dropped, so no sender writes to them (collective)."""
    joining, error = False, None
    if coordinator and transport != "distributed":
        try:
            joining = bool([j for engine in engines for j in engine.prepare_sync()])
        except BaseException as e:  # noqa: BLE001 - reported on every rank by the caller
            error = e
    joining, dead, namings = dist.broadcast(
        (joining, dropped(engines) if coordinator else {}, namings)
    )
    if not coordinator:
        for engine in send_engines:  # rank 0's pool decides who is in or out of this push
            pool = getattr(engine, "pool", None)
            if pool is not None:
                pool.dead = {u: why for u, why in dead.items() if u in pool.urls}
                pool.joining.clear()
    return bool(joining), error, namings


def dropped(engines: Sequence[WeightReceiver]) -> dict[str, str]:
    """{url: reason} of the engines the clients' pools have dropped (`engines.pool`)."""
    out: dict[str, str] = {}
    for engine in engines:
        pool = getattr(engine, "pool", None)
        out.update(getattr(pool, "dead", {}) or {})
    return out


def adopt_dropped(engines: Sequence[WeightReceiver], dead: dict[str, str]) -> None:
    """Rank 0 drops what a sender's client dropped during the push (fault handling as with
    one sender: the engine leaves the job's pool, and is restarted if the job launched it)."""
    for engine in engines:
        pool = getattr(engine, "pool", None)
        for url, why in dead.items():
            if pool is not None and url in pool.urls and url not in pool.dead:
                pool.drop(url, f"while a sender pushed weights: {why}")


def grid_problem(grid: SenderGrid) -> str | None:
    """Why this grid cannot send the whole model to each scope's engines (the same answer on
    every rank), or None."""
    ep = max(grid.ep_ranks) + 1
    for rank, has in enumerate(grid.sending):
        peers = [r for r, n in enumerate(grid.nodes) if n == grid.nodes[rank] or not grid.per_node]
        if not has and any(grid.sending[r] for r in peers):
            return (
                f"weights.senders=owners: rank {rank} has no engine to send its shard to while "
                f"ranks {[r for r in peers if grid.sending[r]]} do; every rank needs a client "
                "of its node's engines (WeightSync's send_engines)"
            )
    for node in sorted(set(grid.nodes)) if grid.per_node else []:
        first = grid.nodes.index(node)
        if grid.ep_ranks[first] != 0:  # it receives its EP group's experts when one sends
            return (
                f"weights.senders=owners with weights.transport=tensor: node {node}'s first "
                f"rank {first} is expert-parallel rank {grid.ep_ranks[first]}, not 0; keep "
                "expert-parallel groups within a node (parallel.ep x parallel.etp divides the "
                "GPUs per node), or set weights.senders=one"
            )
        held = {e for n, e in zip(grid.nodes, grid.ep_ranks, strict=True) if n == node}
        if len(held) < ep:
            return (
                f"weights.senders=owners with weights.transport=tensor: node {node} holds "
                f"expert-parallel ranks {sorted(held)} of {ep}, so its engines would miss the "
                "other ranks' experts; keep parallel.ep x parallel.etp within one node, or set "
                "weights.senders=one"
            )
    return None


def sender_transport(
    cfg: WeightSyncConfig,
    engines: Sequence[WeightReceiver],
    layout: EngineLayout | None = None,
) -> Transport:
    """This rank's transport as one of several senders: it adds buckets to a session rank 0
    opened and never stamps a version; `distributed`: a weight-update group of its own per
    engine pool (named after the rank, at its own address). layout: `tensor` in SGLang's own
    layout (`TensorTransport.layout`, which a push may switch off)."""
    rank = dist.rank()
    transport: Transport
    if cfg.transport == "tensor":
        transport = TensorTransport(engines, layout=layout)
    else:
        transport = DistributedTransport(
            engines,
            master_address=cfg.master_address if rank == 0 else None,
            master_port=cfg.master_port + rank * len(engines) if cfg.master_port else 0,
            group_name=f"{cfg.group_name}_sender{rank}",
            backend=cfg.backend,
            timeout_s=cfg.timeout_s,
        )
    transport.stamps_last_bucket = False
    return transport


@dataclass(slots=True)
class SentChecksums:
    """What one sender predicts the engines report of what it sent (picklable, for rank 0):
    HF-named per tensor, and per engine TP size SGLang's fused per-rank checksums when it sent
    whole fused parameters (the one-sender-per-scope push)."""

    hf: dict[str, str]
    per_tp: dict[int, list[dict[str, str]]]

    @classmethod
    def of(
        cls, sums: EngineChecksums | RankChecksums, tp_sizes: list[int], sent: bool
    ) -> SentChecksums:
        if not sent or not sums.per_rank:
            return cls(dict(sums.hf), {})
        return cls(dict(sums.hf), {tp: sums.ranks(tp) for tp in tp_sizes})

    def ranks(self, tp_size: int) -> list[dict[str, str]]:
        """As `EngineChecksums.ranks`."""
        if tp_size not in self.per_tp:
            raise KeyError(f"no sender computed checksums for engines of TP size {tp_size}")
        return self.per_tp[tp_size]


Outcome = tuple[str | None, SentChecksums | None, StreamStats, dict[str, str]]


def gather_outcomes(
    error: BaseException | None,
    checksums: SentChecksums | None,
    stats: StreamStats,
    send_engines: Sequence[WeightReceiver],
) -> list[Outcome]:
    """Every rank's (error, checksums of what it sent, stats, engines its client dropped) on
    rank 0 (rank order; empty elsewhere). Collective."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    mine: Outcome = (message, checksums, stats, dropped(send_engines))
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return [mine]
    rank0 = torch.distributed.get_rank() == 0
    every: list[Any] = [None] * torch.distributed.get_world_size() if rank0 else []
    torch.distributed.gather_object(mine, every if rank0 else None, dst=0)
    return every


def first_error(outcomes: list[Outcome]) -> BaseException | None:
    """The first sender's failure, naming its rank."""
    for rank, (error, *_) in enumerate(outcomes):
        if error is not None:
            return RuntimeError(f"sender rank {rank}: {error}")
    return None


def merged_stats(every: list[StreamStats]) -> StreamStats:
    """The push's stats over all senders: counts and bytes summed, phase seconds the slowest
    sender's (they ran in parallel)."""
    out = StreamStats()
    for s in every:
        out.tensors += s.tensors
        out.buckets += s.buckets
        out.bytes_sent += s.bytes_sent
        out.bytes_exported += s.bytes_exported
        out.tensors_seen += s.tensors_seen
        out.direct_experts += s.direct_experts
        out.fp8_tensors += s.fp8_tensors
        out.fp8_worst_error_ratio = max(out.fp8_worst_error_ratio, s.fp8_worst_error_ratio)
        out.error = out.error or s.error
        for phase, sec in s.seconds.items():
            out.seconds[phase] = max(out.seconds.get(phase, 0.0), sec)
    return out


def merged_checksums(per_sender: Iterable[SentChecksums | None]) -> SentChecksums:
    """The union of every sender's checksums (each tensor hashed by its sender; scopes that
    sent the same bytes agree on their digests)."""
    out = SentChecksums({}, {})
    for sent in per_sender:
        if sent is not None:
            out.hf.update(sent.hf)
            for tp, ranks in sent.per_tp.items():
                # Per engine rank, the union: in SGLang's layout each sender sent some ranks'
                # parameters (`weight_layout.RankChecksums`).
                held = out.per_tp.setdefault(tp, [{} for _ in ranks])
                for mine, more in zip(held, ranks, strict=True):
                    mine.update(more)
    return out


def abort(engines: Sequence[WeightReceiver]) -> None:
    """Rank 0 closes the session after a failed push (best effort)."""
    for engine in engines:
        try:
            engine.end_weight_update()
        except Exception:  # noqa: BLE001 - already failing; the first error is reported
            pass


__all__ = [
    "SenderGrid",
    "SentChecksums",
    "adopt_dropped",
    "dropped",
    "expert_rank",
    "gather_outcomes",
    "grid_problem",
    "merged_checksums",
    "merged_stats",
    "node_index",
    "owned_tensors",
    "prepare",
    "send_engines_for",
    "sender_transport",
]


def send_engines_for(
    cfg: WeightSyncConfig, client: Any, launched: Any
) -> list[WeightReceiver] | None:
    """Every rank: the engines it pushes to with `weights.senders=owners` (its node's for
    `tensor`, all for `distributed`; `engines.connect.sender_client`); None with one sender."""
    if cfg.senders != "owners":
        return None
    from megatron_gspo.engines.connect import sender_client

    node = node_index() if cfg.transport == "tensor" else None
    engine = sender_client(client, launched, node=node)
    return [engine] if engine is not None else []
