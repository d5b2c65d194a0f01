"""Rank body of tests/megatron/test_devices.py: a whole `Policy.update` (pi_old recompute,
routing probe, two optimizer steps, metric reduction), forward-only log-probs, the checkpoint's
collective and a weight export, under the device audit (`megatron_gspo.testing.device_audit`:
the job's device is a simulated accelerator), on 2 gloo ranks, for two layouts."""

from __future__ import annotations

import time
from typing import Any

import torch

from megatron_gspo.megatron import checkpoint
from megatron_gspo.megatron import step as mstep
from megatron_gspo.megatron.policy import Policy
from megatron_gspo.testing import device_audit
from megatron_gspo.weights.stream import model_buckets
from tests.megatron.config_effects_ranks import config, sequences

LAYOUTS = {
    # EP all-to-all in the forward, distributed optimizer (reduce-scatter / all-gather)
    "ep2_distopt": ("parallel.ep=2", "optim.use_distributed_optimizer=true"),
    # TP + sequence parallelism: vocab-parallel log-softmax collectives in our loss
    "tp2_sp": ("parallel.ep=1", "parallel.tp=2"),
}
# Every part of the step runs: recompute (compute_logprobs), the routing probe, 2 mini-batches.
STEP = ("rl.mini_batches_per_rollout=2", "train.routing_flip_every=1")


def whole_step(hf_dir: str, overrides: tuple[str, ...]) -> tuple[Policy, dict[str, Any]]:
    start = time.monotonic()
    policy = Policy.build(config(hf_dir, *STEP, *overrides).policy_spec())
    built = time.monotonic()
    seqs = sequences(policy)
    with device_audit.audit() as audit:
        audit.watch(policy.model, policy.optimizer)
        metrics = policy.update(seqs, 0)
        logprobs = mstep.compute_logprobs(policy.model, policy.plan(seqs))
        stepped = checkpoint._has_stepped(policy.optimizer)
        exported = sum(len(b.tensors) for b in model_buckets(policy.bridge, policy.model))
    return policy, dict(
        violations=audit.violations,
        counts=audit.counts,
        metrics=metrics,
        logprobs=len(logprobs),
        stepped=stepped,
        exported=exported,
        seconds=dict(build=built - start, audited=time.monotonic() - built),
    )


def planted(policy: Policy) -> list[str]:
    """The audit's teeth, on the code path as it was before issue 12: micro-batches left on the
    host (nobody called `PackedMicroBatch.to`) and a count all-reduced from a host tensor (the
    routing probe's reduction)."""
    seqs = sequences(policy)
    with device_audit.audit() as audit:
        audit.watch(policy.model, policy.optimizer)
        host = [mb.to("cpu") for mb in policy.plan(seqs)]
        step_cfg = mstep.StepConfig(loss=policy.spec.loss)
        mstep.train_step(policy.model, policy.optimizer, host, step_cfg)
        torch.distributed.all_reduce(torch.zeros(2, dtype=torch.float64))
    return audit.violations


def main(rank: int, world: int, hf_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, overrides in LAYOUTS.items():
        policy, out[name] = whole_step(hf_dir, overrides)
        if "planted" not in out:
            out["planted"] = planted(policy)
    return out
