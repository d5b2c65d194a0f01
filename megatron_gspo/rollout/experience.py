"""The experience of one RL step: prompts -> engine samples -> rewards -> advantages -> sequences.

Rank 0 of the job talks to the rollout engines and scores rewards; the resulting training
sequences are broadcast (by `train.py`) so that every rank plans the same micro-batches.
Knows the engines only through `engines.protocols`; imports no Megatron.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from megatron_gspo.algo import group_advantages, overlong_penalty
from megatron_gspo.algo.sequences import TrainSequence
from megatron_gspo.engines.protocols import RolloutEngine
from megatron_gspo.engines.types import Sample, SamplingParams
from megatron_gspo.rollout.driver import RolloutDriver
from megatron_gspo.rollout.scheduler import GroupFn, GroupScheduler, PromptQueue, SchedulerConfig
from megatron_gspo.rollout.spec import RolloutSpec

if TYPE_CHECKING:
    from megatron_gspo.agents.runner import AgentRollout
    from megatron_gspo.data.prompts import PromptDataset, PromptLoader
    from megatron_gspo.data.records import PromptRecord
    from megatron_gspo.data.tokenizer import Tokenizer
    from megatron_gspo.engines.connect import LaunchedEngines
    from megatron_gspo.engines.launch import ServerGroup
    from megatron_gspo.envs.pool import EnvPool
    from megatron_gspo.rewards.batch import RewardScorer


@dataclass
class Rollout:
    """Rank 0's side: prompts -> engine samples -> rewards -> advantages -> sequences.

    Groups come from a `GroupScheduler` (over-sampling, dynamic sampling, partial rollouts)
    run by a `RolloutDriver` (synchronous, or `rollout.max_staleness` steps ahead with
    `rollout.async_rollout`); the loop sees the same three calls in every mode: `next_batch`,
    and `before_push` / `after_push(version)` around each weight push."""

    spec: RolloutSpec
    """What it reads of the run (`Config.rollout_spec()`)."""
    engine: RolloutEngine
    tokenizer: Tokenizer
    loader: PromptLoader
    rewards: RewardScorer
    next_seq_id: int = 0
    servers: ServerGroup | None = None
    group_fn: GroupFn | None = None
    """Generates one group (default: one `agenerate` call); `rollout.env`: the multi-turn
    `MultiTurn.group_fn` (`make_multiturn`)."""
    envs: EnvPool | AgentRollout | None = None
    """rollout.env: the `EnvPool` of the env workers (closed with the rollout)."""
    _reward_batches: list[Any] = field(default_factory=list)
    reward_errors: list[str] = field(default_factory=list)
    """The first reward errors of the last step (for the message of a stop)."""
    driver: RolloutDriver = field(init=False)

    def __post_init__(self) -> None:
        self.driver = self._driver()

    def _driver(self) -> RolloutDriver:
        r, spec = self.spec.rollout, self.spec
        sched_cfg = SchedulerConfig.from_rollout(
            r, prompts=spec.prompts_per_rollout, group_size=spec.group_size
        )
        # make_rollout's loader reads a PromptDataset (PromptLoader takes any sequence)
        dataset = cast("PromptDataset", self.loader.dataset)
        queue = PromptQueue(self.loader, dataset.encode)
        scheduler = GroupScheduler(
            self.engine, queue, self._score, sched_cfg, self.sampling(), group_fn=self.group_fn
        )
        # k steps ahead: the batch for version v + j is trained j pushes later, so with
        # k = max_staleness no token of a fresh fill can break the bound
        return RolloutDriver(scheduler, lookahead=r.max_staleness if r.async_rollout else 0)

    def sampling(self) -> SamplingParams:
        """Base sampling; the scheduler offsets the seed by the sequences handed out so far."""
        r = self.spec.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_token_ids=tuple(t for t in [self.tokenizer.eos_token_id] if t is not None),
            seed=self.spec.seed * 7919,
        )

    def _score(
        self, record: PromptRecord, samples: list[Sample]
    ) -> tuple[list[float], dict[str, float]]:
        """One group's rewards: an episode's env reward wins; `reward.kind` scores the rest."""
        texts = [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
        todo = [i for i, s in enumerate(samples) if s.env_reward is None]
        k = len(todo)
        scored = self.rewards.score(
            [record.prompt] * k, [texts[i] for i in todo], [record.answer] * k
        )
        values: list[float] = [s.env_reward or 0.0 for s in samples]
        for i, r in zip(todo, scored.rewards, strict=True):
            values[i] = r
        self._reward_batches.append(scored)
        if self.spec.reward.overlong_buffer:  # DAPO: part of the reward dynamic sampling sees
            pen = self._overlong(samples)
            values = [v + p for v, p in zip(values, pen.tolist(), strict=True)]
        return values, scored.metrics()

    def _overlong(self, samples: list[Sample]) -> torch.Tensor:
        """[B] DAPO soft overlong penalty of each sample (reward.overlong_buffer)."""
        r = self.spec.reward
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        cap = self.spec.rollout.episode_tokens  # max_new_tokens for single-turn rollouts
        return overlong_penalty(lengths, cap, r.overlong_buffer, r.overlong_penalty)

    def before_push(self) -> None:
        """Before a weight push: in-flight generation (async mode) stops and keeps its tokens."""
        self.driver.pause()

    def after_push(self, version: int) -> None:
        """The engines serve `version` now; generation goes on."""
        self.driver.resume(version)

    def next_batch(self) -> tuple[list[TrainSequence], dict[str, float]]:
        batch, wait = self.driver.next_batch()
        samples = [s for grp in batch.groups for s in grp.samples]
        extra = self._step_reports(samples)
        flat = [r for grp in batch.groups for r in grp.rewards]
        rewards = torch.tensor(flat, dtype=torch.float64)
        groups = torch.tensor([k for k, grp in enumerate(batch.groups) for _ in grp.samples])
        adv = group_advantages(
            rewards, groups, eps=self.spec.adv_eps, normalize_std=self.spec.normalize_std
        )
        seqs = [
            self._sequence(s, a, r, g)
            for s, a, r, g in zip(samples, adv.tolist(), flat, groups.tolist(), strict=True)
        ]
        # loss.mask_truncated (DAPO overlong filtering): out of the loss (and its normaliser)
        # after their group's advantages were computed with them.
        masked = [s.truncated for s in samples] if self.spec.mask_truncated else []
        if any(masked):
            seqs = [q for q, m in zip(seqs, masked, strict=True) if not m]
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
        zero_var = [float(rewards[groups == i].std(unbiased=False) == 0) for i in groups.unique()]
        stats = batch.stats
        stats.num_samples = len(samples)
        stats.num_truncated = sum(s.finish_reason == "length" for s in samples)
        stats.num_aborted = sum(s.finish_reason == "abort" for s in samples)
        stats.num_masked_logprobs = sum(len(s.logprobs) - s.num_valid_logprobs for s in samples)
        stats.wall_s = batch.wall_s
        reward_time = batch.reward_metrics.get("reward/time_s", 0.0)
        metrics = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item(),
            "reward/zero_variance_groups": sum(zero_var) / len(zero_var),
            "response/length_mean": lengths.mean().item(),
            "response/length_max": lengths.max().item(),
            "response/truncated_frac": sum(s.truncated for s in samples) / len(samples),
            "time/rollout_s": batch.wall_s,
            "time/reward_s": reward_time,
            **batch.metrics(),
            **stats.as_metrics(),
            **wait,
            **extra,
        }
        if self.spec.mask_truncated:
            metrics["loss/truncated_masked"] = float(sum(masked))
        if self.spec.reward.overlong_buffer:
            pen = self._overlong(samples)
            metrics["reward/overlong_penalty"] = pen.mean().item()
            metrics["reward/overlong_frac"] = (pen < 0).double().mean().item()
        return seqs, metrics

    def _step_reports(self, samples: list[Sample]) -> dict[str, float]:
        """Print reward / env failures once per step (a broken user function is loud); the
        multi-turn episode metrics."""
        from megatron_gspo.rewards.pool import RewardBatch

        parts, self._reward_batches = self._reward_batches, []
        step = RewardBatch(
            rewards=[r for b in parts for r in b.rewards],
            timeouts=sum(b.timeouts for b in parts),
            failures=sum(b.failures for b in parts),
            errors=[e for b in parts for e in b.errors][:5],
        )
        if (report := step.report()) is not None:
            print(f"[step rollout] {report}", file=sys.stderr, flush=True)
        # Every reward call failed: the step trains on nothing (train.max_failed_reward_steps)
        calls = len(step.rewards)
        failed = {"reward/failed_frac": (step.failures + step.timeouts) / calls if calls else 0.0}
        self.reward_errors = step.errors
        if self.envs is None:
            return failed
        from megatron_gspo.rollout.multiturn import episode_metrics

        env_metrics, report = self.envs.take_report()
        if report is not None:
            print(f"[step rollout] {report}", file=sys.stderr, flush=True)
        return {**failed, **env_metrics, **episode_metrics(samples)}

    def _sequence(self, s: Sample, advantage: float, reward: float, group: int) -> TrainSequence:
        mask = [int(m) for m in s.logprob_mask]
        old = [lp if m else 0.0 for lp, m in zip(s.logprobs, mask, strict=True)]
        seq = TrainSequence(
            seq_id=self.next_seq_id,
            prompt_ids=s.prompt_ids,
            response_ids=s.response_ids,
            old_logp=old,
            advantage=advantage,
            loss_mask=mask,
            reward=reward,
            group=group,
            routed_experts=s.routed_experts.indices if s.routed_experts is not None else None,
        )
        self.next_seq_id += 1
        return seq

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.driver.state_dict(), "next_seq_id": self.next_seq_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from megatron_gspo.data.prompts import PromptRecord

        self.driver.load_state_dict(state["scheduler"], PromptRecord)
        self.next_seq_id = state["next_seq_id"]

    def close(self) -> None:
        self.driver.close()
        self.rewards.close()
        if self.envs is not None:
            self.envs.close()
        if self.servers is not None:
            self.servers.shutdown()


def make_rollout(
    spec: RolloutSpec,
    launched: LaunchedEngines | None = None,
    tokenizer: Tokenizer | None = None,
) -> Rollout:
    """Rank 0: connect to the engines (`launched`: those `engines.nodes.start_node_engines`
    started on every node; None with `rollout.launch` set: start them here, a one-process
    job), load prompts and rewards. `tokenizer`: the run's, as preflight loaded it (None: load
    it here)."""
    from megatron_gspo.data.fit import load_run_tokenizer, prompt_limits
    from megatron_gspo.data.prompts import PromptDataset, PromptLoader
    from megatron_gspo.engines.connect import connect
    from megatron_gspo.rewards.pool import build_reward_pool

    r = spec.rollout
    engine, servers = connect(
        r.launch, r.client, log_dir=Path(spec.log_dir) / "engines", launched=launched
    )
    if tokenizer is None:
        tokenizer = load_run_tokenizer(spec.hf_path, spec.tokenizer_path)
    # Prompts that cannot fit the engine's context with the response budget (an HTTP 400 at
    # the step that samples one), or whose sequence no micro-batch holds with a whole response
    # (train.micro_batch_tokens silently exceeded; issue 40): dropped here, counted. None left
    # was refused by preflight already (data.fit.check_prompts_fit, the same limits).
    context, fit = prompt_limits(spec.hf_path, r, spec.micro_batch_tokens)
    dataset = PromptDataset.from_config(spec.data, tokenizer, context, fit=fit)
    loader = PromptLoader(
        dataset, spec.prompts_per_rollout, seed=spec.data.seed, shuffle=spec.data.shuffle
    )
    group_fn: GroupFn | None = None
    envs: EnvPool | AgentRollout | None = None
    if r.env is not None:
        group_fn, envs = make_multiturn(spec, engine, tokenizer)
    if r.agent is not None:  # rollout.agent: the endpoint and the agent workers
        from megatron_gspo.agents.runner import make_agent_rollout

        group_fn, envs = make_agent_rollout(spec, engine, tokenizer)
    rewards = build_reward_pool(spec.reward, spec.sandbox)
    return Rollout(
        spec, engine, tokenizer, loader, rewards, servers=servers, group_fn=group_fn, envs=envs
    )


def make_multiturn(
    spec: RolloutSpec, engine: RolloutEngine, tokenizer: Tokenizer
) -> tuple[GroupFn, EnvPool]:
    """rollout.env: the env worker pool and the multi-turn `group_fn` over `engine`."""
    from megatron_gspo.config_io import ConfigError
    from megatron_gspo.data.fit import turn_stop_ids
    from megatron_gspo.engines.connect import per_engine_clients
    from megatron_gspo.envs.pool import EnvPool
    from megatron_gspo.rewards.pool import worker_limits
    from megatron_gspo.rollout.multiturn import MultiTurn, ObservationCodec

    r = spec.rollout
    stop_ids = turn_stop_ids(tokenizer, r.turn_stop)  # checked by preflight already
    try:
        codec = ObservationCodec(tokenizer, chat_template=spec.data.chat_template)
        envs = EnvPool(
            r.env or "",
            num_workers=r.env_workers,
            timeout_s=r.env_timeout_s,
            limits=worker_limits(spec.sandbox, r.env_timeout_s),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    multi = MultiTurn(
        engine,
        tokenizer,
        envs,
        codec,
        max_turns=r.max_turns,
        max_total_tokens=r.episode_tokens,
        stop_ids=tuple(stop_ids),
        engines=per_engine_clients(engine),
    )
    return multi.group_fn, envs
