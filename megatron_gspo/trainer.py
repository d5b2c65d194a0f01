"""The pieces `train.py` wires together besides the policy (`megatron/policy.py`): the rollout
side and checkpoints.

Rank 0 of the job talks to the rollout engines and scores rewards; the resulting training
sequences are broadcast so that every rank plans the same micro-batches (balanced over the
data-parallel ranks by token count). Checkpoints are megatron-core distributed checkpoints of
the model and optimizer plus a small trainer state (step, data position, RNG).
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.algo import group_advantages
from megatron_gspo.checkpoint_guard import latest_checkpoint, write_manifest
from megatron_gspo.config import Config
from megatron_gspo.dist import barrier, free_port, rank
from megatron_gspo.megatron.checkpoint import load_model_and_optimizer, save_model_and_optimizer
from megatron_gspo.megatron.packing import TrainSequence
from megatron_gspo.megatron.policy import Policy
from megatron_gspo.rollout import RolloutEngine, SamplingParams
from megatron_gspo.testing import faults
from megatron_gspo.weights.convert import write_source_info


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
    from megatron_gspo.preflight import sglang_python
    from megatron_gspo.rewards.pool import build_reward_pool
    from megatron_gspo.rollout.launch import launch
    from megatron_gspo.rollout.sglang_client import SGLangClient

    r = cfg.rollout
    servers = None
    client = r.client
    if r.launch is not None:
        launch_cfg = r.launch
        if launch_cfg.base_port == 0:
            launch_cfg = dataclasses.replace(launch_cfg, base_port=free_port(launch_cfg.host))
        if launch_cfg.log_dir is None:
            launch_cfg = dataclasses.replace(
                launch_cfg, log_dir=str(Path(cfg.logging.dir) / "engines")
            )
        # One key: the engines we start demand the one our client sends.
        api_key = launch_cfg.api_key or client.api_key
        launch_cfg = dataclasses.replace(launch_cfg, api_key=api_key)
        if launch_cfg.backend == "sglang" and launch_cfg.python is None:
            # preflight has checked on every rank that this resolves
            launch_cfg = dataclasses.replace(launch_cfg, python=sglang_python())
        # device=cpu: ServerGroup adds the CPU engine's env (launch.cpu_engine_env).
        servers = launch(launch_cfg)
        client = dataclasses.replace(
            client,
            engine_urls=launch_cfg.engine_urls,
            router_url=client.router_url or launch_cfg.router_url,
            engine_tp_sizes=[launch_cfg.tp_size] * launch_cfg.num_engines,
            api_key=api_key,
        )
    engine = SGLangClient(client)
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
    temporary directory with a manifest of checksums (`checkpoint_guard`) and renamed, so a
    crash mid-save never leaves a half checkpoint under a final name."""
    root = Path(_checkpoint_dir(policy))
    final, tmp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    save_model_and_optimizer(policy.model, policy.optimizer, tmp)
    # hf_config/ + metadata: tools/convert_megatron_to_hf.py turns this step into a HF model
    write_source_info(tmp, policy.cfg.model.hf_path, policy.bridge, policy.model, policy.layout)
    state = {
        "step": step,
        "torch_rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "policy": policy.state_dict(),
    }
    torch.save(state, tmp / f"trainer_rank{rank()}.pt")
    if rollout is not None:
        torch.save(
            {"loader": rollout.loader.state_dict(), "next_seq_id": rollout.next_seq_id},
            tmp / "rollout.pt",
        )
    faults.point("checkpoint", step)
    barrier()
    write_manifest(tmp)  # collective; only a complete directory gets its final name
    if rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (root / "latest").write_text(final.name)
        keep = policy.cfg.checkpoint.keep_last
        old = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith("tmp"))
        for p in old[:-keep] if keep else []:
            shutil.rmtree(p, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(policy: Policy, rollout: Rollout | None) -> int:
    """Restore the latest checkpoint; returns the step to continue from (0 if none). Its
    integrity is checked before (`checkpoint_guard.verify`, in `train.main`)."""
    path = latest_checkpoint(_checkpoint_dir(policy))
    if path is None:
        return 0
    load_model_and_optimizer(policy.model, policy.optimizer, path)
    state = torch.load(path / f"trainer_rank{rank()}.pt", weights_only=True)
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["py_rng"])
    policy.load_state_dict(state["policy"])
    if rollout is not None:
        ro = torch.load(path / "rollout.pt", weights_only=True)
        rollout.loader.load_state_dict(ro["loader"])
        rollout.next_seq_id = ro["next_seq_id"]
    return int(state["step"])


def _checkpoint_dir(policy: Policy) -> str:
    directory = policy.cfg.checkpoint.dir
    if directory is None:  # the config refuses resume/save_every without it; callers check
        raise ValueError("checkpoint.dir is not set")
    return directory
