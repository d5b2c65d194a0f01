"""The policy on megatron-core: model chunks, optimizer, learning-rate schedule, and the one
update a rollout step makes (pi_old recompute, one optimizer step per mini-batch, the routing
drift probe), so the training loop calls `Policy.update` once per step and nothing else here.

Metric names say what they measure:
    mismatch/*          first mini-batch only: the trainer has not moved yet, so the whole
                        trainer-vs-engine log-ratio is train/inference mismatch
    mismatch/seq_outside_clip   share of sequences whose engine-vs-trainer sequence log-ratio
                        alone lies outside the clip band (can engine log-probs be pi_old?)
    drift/abs_logp_diff later mini-batches: policy movement since the rollout plus mismatch
    policy/*, loss, grad_norm   means over the mini-batches (NaN when one was not finite)
    train/skipped_updates       optimizer steps skipped for a non-finite loss or gradient
    train/empty_updates 1 when loss.mask_truncated left no sequence to train on (no step)
    optim/lr            learning rate of the last optimizer step of the rollout step
    kl/mean             per-token KL estimate vs the reference model (loss.kl_coef > 0);
                        first_mb/kl/mean is 0 up to rounding at step 1 (policy == reference)
    kl/reward_penalty   loss.kl_in_reward: mean kl_coef * sum_t KL_t(pi_old || pi_ref) taken off
                        the rewards before the advantages were recomputed
    moe/routing_flip_rate       share of probed (token, MoE layer) whose top-k experts differ
                        between the rollout weights and the weights after the step's updates;
                        moe/routing_flip_rate_mb/<k> (train.routing_flip_per_minibatch): the
                        same against the weights mini-batch k trains at (k = 2..n)
    time/mismatch_logp_s  loss.*_mismatch_mask with rl.pi_old=engine: the extra forward that
                        gives the later mini-batches the trainer's log-probs at rollout weights
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatron_gspo import dist
from megatron_gspo.algo.kl_reward import kl_reward_advantages
from megatron_gspo.layout import Layout
from megatron_gspo.megatron import replay
from megatron_gspo.megatron import step as mstep
from megatron_gspo.megatron.config import PolicySpec
from megatron_gspo.megatron.model import (
    build_model,
    build_optimizer,
    build_scheduler,
    ddp_config,
    init_megatron,
    load_bridge,
    make_provider,
    quiet_megatron,
)
from megatron_gspo.megatron.packing import PackedMicroBatch, TrainSequence
from megatron_gspo.megatron.reference import ReferenceModel
from megatron_gspo.megatron.routing import (
    RoutingRecorder,
    Snapshot,
    routing_flip_rate,
    routing_snapshot,
)

if TYPE_CHECKING:
    from megatron.bridge import AutoBridge
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = ["Policy"]

# Copied from the first mini-batch, where the ratio is pure mismatch.
_FIRST_MB = ("policy/clip_frac", "policy/seq_log_ratio_abs", "kl/mean")


@dataclass
class Policy:
    """The Megatron side of the job (every rank holds one)."""

    spec: PolicySpec
    """What it reads of the run (`Config.policy_spec()`)."""
    bridge: AutoBridge
    model: list[torch.nn.Module]
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    ref: ReferenceModel | None = None
    """pi_ref for loss.kl_coef > 0 (a frozen copy of the initial policy), else None."""

    @property
    def layout(self) -> Layout:
        return self.spec.parallel

    @classmethod
    def build(cls, spec: PolicySpec) -> Policy:
        quiet_megatron()
        bridge = load_bridge(spec.model.hf_path)
        # Our check first: its message names the config key; megatron-core's would not.
        spec.parallel.validate(dist.world_size(), bridge.hf_pretrained.config)
        init_megatron(spec.parallel, seed=spec.seed)
        provider = make_provider(bridge, spec.parallel, spec.model)
        if spec.routing_replay:  # a study control (megatron/replay.py), off by default
            replay.enable(provider)
        model = build_model(
            provider,
            ddp_config=ddp_config(spec.optim.use_distributed_optimizer),
            load_from=bridge if spec.model.load_weights else None,
        )
        optimizer = build_optimizer(model, spec.optim)
        ref = None
        if spec.loss.kl_coef > 0:  # copied now: before any checkpoint load, the initial policy
            ref = ReferenceModel.from_policy(bridge, spec, model, offload=spec.loss.ref_offload)
        scheduler = build_scheduler(optimizer, spec.optim, spec.optimizer_steps)
        return cls(spec, bridge, model, optimizer, scheduler, ref=ref)

    def plan(self, seqs: Sequence[TrainSequence]) -> list[PackedMicroBatch]:
        return mstep.plan_for_this_rank(seqs, self.layout, self.spec.micro_batch_tokens)

    def update(self, seqs: list[TrainSequence], step: int) -> dict[str, float]:
        """Recompute pi_old if asked, then one optimizer step per mini-batch (paper: 4);
        measure the routing drift this update causes (every `train.routing_flip_every` steps).
        Identical metrics on every rank."""
        spec = self.spec
        temperature = spec.temperature
        if spec.pi_old == "recompute":
            fresh = mstep.compute_logprobs(
                self.model,
                self.plan(seqs),
                temperature=temperature,
                fused_lm_head=spec.model.fused_lm_head,
            )
            for s in seqs:
                # tensors stay tensors: no Python float per token (megatron/transfer.py)
                s.rollout_logp, s.old_logp = s.old_logp, fresh[s.seq_id]
        reward_kl = self._reference_logprobs(seqs) if seqs else {}
        n = spec.mini_batches
        masks = spec.loss.seq_mismatch_mask or spec.loss.token_mismatch_mask
        if masks and spec.pi_old == "engine":
            reward_kl |= self._trainer_old_logprobs(seqs, n)
        step_cfg = mstep.StepConfig(
            loss=spec.loss, temperature=temperature, fused_lm_head=spec.model.fused_lm_head
        )
        every = spec.routing_flip_every
        before = probe = None
        probing = bool(seqs) and every > 0 and step % every == 0 and self._has_routers
        # The probe is the first micro-batch of the first mini-batch (seqs[::n]), which the
        # first optimizer step's forward runs at the rollout weights: its routing is recorded
        # there, not in a forward of its own, where that forward routes each token once
        # (no pipeline, no recomputation; routing replay replays in both, kept apart anyway).
        in_step = probing and self._probe_in_first_step()
        if probing and not in_step:
            probe = self.plan(seqs[::n])[: self.layout.pp if self.layout.vpp else 1]
            before = routing_snapshot(self.model, probe)
        per_index = before if spec.routing_flip_per_minibatch else None
        flips: dict[str, float] = {}
        per_mb: list[dict[str, float]] = []
        lr = float("nan")
        for i in range(n):
            mini = seqs[i::n]
            if not mini:
                continue
            if i and per_index is not None and probe is not None:  # weights after i updates
                flips |= self._flip_at_minibatch(per_index, probe, i + 1)
            lr = float(self.optimizer.param_groups[0]["lr"])
            planned = self.plan(mini)
            if i == 0 and in_step:
                probe = planned[:1]
                with RoutingRecorder(self.model) as rec:
                    m = mstep.train_step(self.model, self.optimizer, planned, step_cfg)
                before = first_routing(rec.maps, len(planned))
                per_index = before if spec.routing_flip_per_minibatch else None
            else:
                m = mstep.train_step(self.model, self.optimizer, planned, step_cfg)
            if m["update_successful"]:
                self.scheduler.step(1)
            per_mb.append(m)
        out = summarise(per_mb) | reward_kl | flips
        out["optim/lr"] = lr
        if before is not None and probe is not None:
            after = routing_snapshot(self.model, probe)
            out |= routing_flip_rate(before, after, probe, sequence_parallel=self.layout.sp)
        return out

    @functools.cached_property
    def _has_routers(self) -> bool:
        """Whether the model has MoE routers (the flip rate is measured only then)."""
        return bool(RoutingRecorder(self.model).routers)

    def _probe_in_first_step(self) -> bool:
        """Whether the first optimizer step's forward can record the routing probe's "before"
        snapshot: one model chunk, no pipeline stages, every router run once per micro-batch
        (no activation recomputation), no routing replay."""
        spec = self.spec
        return (
            len(self.model) == 1
            and self.layout.pp == 1
            and spec.model.activation_recompute == "none"
            and not spec.routing_replay
        )

    def _flip_at_minibatch(
        self, before: Snapshot, probe: list[PackedMicroBatch], k: int
    ) -> dict[str, float]:
        """`moe/routing_flip_rate_mb/<k>`: the probe's routing at the weights mini-batch k
        (1-based) is about to train at against its routing at the rollout weights (`before`)."""
        now = routing_snapshot(self.model, probe)
        rate = routing_flip_rate(before, now, probe, sequence_parallel=self.layout.sp)
        return {f"moe/routing_flip_rate_mb/{k}": rate["moe/routing_flip_rate"]}

    def _trainer_old_logprobs(self, seqs: list[TrainSequence], n: int) -> dict[str, float]:
        """The mismatch masks with pi_old from the engine need the trainer's log-probs at the
        rollout weights. The first mini-batch's are its current log-probs (the loss takes them
        there); mini-batches 2..n (the sequences j % n != 0, see `update`) get them from one
        forward before the first update: (n-1)/n of a pi_old recompute, timed."""
        later = [s for j, s in enumerate(seqs) if j % n]
        if not later:
            return {}
        t0 = time.perf_counter()
        fresh = mstep.compute_logprobs(
            self.model,
            self.plan(later),
            temperature=self.spec.temperature,
            fused_lm_head=self.spec.model.fused_lm_head,
        )
        for s in later:
            s.trainer_old_logp = fresh[s.seq_id]
        return {"time/mismatch_logp_s": time.perf_counter() - t0}

    def _reference_logprobs(self, seqs: list[TrainSequence]) -> dict[str, float]:
        """loss.kl_coef > 0: log pi_ref of every training token onto the sequences (one
        forward of the reference model per rollout step); with loss.kl_in_reward the KL
        penalty applied to the rewards and the group advantages recomputed from them."""
        if self.ref is None:
            return {}
        loss = self.spec.loss
        ref = self.ref.logprobs(self.plan(seqs), temperature=self.spec.temperature)
        for s in seqs:
            s.ref_logp = ref[s.seq_id].tolist()
        if not loss.kl_in_reward:
            return {}
        kl = kl_reward_advantages(
            seqs,
            kl_coef=loss.kl_coef,
            estimator=loss.kl_estimator,
            eps=self.spec.adv_eps,
            normalize_std=self.spec.normalize_std,
        )
        for s, a in zip(seqs, kl.advantages.tolist(), strict=True):
            s.advantage = a
        return {"kl/reward_penalty": float(kl.penalties.mean())}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs besides model and optimizer (the schedule's position)."""
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])


def first_routing(maps: Snapshot, micro_batches: int) -> Snapshot:
    """The first micro-batch's routing maps out of those a training step recorded for its
    `micro_batches` (one router call each per micro-batch, in order)."""
    for name, got in maps.items():
        if len(got) != micro_batches:
            raise RuntimeError(
                f"router {name} ran {len(got)} times for {micro_batches} micro-batches"
            )
    return {name: got[:1] for name, got in maps.items()}


def summarise(per_mb: list[dict[str, float]]) -> dict[str, float]:
    """One rollout step's metrics from its mini-batches' (see the module docstring); no
    mini-batch (loss.mask_truncated left nothing to train on): no update, nothing skipped."""
    if not per_mb:
        return {"train/skipped_updates": 0.0, "train/empty_updates": 1.0}
    out: dict[str, float] = {}
    names = {k for m in per_mb for k in m}
    for k in sorted(names):
        if k.startswith("mismatch/") or k == "update_successful":
            continue
        vals = [m[k] for m in per_mb if k in m]
        out[k] = sum(vals) / len(vals)
    first = per_mb[0]
    for k, v in first.items():
        if k.startswith("mismatch/"):
            out[k] = v
    for k in _FIRST_MB:
        if k in first:
            out[f"first_mb/{k}"] = first[k]
    later = [m["mismatch/abs_logp_diff"] for m in per_mb[1:] if "mismatch/abs_logp_diff" in m]
    if later:
        out["drift/abs_logp_diff"] = sum(later) / len(later)
    out["train/skipped_updates"] = float(sum(1 for m in per_mb if not m["update_successful"]))
    return out
