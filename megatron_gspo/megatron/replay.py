"""Routing Replay (`rl.routing_replay`): the policy's MoE routers take the engine's top-k
experts instead of choosing their own, through megatron-core's `RouterReplay`.

A STUDY CONTROL, off by default: the project trains without replay (GSPO's sequence-level
ratio is meant to absorb routing drift, arXiv 2507.18071 section 5.3); replay is the baseline
the evidence study (issue 22) compares against, after R3 (arXiv 2510.11370).

How: with `moe_enable_routing_replay=True` in the model's TransformerConfig every `TopKRouter`
owns a `RouterReplay`. Before each forward of a packed micro-batch (`megatron/step.py`
`_forward`: training, pi_old recompute and the routing-drift probe alike) `arm` hands each
router its layer's `[T, K]` slice of `PackedMicroBatch.routed_experts` and sets
`REPLAY_FORWARD`: megatron-core then skips its top-k and gathers the router's scores at the
given experts (`moe_utils.topk_routing_with_score_function`), so probabilities and gradients
still flow through the router. A micro-batch without routes (a padding one) clears the action:
the routers route themselves. Positions the engine did not route (each sequence's last token,
padding; -1 in the packed routes) get experts 0..K-1: their outputs reach no loss term.

Layers are matched by the router's global `layer_number` (pipeline offsets included), and the
tokens by this rank's share: its context-parallel shard (already packed so) and, with sequence
parallelism, its tensor-parallel slice. Backward passes do not route again unless layers are
recomputed, which the config refuses (`megatron/config.py`, `check_routing_replay`): a
recompute would replay whatever micro-batch was armed last.

Shape legend: `T` packed tokens a router sees on this rank, `L` layers, `K` experts per token.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from megatron.bridge.models.gpt_provider import GPTModelProvider

__all__ = ["arm", "enable", "replay_routers"]


def enable(provider: GPTModelProvider) -> None:
    """Give every router of models built from `provider` a megatron-core `RouterReplay`."""
    provider.moe_enable_routing_replay = True


def replay_routers(chunk: torch.nn.Module) -> Iterator[Any]:
    """The `TopKRouter`s of one model chunk that carry a `RouterReplay`."""
    from megatron.core.transformer.moe.router import TopKRouter

    for mod in chunk.modules():
        if isinstance(mod, TopKRouter) and getattr(mod, "router_replay", None) is not None:
            yield mod


def _rank_slice(routes: Tensor, sequence_parallel: bool) -> Tensor:
    """This rank's tokens of the packed `[T, L, K]` routes (its TP slice under SP)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if sequence_parallel and tp > 1:
        routes = routes.view(tp, -1, *routes.shape[1:])[ps.get_tensor_model_parallel_rank()]
    return routes


def arm(chunk: torch.nn.Module, routes: Tensor | None) -> int:
    """Set every replay router of `chunk` to replay `routes` ([T, L, K] packed, -1: unrouted)
    in its next forward, or (None) to route itself. Returns the routers armed."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    armed = 0
    for router in replay_routers(chunk):
        rr = router.router_replay
        rr.clear_indices()  # also empties its backward list, which set_target_indices appends to
        if routes is None:
            rr.clear_router_replay_action()
            continue
        mine = _rank_slice(routes, router.config.sequence_parallel)
        layer = router.layer_number - 1  # megatron's layer numbers are global and 1-based
        if not 0 <= layer < mine.shape[1]:
            raise ValueError(
                f"routing replay: router of layer {layer} but the engine returned "
                f"{mine.shape[1]} layers (is the engine serving this model?)"
            )
        idx = mine[:, layer]
        k = router.topk
        if idx.shape[-1] != k:
            raise ValueError(f"routing replay: engine top-{idx.shape[-1]}, model top-{k}")
        filler = torch.arange(k, device=idx.device).expand_as(idx)
        idx = torch.where(idx >= 0, idx, filler)
        rr.set_target_indices(idx.to(device=router.weight.device, dtype=torch.long))
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        armed += 1
    return armed
