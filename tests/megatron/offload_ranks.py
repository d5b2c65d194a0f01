"""Rank body of tests/megatron/test_offload.py: the same GSPO updates with and without the
colocated offload/reload round trip, built through `Policy.build`, on 2 gloo ranks with EP=2."""

from __future__ import annotations

from typing import Any

import torch

from megatron_gspo.megatron.offload import offload_trainer, reload_trainer
from megatron_gspo.megatron.policy import Policy
from tests.megatron.config_effects_ranks import config, sequences

STEPS = 3


def _state(policy: Policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model[0].named_parameters()}


def _resident_bytes(policy: Policy) -> dict[str, int]:
    """Bytes still held by parameter, grad-buffer and optimizer-state storages."""
    from megatron_gspo.megatron.offload import _tensors, _torch_optimizers

    chunk = policy.model[0]
    params = sum(p.untyped_storage().nbytes() for p in chunk.parameters())
    grads = sum(
        b.grad_data.untyped_storage().nbytes()
        for b in chunk.buffers + chunk.expert_parallel_buffers
    )
    opt = sum(
        t.untyped_storage().nbytes()
        for o in _torch_optimizers(policy.optimizer)
        for s in o.state.values()
        for t in _tensors(s)
    )
    return {"params": params, "grads": grads, "optimizer": opt}


def run(hf_dir: str, dist_opt: bool, offload: bool) -> dict[str, Any]:
    cfg = config(
        hf_dir,
        f"optim.use_distributed_optimizer={str(dist_opt).lower()}",
        "rollout.launch.colocated=true",
        f"train.steps={STEPS}",
        "rl.mini_batches_per_rollout=2",
    )
    policy = Policy.build(cfg.policy_spec())
    metrics, while_off, moved = [], [], []
    for step in range(STEPS + 1):
        if offload:
            offload_trainer(policy)  # the engines would generate now
            while_off.append(_resident_bytes(policy))
            m = reload_trainer(policy)
            moved.append({k: v for k, v in m.items() if k.startswith("memory/offload")})
        if step < STEPS:
            metrics.append(policy.update(sequences(policy), step))
    return dict(params=_state(policy), metrics=metrics, while_off=while_off, moved=moved)


def disabled(hf_dir: str) -> dict[str, Any]:
    """rollout.launch.offload_trainer=false (or not colocated): both calls do nothing."""
    out = {}
    for key in ("rollout.launch.offload_trainer=false", "rollout.launch.colocated=false"):
        cfg = config(hf_dir, key, "rollout.launch.colocated=true")
        if key.endswith("colocated=false"):
            cfg = config(hf_dir, key)
        policy = Policy.build(cfg.policy_spec())
        out[key] = (offload_trainer(policy), _resident_bytes(policy))
        out[key] += (reload_trainer(policy),)
    return out


def main(rank: int, world: int, hf_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dist_opt in (True, False):
        out[dist_opt] = {o: run(hf_dir, dist_opt, o) for o in (False, True)}
    out["disabled"] = disabled(hf_dir)
    return out
