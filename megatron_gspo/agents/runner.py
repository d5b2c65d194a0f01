"""Agent episodes for the rollout: `rollout.agent: module:function` in sandbox workers, each with
an OpenAI client on the agent endpoint, turned into training samples token-exact.

`AgentRollout.group_fn(record, prompt_ids, sampling, n, prompt_index)` has the scheduler's
`GroupFn` shape (as `MultiTurn.group_fn`): it runs `n` episodes of the agent on `record`
concurrently (at most one per worker at a time), each under its own trajectory id, and returns
one `Sample` per episode, sorted by sample index:

* the episode's sample is its trajectory's last final turn (`agents.trajectory.to_samples`: the
  branch the agent ended on); other final branches (an agent that forked its conversation) are
  dropped and counted (`extra_branches`);
* the agent's return value is the reward (`Sample.env_reward`); None leaves it to
  `reward.kind`, which scores the decoded response of that sample; the episode is finished
  (`finish_reason` "stop", not truncated) whatever its last call's finish reason, as an episode
  its env ended is;
* an agent that raised, timed out, killed its worker or made no call is returned marked
  `Sample.failed` ("agent: ..."): the scheduler leaves it out of the group and counts it.

`prompt_ids` is unused: the agent writes its own messages from the record, and the endpoint
renders them with the model's chat template.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from collections import Counter
from typing import TYPE_CHECKING, Any

from megatron_gspo.agents.trajectory import TrajectoryStore, to_samples
from megatron_gspo.engines.protocols import Sampler
from megatron_gspo.engines.types import Sample, SamplingParams
from megatron_gspo.sandbox.pool import WorkerCallError, WorkerPool
from megatron_gspo.sandbox.process import WorkerLimits

if TYPE_CHECKING:
    from megatron_gspo.agents.server import AgentEndpoint
    from megatron_gspo.data.records import PromptRecord
    from megatron_gspo.data.tokenizer import Tokenizer
    from megatron_gspo.rollout.scheduler import GroupFn
    from megatron_gspo.rollout.spec import RolloutSpec

__all__ = ["AgentPool", "AgentRollout", "make_agent_rollout"]

_MAX_ERRORS_KEPT = 8


class AgentPool:
    """`num_workers` agent worker processes for `spec` ("module:function")."""

    def __init__(
        self,
        spec: str,
        *,
        num_workers: int = 2,
        timeout_s: float = 600.0,
        limits: WorkerLimits | None = None,
    ) -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"need num_workers >= 1 and timeout_s > 0, got {num_workers}")
        self.spec, self.timeout_s = spec, timeout_s
        self._pool = WorkerPool(  # `sandbox/pool.py`: a bad spec raises the worker's message
            "agent",
            spec,
            num_workers=num_workers,
            timeout_s=timeout_s,
            timeout_key="rollout.agent_timeout_s",
            limits=limits,
        )
        self.limits = self._pool.limits
        self._free: asyncio.Queue[int] | None = None
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @property
    def worker_pids(self) -> list[int]:
        return self._pool.worker_pids

    def _call(self, slot: int, msg: dict[str, Any]) -> tuple[float | None, str | None]:
        try:
            reply = self._pool.call(slot, msg)  # a timeout or crash replaces the worker
        except WorkerCallError as e:
            return None, str(e)
        return reply.get("reward"), reply.get("error")

    async def run(
        self, record: dict[str, Any], base_url: str, trajectory_id: str
    ) -> tuple[float | None, str | None]:
        """One episode in the next free worker: (reward or None, error or None)."""
        if self._free is None:  # bound to the loop that runs episodes
            self._free = asyncio.Queue()
            for i in range(self._pool.num_workers):
                self._free.put_nowait(i)
        slot = await self._free.get()
        msg = {
            "id": next(self._ids),
            "record": record,
            "base_url": base_url,
            "trajectory_id": trajectory_id,
            "timeout_s": self.timeout_s,
        }
        try:
            return await asyncio.to_thread(self._call, slot, msg)
        finally:
            self._free.put_nowait(slot)

    def close(self) -> None:
        self._pool.close()


class AgentRollout:
    """The rollout's side of `rollout.agent` (see the module docstring)."""

    def __init__(self, pool: AgentPool, store: TrajectoryStore, endpoint_url: str) -> None:
        self.pool, self.store, self.url = pool, store, endpoint_url
        self.counts: Counter = Counter()
        """`episodes`, `failed`, `extra_branches`, and the endpoint's per-call counts
        (`continued`, `replaced`, `unmatched`, `refused`, `aborted`) summed over episodes."""
        self.errors: list[str] = []
        self.endpoint: AgentEndpoint | None = None
        """The endpoint this rollout started (stopped by `close`), if any."""

    async def group_fn(
        self,
        record: PromptRecord,
        prompt_ids: list[int],
        sampling: SamplingParams,
        n: int,
        prompt_index: int,
    ) -> list[Sample]:
        """`n` agent episodes for one prompt (see the module docstring)."""
        rec = _record_dict(record)
        return list(await asyncio.gather(*(self.episode(rec, prompt_index, j) for j in range(n))))

    async def episode(self, record: dict[str, Any], prompt_index: int, j: int) -> Sample:
        tid = f"p{prompt_index}-s{j}-{uuid.uuid4().hex[:10]}"
        reward, error = await self.pool.run(record, self.url, tid)
        traj = self.store.pop(tid)
        self.counts["episodes"] += 1
        if traj is not None:
            self.counts.update(traj.counts)
        samples = to_samples(traj, prompt_index=prompt_index) if traj is not None else []
        if error is None and not samples:
            error = "the agent made no chat-completion call"
        if error is not None:
            self.counts["failed"] += 1
            if len(self.errors) < _MAX_ERRORS_KEPT:
                self.errors.append(error)
            return Sample(
                prompt_ids=[],
                response_ids=[],
                logprobs=[],
                finish_reason="abort",
                truncated=True,
                weight_version="",
                engine_id="",
                prompt_index=prompt_index,
                sample_index=j,
                failed=f"agent: {error}",
                meta={"trajectory_id": tid},
            )
        self.counts["extra_branches"] += len(samples) - 1
        sample = samples[-1]
        # The agent ended its episode: finished, as a multi-turn episode its env ended is
        # (rollout/multiturn.py), even if its last call ran to max_tokens; otherwise
        # loss.mask_truncated would drop from the loss agent episodes the Env path trains on.
        sample.finish_reason, sample.truncated = "stop", False
        sample.sample_index = j
        sample.env_reward = reward
        return sample

    def take_report(self) -> tuple[dict[str, float], str | None]:
        """`agent/*` counters since the last call (metrics) and a stderr block with the first
        errors (None when no agent failed); resets them. The slot `Rollout.envs` reads."""
        counts, errors = self.counts, self.errors
        self.counts, self.errors = Counter(), []
        keys = (
            "episodes",
            "failed",
            "extra_branches",
            "continued",
            "replaced",
            "unmatched",
            "refused",
            "aborted",
        )
        metrics = {f"agent/{k}": float(counts[k]) for k in keys}
        if not counts["failed"]:
            return metrics, None
        head = f"[agent] {counts['failed']} agent episodes failed; first errors:"
        return metrics, "\n".join([head, *(f"  {e}" for e in errors)])

    def close(self) -> None:
        self.pool.close()
        if self.endpoint is not None:
            self.endpoint.stop()


def make_agent_rollout(
    cfg: RolloutSpec, engine: Sampler, tokenizer: Tokenizer
) -> tuple[GroupFn, AgentRollout]:
    """rollout.agent: the endpoint in front of `engine` (sampling forced to the rollout's
    temperature and top_p, calls capped at rollout.max_new_tokens), the agent workers, and the
    `group_fn` over them."""
    from megatron_gspo.agents.config import AgentEndpointConfig
    from megatron_gspo.agents.server import AgentEndpoint
    from megatron_gspo.config_io import ConfigError
    from megatron_gspo.rewards.pool import worker_limits

    r = cfg.rollout
    assert r.agent is not None, "called for rollout.agent only"
    try:
        endpoint = AgentEndpoint(
            engine,
            tokenizer,
            AgentEndpointConfig(
                temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens
            ),
        )
        pool = AgentPool(
            r.agent,
            num_workers=r.agent_workers,
            timeout_s=r.agent_timeout_s,
            limits=worker_limits(cfg.sandbox, r.agent_timeout_s),
        )
    except ValueError as e:  # no chat template; an agent that cannot be imported
        raise ConfigError(str(e)) from None
    url = endpoint.start()
    rollout = AgentRollout(pool, endpoint.store, url)
    rollout.endpoint = endpoint
    return rollout.group_fn, rollout


def _record_dict(record: PromptRecord | dict[str, Any]) -> dict[str, Any]:
    """A `PromptRecord` (or a dict) as the JSON dict the agent receives."""
    if isinstance(record, dict):
        return record
    return {k: getattr(record, k, None) for k in ("index", "prompt", "messages", "answer", "meta")}
