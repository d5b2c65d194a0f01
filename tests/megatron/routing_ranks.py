"""Rank program for test_routing.py: routing snapshots of the same packed micro-batches under
two checkpoints (the second with perturbed routers), at several layouts."""

from __future__ import annotations

from typing import Any

from megatron_gspo.megatron import step as mstep
from megatron_gspo.megatron.model import (
    Layout,
    build_model,
    init_megatron,
    load_bridge,
    make_provider,
    quiet_megatron,
)
from megatron_gspo.megatron.packing import TrainSequence
from megatron_gspo.megatron.routing import routing_flip_rate, routing_snapshot


def sequences(raw: list[list[int]], prompt_len: int = 2) -> list[TrainSequence]:
    return [
        TrainSequence(
            seq_id=i,
            prompt_ids=ids[:prompt_len],
            response_ids=ids[prompt_len:],
            old_logp=[0.0] * (len(ids) - prompt_len),
            advantage=0.0,
        )
        for i, ids in enumerate(raw)
    ]


def run_case(bridges: tuple[Any, Any], layout: Layout, raw: list[list[int]]) -> dict[str, Any]:
    init_megatron(layout)
    model = build_model(make_provider(bridges[0], layout), ddp_config=None, load_from=bridges[0])
    mbs = mstep.plan_for_this_rank(sequences(raw), layout, max_tokens=24)
    before = routing_snapshot(model, mbs)
    bridges[1].load_hf_weights(model)
    after = routing_snapshot(model, mbs)
    same = routing_flip_rate(before, before, mbs, sequence_parallel=layout.sp)
    return {
        "flips": routing_flip_rate(before, after, mbs, sequence_parallel=layout.sp),
        "self": same,
        "num_micro_batches": len(mbs),
    }


def main(
    rank: int, world: int, hf_a: str, hf_b: str, raw: list[list[int]], layouts: dict[str, dict]
) -> dict[str, Any]:
    quiet_megatron()
    bridges = (load_bridge(hf_a), load_bridge(hf_b))
    return {name: run_case(bridges, Layout(**lay), raw) for name, lay in layouts.items()}
