"""Rank program for test_routing_per_minibatch.py: one `Policy.update` with
train.routing_flip_per_minibatch on, the weights after every optimizer step exported as HF
tensors (by wrapping `step.train_step`), and the sequences the flip rate was probed on."""

from __future__ import annotations

from typing import Any

import torch

from megatron_gspo.megatron import step as mstep
from megatron_gspo.megatron.packing import TrainSequence

MINI_BATCHES = 3


def main(rank: int, world: int, hf: str, raw: list[list[int]]) -> dict[str, Any]:
    from megatron_gspo.config import load_config
    from megatron_gspo.megatron.model import quiet_megatron
    from megatron_gspo.megatron.policy import Policy
    from megatron_gspo.weights.stream import hf_tensors

    quiet_megatron()
    cfg = load_config(
        None,
        [
            f"model.hf_path={hf}",
            "model.dtype=fp32",
            "data.train_path=unused.jsonl",
            "loss.kind=grpo",
            "rl.pi_old=recompute",  # ratio 1 at mini-batch 1: the updates move the weights
            "rl.prompts_per_rollout=3",
            "rl.group_size=3",
            f"rl.mini_batches_per_rollout={MINI_BATCHES}",
            "optim.lr=2e-2",
            "rollout.max_new_tokens=32",
            "train.micro_batch_tokens=512",  # each mini-batch is one micro-batch: the probe
            "train.routing_flip_every=1",
            "train.routing_flip_per_minibatch=true",
        ],
    )
    policy = Policy.build(cfg.policy_spec())
    seqs = [
        TrainSequence(
            seq_id=i,
            prompt_ids=ids[:3],
            response_ids=ids[3:],
            old_logp=[0.0] * (len(ids) - 3),
            advantage=1.0 if i % 2 else -1.0,
        )
        for i, ids in enumerate(raw)
    ]
    weights: list[dict[str, torch.Tensor]] = []
    train_step = mstep.train_step

    def recording_step(*args: Any, **kwargs: Any) -> dict[str, float]:
        m = train_step(*args, **kwargs)
        tensors = hf_tensors(policy.bridge, policy.model, experts_to_first=False)
        weights.append({name: t.detach().cpu().clone() for name, t in tensors})
        return m

    mstep.train_step = recording_step
    try:
        metrics = policy.update(seqs, step=1)
    finally:
        mstep.train_step = train_step
    probed = [s.seq_id for s in seqs[::MINI_BATCHES]]
    return {"metrics": metrics, "weights": weights, "probed": probed}
