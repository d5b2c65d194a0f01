"""Rank body of tests/megatron/test_config_effects.py: each model/optim/train key changes what
the policy does, built through the real path (`Policy.build(cfg.policy_spec())`), on 2 gloo ranks
with EP=2."""

from __future__ import annotations

from typing import Any

import torch

from megatron_gspo.config import Config, load_config
from megatron_gspo.megatron import step as mstep
from megatron_gspo.megatron.packing import TrainSequence
from megatron_gspo.megatron.policy import Policy
from tests.megatron.policy_ranks import make_sequences


def config(hf_dir: str, *overrides: str) -> Config:
    return load_config(
        None,
        [
            f"model.hf_path={hf_dir}",
            "model.dtype=fp32",
            "data.train_path=unused.jsonl",
            "parallel.ep=2",
            "rl.prompts_per_rollout=5",
            "rl.group_size=2",
            "rl.mini_batches_per_rollout=1",
            "rl.pi_old=recompute",  # on-policy pi_old: ratio 1, every sequence has a gradient
            "loss.kind=grpo",
            "optim.lr=1e-2",
            "optim.use_distributed_optimizer=false",
            "train.micro_batch_tokens=24",
            "rollout.max_new_tokens=12",
            "train.routing_flip_every=0",
            *overrides,
        ],
    )


def sequences(policy: Policy, advantage: float | None = None) -> list[TrainSequence]:
    vocab = policy.bridge.hf_pretrained.config.vocab_size
    return [
        TrainSequence(
            seq_id=s["seq_id"],
            prompt_ids=s["prompt_ids"],
            response_ids=s["response_ids"],
            old_logp=[0.0] * len(s["response_ids"]),
            advantage=s["advantage"] if advantage is None else advantage,
        )
        for s in make_sequences(vocab)
    ]


def params(policy: Policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model[0].named_parameters()}


def lr_schedule(hf_dir: str, schedule: str) -> list[float]:
    """The learning rate of each of 6 optimizer steps (1 mini-batch per rollout step)."""
    cfg = config(
        hf_dir,
        f"optim.lr_schedule={schedule}",
        "optim.warmup_steps=2",
        *([] if schedule == "constant" else ["optim.min_lr=1e-3"]),  # refused: no decay
        "train.steps=6",
    )
    policy = Policy.build(cfg.policy_spec())
    return [policy.update(sequences(policy), step)["optim/lr"] for step in range(6)]


def sgd_vs_adam(hf_dir: str) -> dict[str, Any]:
    """One optimizer step: the weight change and the gradient that caused it."""
    out = {}
    for name in ("sgd", "adam"):
        momentum = ["optim.sgd_momentum=0"] if name == "sgd" else []  # refused with adam
        cfg = config(hf_dir, f"optim.optimizer={name}", *momentum, "optim.clip_grad=0")
        policy = Policy.build(cfg.policy_spec())
        before = params(policy)
        policy.update(sequences(policy), 0)
        after = params(policy)
        grads = {n: p.main_grad.detach().clone() for n, p in policy.model[0].named_parameters()}
        out[name] = {n: (after[n] - before[n], grads[n]) for n in before}
    return out


def recompute(hf_dir: str) -> dict[str, Any]:
    """Forward calls of decoder layer 0 and of its core attention in one update, and the
    update's loss and grad norm, per activation_recompute setting."""
    out = {}
    for mode in ("none", "selective", "full"):
        policy = Policy.build(config(hf_dir, f"model.activation_recompute={mode}").policy_spec())
        seqs = sequences(policy)
        # pi_old recompute runs forward-only passes first: count the training step's only.
        for s, lp in mstep.compute_logprobs(policy.model, policy.plan(seqs)).items():
            seqs[s].old_logp = lp.tolist()
        layer = policy.model[0].module.decoder.layers[0]
        calls = {"layer": 0, "attn": 0}
        layer.register_forward_hook(_counter(calls, "layer"))
        layer.self_attention.core_attention.register_forward_hook(_counter(calls, "attn"))
        step_cfg = mstep.StepConfig(loss=policy.spec.loss)
        mbs = policy.plan(seqs)
        m = mstep.train_step(policy.model, policy.optimizer, mbs, step_cfg)
        out[mode] = dict(calls, micro_batches=len(mbs), loss=m["loss"], grad_norm=m["grad_norm"])
    return out


def _counter(calls: dict[str, int], key: str) -> Any:
    def hook(*_: Any) -> None:
        calls[key] += 1

    return hook


def dispatcher(hf_dir: str) -> dict[str, Any]:
    out = {}
    for kind in ("alltoall", "allgather"):
        # ep=1 (dp=2): allgather is refused with EP > 1 (see `refused`)
        cfg = config(hf_dir, f"model.moe_token_dispatcher={kind}", "parallel.ep=1")
        policy = Policy.build(cfg.policy_spec())
        mlp = policy.model[0].module.decoder.layers[0].mlp
        m = policy.update(sequences(policy), 0)
        out[kind] = dict(cls=type(mlp.token_dispatcher).__name__, loss=m["loss"])
    return out


def refused(hf_dir: str) -> dict[str, str]:
    out = {}
    keys = (
        "model.moe_grouped_gemm=true",
        "model.moe_token_dispatcher=flex",
        "model.moe_token_dispatcher=allgather",  # with parallel.ep=2
        "model.dtype=fp16",  # bf16 runs on CPU (fp32 main params); fp16 needs a loss scaler
    )
    for key in keys:
        try:
            Policy.build(config(hf_dir, key).policy_spec())
            out[key] = "built"
        except ValueError as e:
            out[key] = str(e)
    return out


def planted_nan(hf_dir: str) -> dict[str, Any]:
    """NaN advantages (e.g. a reward function returning NaN): every optimizer step of the
    update is skipped, the weights do not move, and the metrics say so."""
    policy = Policy.build(
        config(
            hf_dir,
            "rl.mini_batches_per_rollout=2",
            "rl.prompts_per_rollout=2",
            "rl.group_size=5",
        ).policy_spec()
    )
    before = params(policy)
    sched_steps = policy.scheduler.num_steps
    m = policy.update(sequences(policy, advantage=float("nan")), 0)
    after = params(policy)
    return dict(
        metrics=m,
        unchanged=all(torch.equal(before[n], after[n]) for n in before),
        scheduler_advanced=policy.scheduler.num_steps != sched_steps,
        finite_after=all(bool(torch.isfinite(p).all()) for p in after.values()),
    )


def main(rank: int, world: int, hf_dir: str) -> dict[str, Any]:
    return dict(
        lr={s: lr_schedule(hf_dir, s) for s in ("constant", "linear", "cosine")},
        optimizer=sgd_vs_adam(hf_dir),
        recompute=recompute(hf_dir),
        dispatcher=dispatcher(hf_dir),
        refused=refused(hf_dir),
        nan=planted_nan(hf_dir),
    )
