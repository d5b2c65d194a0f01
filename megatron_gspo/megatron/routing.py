"""MoE routing drift: how often a token's top-k expert set changes when the policy is updated.

GSPO's claim (arXiv 2507.18071, section 5.3) is that it needs no Routing Replay although the
experts a token is routed to change between the rollout policy and the updated one. This module
measures that change on the real megatron-core routers, so the claim is a number in the logs:

    moe/routing_flip_rate = #(token, MoE layer) whose top-k expert set differs
                            / #(token, MoE layer), over real (non-padding) tokens.

`routing_snapshot` records every `TopKRouter`'s routing map during a forward-only pass; two
snapshots of the same micro-batches (before and after an update) go to `routing_flip_rate`.

Shape legend: `T` tokens of a micro-batch seen by one router on this rank (its CP shard, and
its sequence-parallel slice when SP is on), `E` experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from megatron_gspo import dist
from megatron_gspo.megatron.packing import PackedMicroBatch

Snapshot = dict[str, list[Tensor]]
"""Router name -> one routing map per micro-batch, `[T, E]` bool, in micro-batch order, on the
device the router ran on."""


class RoutingRecorder:
    """Context manager recording each `TopKRouter` call's routing map on these model chunks."""

    def __init__(self, model: Sequence[torch.nn.Module]) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = {
            f"{i}.{name}": mod
            for i, chunk in enumerate(model)
            for name, mod in chunk.named_modules()
            if isinstance(mod, TopKRouter)
        }
        self.maps: Snapshot = {name: [] for name in self.routers}
        self._handles: list[Any] = []

    def __enter__(self) -> RoutingRecorder:
        for name, mod in self.routers.items():

            def hook(
                _m: torch.nn.Module,
                _inp: tuple[Tensor, ...],
                out: tuple[Tensor, ...],
                name: str = name,
            ) -> None:
                # Kept where the router ran (the job's device): no host sync per router call,
                # and the flip count and its all-reduce happen on that device too.
                self.maps[name].append(out[1].detach().bool())

            self._handles.append(mod.register_forward_hook(hook))
        return self

    def __exit__(self, *_exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@torch.no_grad()
def routing_snapshot(
    model: Sequence[torch.nn.Module], micro_batches: Sequence[PackedMicroBatch]
) -> Snapshot:
    """Routing maps of every router on this rank for `micro_batches` (forward only)."""
    from megatron_gspo.megatron.step import forward_only

    with RoutingRecorder(model) as rec:
        forward_only(list(model), micro_batches, lambda mb, logits: {})
    for name, maps in rec.maps.items():
        if len(maps) != len(micro_batches):  # e.g. activation recomputation calls routers twice
            raise RuntimeError(
                f"router {name} ran {len(maps)} times for {len(micro_batches)} micro-batches"
            )
    return rec.maps


def _router_tokens(mb: PackedMicroBatch, tp_size: int, tp_rank: int, sp: bool) -> Tensor:
    """Which of the tokens a router sees on this rank are real: [T] bool."""
    valid = mb.valid
    if sp and tp_size > 1:  # sequence parallelism: each TP rank routes its slice of the tokens
        valid = valid.view(tp_size, -1)[tp_rank]
    return valid


def routing_flip_rate(
    before: Snapshot,
    after: Snapshot,
    micro_batches: Sequence[PackedMicroBatch],
    *,
    sequence_parallel: bool,
) -> dict[str, float]:
    """`moe/routing_flip_rate` between two snapshots of the same micro-batches, reduced over
    every rank (identical on all), and `moe/routed_token_layers` (its denominator)."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    # On the job's device: the all-reduce below runs on the default group (NCCL on GPU).
    counts = torch.zeros(2, dtype=torch.float64, device=dist.device())  # flips, pairs
    for name, maps in before.items():
        for mb, b, a in zip(micro_batches, maps, after[name], strict=True):
            valid = _router_tokens(mb, tp, tp_rank, sequence_parallel)
            if valid.numel() != b.size(0):
                raise RuntimeError(f"router {name}: {b.size(0)} tokens, {valid.numel()} expected")
            changed = (b != a).any(dim=-1) & valid
            counts += torch.stack([changed.sum(), valid.sum()]).to(counts)
    if tp > 1 and not sequence_parallel and tp_rank != 0:
        counts.zero_()  # TP ranks route the same tokens: count them once
    torch.distributed.all_reduce(counts)
    flips, total = counts.tolist()
    return {
        "moe/routing_flip_rate": flips / total if total else float("nan"),
        "moe/routed_token_layers": total,
    }
