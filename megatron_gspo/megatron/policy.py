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
    optim/lr            learning rate of the last optimizer step of the rollout step
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_gspo import dist
from megatron_gspo.config import Config
from megatron_gspo.layout import Layout
from megatron_gspo.megatron import step as mstep
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
from megatron_gspo.megatron.routing import RoutingRecorder, routing_flip_rate, routing_snapshot

__all__ = ["Policy"]

# Copied from the first mini-batch, where the ratio is pure mismatch.
_FIRST_MB = ("policy/clip_frac", "policy/seq_log_ratio_abs")


@dataclass
class Policy:
    """The Megatron side of the job (every rank holds one)."""

    cfg: Config
    bridge: Any
    model: list[torch.nn.Module]
    optimizer: Any
    scheduler: Any

    @property
    def layout(self) -> Layout:
        return self.cfg.parallel

    @classmethod
    def build(cls, cfg: Config) -> Policy:
        quiet_megatron()
        bridge = load_bridge(cfg.model.hf_path)
        # Our check first: its message names the config key; megatron-core's would not.
        cfg.parallel.validate(dist.world_size(), bridge.hf_pretrained.config)
        init_megatron(cfg.parallel, seed=cfg.train.seed)
        model = build_model(
            make_provider(bridge, cfg.parallel, cfg.model),
            ddp_config=ddp_config(cfg.optim.use_distributed_optimizer),
            load_from=bridge if cfg.model.load_weights else None,
        )
        optimizer = build_optimizer(model, cfg.optim)
        total = cfg.train.steps * cfg.rl.mini_batches_per_rollout
        return cls(cfg, bridge, model, optimizer, build_scheduler(optimizer, cfg.optim, total))

    def plan(self, seqs: Sequence[TrainSequence]) -> list[PackedMicroBatch]:
        return mstep.plan_for_this_rank(seqs, self.layout, self.cfg.train.micro_batch_tokens)

    def update(self, seqs: list[TrainSequence], step: int) -> dict[str, float]:
        """Recompute pi_old if asked, then one optimizer step per mini-batch (paper: 4);
        measure the routing drift this update causes (every `train.routing_flip_every` steps).
        Identical metrics on every rank."""
        cfg = self.cfg
        temperature = cfg.rollout.temperature
        if cfg.rl.pi_old == "recompute":
            fresh = mstep.compute_logprobs(self.model, self.plan(seqs), temperature=temperature)
            for s in seqs:
                s.rollout_logp, s.old_logp = list(s.old_logp), fresh[s.seq_id].tolist()
        step_cfg = mstep.StepConfig(loss=cfg.loss, temperature=temperature)
        n = cfg.rl.mini_batches_per_rollout
        every = cfg.train.routing_flip_every
        before = probe = None
        if every and step % every == 0 and RoutingRecorder(self.model).routers:
            probe = self.plan(seqs[::n])[: self.layout.pp if self.layout.vpp else 1]
            before = routing_snapshot(self.model, probe)
        per_mb: list[dict[str, float]] = []
        lr = float("nan")
        for i in range(n):
            mini = seqs[i::n]
            if not mini:
                continue
            lr = float(self.optimizer.param_groups[0]["lr"])
            m = mstep.train_step(self.model, self.optimizer, self.plan(mini), step_cfg)
            if m["update_successful"]:
                self.scheduler.step(1)
            per_mb.append(m)
        out = summarise(per_mb)
        out["optim/lr"] = lr
        if before is not None and probe is not None:
            after = routing_snapshot(self.model, probe)
            out |= routing_flip_rate(before, after, probe, sequence_parallel=self.layout.sp)
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs besides model and optimizer (the schedule's position)."""
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])


def summarise(per_mb: list[dict[str, float]]) -> dict[str, float]:
    """One rollout step's metrics from its mini-batches' (see the module docstring)."""
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
