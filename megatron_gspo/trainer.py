"""The pieces `train.py` wires together: setup, rollout, the policy update, checkpoints.

Rank 0 of the job talks to the rollout engines and scores rewards; the resulting training
sequences are broadcast so that every rank plans the same micro-batches (balanced over the
data-parallel ranks by token count). Checkpoints are megatron-core distributed checkpoints of
the model and optimizer plus a small trainer state (step, data position, RNG).
"""

from __future__ import annotations

import math
import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.algo import PolicyLossConfig, group_advantages
from megatron_gspo.config import Config
from megatron_gspo.megatron import step as mstep
from megatron_gspo.megatron.checkpoint import load_model_and_optimizer, save_model_and_optimizer
from megatron_gspo.megatron.model import (
    Layout,
    build_model,
    build_optimizer,
    ddp_config,
    init_megatron,
    load_bridge,
    make_provider,
    quiet_megatron,
)
from megatron_gspo.megatron.packing import TrainSequence
from megatron_gspo.megatron.routing import RoutingRecorder, routing_flip_rate, routing_snapshot
from megatron_gspo.rollout import RolloutEngine, SamplingParams
from megatron_gspo.weights.convert import write_source_info


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def broadcast(obj: Any, src: int = 0) -> Any:
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def init_distributed() -> None:
    """torchrun's env:// rendezvous; gloo on CPU, nccl on GPU."""
    if torch.distributed.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" not in os.environ:  # plain `python -m megatron_gspo.train`: one rank
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", "29511"),
        )
    torch.distributed.init_process_group(backend)


@dataclass
class Policy:
    """The Megatron side: model chunks, optimizer and how to plan micro-batches."""

    cfg: Config
    bridge: Any
    model: list[torch.nn.Module]
    optimizer: Any
    layout: Layout
    loss: PolicyLossConfig

    @classmethod
    def build(cls, cfg: Config) -> Policy:
        quiet_megatron()
        p = cfg.parallel
        layout = Layout.from_config(p)
        init_megatron(layout, seed=cfg.train.seed)
        bridge = load_bridge(cfg.model.hf_path)
        hf = bridge.hf_pretrained.config
        p.validate_world(
            torch.distributed.get_world_size(),
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None),
            num_experts=getattr(hf, "num_experts", None),
        )
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
            cfg.model.dtype
        ]
        provider = make_provider(
            bridge, layout, dtype=dtype, moe_aux_loss_coeff=cfg.model.moe_aux_loss_coef
        )
        o = cfg.optim
        model = build_model(
            provider,
            ddp_config=ddp_config(o.use_distributed_optimizer),
            load_from=bridge if cfg.model.load_weights else None,
        )
        optimizer = build_optimizer(
            model,
            lr=o.lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            use_distributed_optimizer=o.use_distributed_optimizer,
        )
        g = cfg.gspo
        loss = PolicyLossConfig(
            kind=g.algorithm,
            eps_low=g.eps_low,
            eps_high=g.eps_high,
            log_ratio_clamp=g.log_ratio_clamp,
            tis_mode=g.mismatch_correction,
            tis_cap=g.mismatch_cap,
        )
        return cls(cfg, bridge, model, optimizer, layout, loss)

    def plan(self, seqs: Sequence[TrainSequence]) -> list:
        return mstep.plan_for_this_rank(seqs, self.layout, self.cfg.train.micro_batch_tokens)

    def update(self, seqs: list[TrainSequence], step: int) -> dict[str, float]:
        """Recompute pi_old if asked, then one optimizer step per mini-batch (paper: 4);
        measure the routing drift this update causes (every `train.routing_flip_every` steps)."""
        temperature = self.cfg.rollout.temperature
        if self.cfg.gspo.pi_old == "recompute":
            fresh = mstep.compute_logprobs(self.model, self.plan(seqs), temperature=temperature)
            for s in seqs:
                s.rollout_logp, s.old_logp = list(s.old_logp), fresh[s.seq_id].tolist()
        step_cfg = mstep.StepConfig(loss=self.loss, temperature=temperature)
        n = self.cfg.gspo.mini_batches_per_rollout
        every = self.cfg.train.routing_flip_every
        before = probe = None
        if every and step % every == 0 and RoutingRecorder(self.model).routers:
            probe = self.plan(seqs[::n])[: self.layout.pp if self.layout.vpp else 1]
            before = routing_snapshot(self.model, probe)
        per_mb: list[dict[str, float]] = []
        for i in range(n):
            mini = seqs[i::n]
            if mini:
                per_mb.append(
                    mstep.train_step(self.model, self.optimizer, self.plan(mini), step_cfg)
                )
        out = {k: sum(m[k] for m in per_mb) / len(per_mb) for k in per_mb[0]}
        # On the first mini-batch the trainer has not moved yet: all of the ratio is mismatch.
        for k in ("mismatch/abs_logp_diff", "policy/clip_frac", "policy/seq_log_ratio_abs"):
            if k in per_mb[0]:
                out[f"first_mb/{k}"] = per_mb[0][k]
        if before is not None and probe is not None:
            after = routing_snapshot(self.model, probe)
            out |= routing_flip_rate(before, after, probe, sequence_parallel=self.layout.sp)
        return out


@dataclass
class Rollout:
    """Rank 0's side: prompts -> engine samples -> rewards -> advantages -> sequences."""

    cfg: Config
    engine: RolloutEngine
    tokenizer: Any
    loader: Any
    rewards: Any
    next_seq_id: int = 0
    servers: Any = None
    stats: dict[str, float] = field(default_factory=dict)

    def sampling(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_token_ids=tuple(t for t in [self.tokenizer.eos_token_id] if t is not None),
            seed=self.cfg.train.seed * 7919 + self.next_seq_id,
        )

    def collect(self) -> tuple[list[TrainSequence], dict[str, float]]:
        t0 = time.perf_counter()
        records = self.loader.next_batch()
        prompts = [self.loader.dataset.encode(r) for r in records]
        g = self.cfg.gspo.group_size
        result = self.engine.generate(prompts, self.sampling(), n=g)
        t_gen = time.perf_counter() - t0
        samples = result.samples
        texts = [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
        scored = self.rewards.score(
            [records[s.prompt_index].prompt for s in samples],
            texts,
            [records[s.prompt_index].answer for s in samples],
        )
        rewards = torch.tensor(scored.rewards, dtype=torch.float64)
        groups = torch.tensor([s.prompt_index for s in samples])
        adv = group_advantages(
            rewards, groups, eps=self.cfg.gspo.adv_eps, normalize_std=self.cfg.gspo.normalize_std
        )
        seqs = []
        for s, a in zip(samples, adv.tolist(), strict=True):
            mask = [int(m) for m in s.logprob_mask]
            old = [lp if m else 0.0 for lp, m in zip(s.logprobs, mask, strict=True)]
            seqs.append(
                TrainSequence(
                    seq_id=self.next_seq_id,
                    prompt_ids=s.prompt_ids,
                    response_ids=s.response_ids,
                    old_logp=old,
                    advantage=a,
                    loss_mask=mask,
                )
            )
            self.next_seq_id += 1
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
        zero_var = [float(rewards[groups == i].std(unbiased=False) == 0) for i in groups.unique()]
        metrics = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item(),
            "reward/zero_variance_groups": sum(zero_var) / len(zero_var),
            "response/length_mean": lengths.mean().item(),
            "response/length_max": lengths.max().item(),
            "response/truncated_frac": sum(s.truncated for s in samples) / len(samples),
            "time/rollout_s": t_gen,
            "time/reward_s": time.perf_counter() - t0 - t_gen,
            **scored.metrics(),
            **result.stats.as_metrics(),
        }
        return seqs, metrics

    def close(self) -> None:
        self.rewards.close()
        if self.servers is not None:
            self.servers.shutdown()


def make_rollout(cfg: Config) -> Rollout:
    """Rank 0: start (or connect to) the engines, load prompts, tokenizer and rewards."""
    from transformers import AutoTokenizer

    from megatron_gspo.data.prompts import PromptDataset, PromptLoader
    from megatron_gspo.rewards.pool import build_reward_pool
    from megatron_gspo.rollout.launch import LaunchConfig, launch
    from megatron_gspo.rollout.sglang_client import ClientConfig, SGLangClient

    r = cfg.rollout
    servers = None
    if r.embedded:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        servers = launch(
            LaunchConfig(
                model_path=cfg.model.hf_path,
                backend="embedded",
                num_engines=r.num_embedded_engines,
                base_port=port,
                log_dir=str(Path(cfg.logging.dir) / "engines"),
            )
        )
        urls = servers.cfg.engine_urls
    else:
        urls = list(r.engines)
    engine = SGLangClient(
        ClientConfig(
            engine_urls=urls, router_url=r.router_url, request_timeout_s=r.request_timeout_s
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.hf_path)
    dataset = PromptDataset.from_config(cfg.data, tokenizer)
    loader = PromptLoader(
        dataset, cfg.gspo.prompts_per_rollout, seed=cfg.data.seed, shuffle=cfg.data.shuffle
    )
    return Rollout(cfg, engine, tokenizer, loader, build_reward_pool(cfg.reward), servers=servers)


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------
def save_checkpoint(policy: Policy, rollout: Rollout | None, step: int) -> Path:
    """Model + optimizer (megatron-core dist checkpoint) and trainer state, written to a
    temporary directory and renamed, so a crash mid-save never leaves a half checkpoint."""
    root = Path(policy.cfg.checkpoint.dir)
    final, tmp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    torch.distributed.barrier()
    save_model_and_optimizer(policy.model, policy.optimizer, tmp)
    # hf_config/ + metadata: tools/convert_megatron_to_hf.py turns this step into a HF model
    write_source_info(tmp, policy.cfg.model.hf_path, policy.bridge, policy.model, policy.layout)
    state = {"step": step, "torch_rng": torch.get_rng_state(), "py_rng": random.getstate()}
    torch.save(state, tmp / f"trainer_rank{rank()}.pt")
    if rollout is not None:
        torch.save(
            {"loader": rollout.loader.state_dict(), "next_seq_id": rollout.next_seq_id},
            tmp / "rollout.pt",
        )
    torch.distributed.barrier()
    if rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (root / "latest").write_text(final.name)
        keep = policy.cfg.checkpoint.keep_last
        old = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith("tmp"))
        for p in old[:-keep] if keep else []:
            shutil.rmtree(p, ignore_errors=True)
    torch.distributed.barrier()
    return final


def load_checkpoint(policy: Policy, rollout: Rollout | None) -> int:
    """Restore the latest checkpoint; returns the step to continue from (0 if none)."""
    latest = Path(policy.cfg.checkpoint.dir) / "latest"
    if not latest.exists():
        return 0
    path = latest.parent / latest.read_text().strip()
    load_model_and_optimizer(policy.model, policy.optimizer, path)
    state = torch.load(path / f"trainer_rank{rank()}.pt", weights_only=False)
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["py_rng"])
    if rollout is not None:
        ro = torch.load(path / "rollout.pt", weights_only=False)
        rollout.loader.load_state_dict(ro["loader"])
        rollout.next_seq_id = ro["next_seq_id"]
    return int(state["step"])


def finite_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
