"""Rank program for test_replay.py: megatron-core's routers under Routing Replay, at several
layouts. The routes come from an engine serving OTHER weights (checkpoint B, perturbed
routers), so a router that ignored them would disagree on many (token, layer) pairs."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_gspo.megatron import replay
from megatron_gspo.megatron import step as mstep
from megatron_gspo.megatron.model import (
    Layout,
    build_model,
    init_megatron,
    load_bridge,
    make_provider,
    quiet_megatron,
)
from megatron_gspo.megatron.packing import PackedMicroBatch, TrainSequence
from megatron_gspo.megatron.routing import RoutingRecorder, routing_flip_rate, routing_snapshot


def sequences(data: list[dict[str, Any]], routes: bool = True) -> list[TrainSequence]:
    return [
        TrainSequence(
            seq_id=i,
            prompt_ids=d["prompt_ids"],
            response_ids=d["response_ids"],
            old_logp=[0.0] * len(d["response_ids"]),
            advantage=0.0,
            routed_experts=d["routes"] if routes else None,
        )
        for i, d in enumerate(data)
    ]


def _sp_rows(t: torch.Tensor, sp: bool) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if sp and tp > 1:
        return t.view(tp, -1, *t.shape[1:])[ps.get_tensor_model_parallel_rank()]
    return t


def disagreement(
    model: list[torch.nn.Module], mbs: list[PackedMicroBatch], routes: list[torch.Tensor], sp: bool
) -> tuple[int, int]:
    """(token, layer) pairs where the routers' chosen expert SET differs from the engine's,
    over real tokens the engine routed, and how many were compared (routes: the packed
    [T, L, K] routes per micro-batch)."""
    with RoutingRecorder(model) as rec:
        mstep.forward_only(model, mbs, lambda mb, out: {})
    bad = total = 0
    for name, router in rec.routers.items():
        layer = router.layer_number - 1
        for mb, got, want in zip(mbs, rec.maps[name], routes, strict=True):
            want = _sp_rows(want, sp)[:, layer]  # [T, K]
            keep = _sp_rows(mb.valid, sp) & (want >= 0).all(-1)
            expected = torch.zeros_like(got)
            expected.scatter_(1, want.clamp(min=0), True)
            bad += int(((got != expected).any(-1) & keep).sum())
            total += int(keep.sum())
    return bad, total


def run_case(bridges: tuple[Any, Any], layout: Layout, data: list[dict], neutral: bool) -> dict:
    init_megatron(layout)
    provider = make_provider(bridges[0], layout)
    replay.enable(provider)
    model = build_model(provider, ddp_config=None, load_from=bridges[0])
    mbs = mstep.plan_for_this_rank(sequences(data), layout, max_tokens=24)
    packed = [mb.routed_experts for mb in mbs]
    assert all(p is not None for p in packed)
    out: dict[str, Any] = {}
    out["replayed"] = disagreement(model, mbs, packed, layout.sp)
    out["logp_replayed"] = {k: v.tolist() for k, v in mstep.compute_logprobs(model, mbs).items()}
    own = [dataclasses.replace(mb, routed_experts=None) for mb in mbs]
    out["own"] = disagreement(model, own, packed, layout.sp)
    logp_own = mstep.compute_logprobs(model, own)
    # Routing drift across an update (checkpoint A -> B), as Policy.update probes it.
    before_r, before_o = routing_snapshot(model, mbs), routing_snapshot(model, own)
    bridges[1].load_hf_weights(model)
    after_r, after_o = routing_snapshot(model, mbs), routing_snapshot(model, own)
    out["flip_replayed"] = routing_flip_rate(before_r, after_r, mbs, sequence_parallel=layout.sp)
    out["flip_own"] = routing_flip_rate(before_o, after_o, own, sequence_parallel=layout.sp)
    if neutral:  # the switch off: a model without RouterReplay ignores the routes entirely
        provider = make_provider(bridges[0], layout)  # rl.routing_replay=false: no enable()
        plain = build_model(provider, ddp_config=None, load_from=bridges[0])
        logp_plain = mstep.compute_logprobs(plain, mbs)
        out["neutral_max_diff"] = max(
            float((logp_plain[k] - logp_own[k]).abs().max()) for k in logp_own
        )
        out["plain_replay_routers"] = sum(len(list(replay.replay_routers(c))) for c in plain)
    return out


def policy_case(hf_a: str, data: list[dict]) -> dict[str, Any]:
    """The real path: `Policy.build` with rl.routing_replay=true, one `Policy.update` on
    sequences carrying the engine's routes; its logged routing flip rate."""
    from megatron_gspo.config import load_config
    from megatron_gspo.megatron.policy import Policy

    cfg = load_config(
        None,
        [
            f"model.hf_path={hf_a}",
            "model.dtype=fp32",
            "data.train_path=unused.jsonl",
            "rl.routing_replay=true",
            "rl.prompts_per_rollout=3",
            "rl.group_size=2",
            "rl.mini_batches_per_rollout=2",
            "optim.lr=1e-2",
            "train.micro_batch_tokens=24",
            "rollout.max_new_tokens=14",
            "train.routing_flip_every=1",
        ],
    )
    policy = Policy.build(cfg.policy_spec())
    seqs = sequences(data)
    for s in seqs:
        s.advantage = 1.0 if s.seq_id % 2 else -1.0
    metrics = policy.update(seqs, step=1)
    routers = sum(len(list(replay.replay_routers(c))) for c in policy.model)
    return {"metrics": metrics, "replay_routers": routers}


def main(
    rank: int, world: int, hf_a: str, hf_b: str, data: list[dict], layouts: dict[str, dict]
) -> dict[str, Any]:
    quiet_megatron()
    bridges = (load_bridge(hf_a), load_bridge(hf_b))
    out = {
        name: run_case(bridges, Layout(**lay), data, neutral=i == 0)
        for i, (name, lay) in enumerate(layouts.items())
    }
    out["policy"] = policy_case(hf_a, data)
    return out
