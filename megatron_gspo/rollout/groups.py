"""What the rollout scheduler hands around: its config (`SchedulerConfig`), one prompt's group on
its way to the trainer (`Group`), one fill's result and its metrics (`Batch`), and the per-sample
rules every mode shares: when a response is finished (`sample_done`), how a continued response
is joined to its first part (`extend_sample`: ids, engine log-probs and per-token weight
versions), and the staleness bound (`check_staleness`). Pure data, no asyncio
(`rollout/scheduler.py` runs them).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Self

from megatron_gspo.engines.types import RolloutStats, Sample

if TYPE_CHECKING:
    from megatron_gspo.data.records import PromptRecord
    from megatron_gspo.rollout.config import RolloutConfig


class StalenessError(RuntimeError):
    """A batch holds a token older than the staleness bound allows."""


@dataclasses.dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """What `GroupScheduler` needs from `gspo` and `rollout` (see `RolloutConfig`)."""

    prompts: int
    group_size: int
    max_new_tokens: int
    oversample: float = 1.0
    drop_equal_reward_groups: bool = False
    partial_tokens: int | None = None
    max_staleness: int = 1
    fill_attempts: int = 4
    max_continuation_retries: int = 3

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, *, prompts: int, group_size: int) -> Self:
        """The run's scheduler config: `prompts` and `group_size` (the rl: section's), every
        other field from the `rollout:` key of the same name (one list: this class's)."""
        given = ("prompts", "group_size")
        rest = {
            f.name: getattr(rollout, f.name) for f in dataclasses.fields(cls) if f.name not in given
        }
        return cls(prompts=prompts, group_size=group_size, **rest)

    @property
    def width(self) -> int:
        """Groups generated concurrently."""
        return math.ceil(self.prompts * self.oversample - 1e-9)

    @property
    def chunk(self) -> int:
        """New tokens one request may ask for."""
        return min(self.partial_tokens or self.max_new_tokens, self.max_new_tokens)


@dataclasses.dataclass(kw_only=True, slots=True)
class Group:
    """One prompt's group on its way to the trainer."""

    uid: int
    """Unique per scheduler (identity checks: a group is returned at most once)."""
    record: PromptRecord
    prompt_ids: list[int]
    slot: int = 0
    """Position in the fill that (re)started it; seeds sampling as `prompt_index` did."""
    samples: list[Sample] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    reward_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    rids: list[str] = dataclasses.field(default_factory=list)
    """Request ids in flight (empty between requests, or when a custom group_fn runs)."""
    chunks: int = 0
    seed: int | None = None
    rejected: int = 0
    """Samples the client rejected (ids vs log-probs): left out, the group is short."""
    failed: int = 0
    """Episodes that failed (`Sample.failed`, or missing from a custom group_fn's
    answer): left out, the group is short."""
    rejects: Counter = dataclasses.field(default_factory=Counter)
    """Sample index -> continuations rejected in a row."""

    def complete(self, max_new_tokens: int) -> bool:
        return bool(self.samples) and all(sample_done(s, max_new_tokens) for s in self.samples)

    def oldest_version(self) -> int | None:
        versions = [v for s in self.samples for v in s.token_versions]
        return min(versions) if versions else None


@dataclasses.dataclass(kw_only=True, slots=True)
class Batch:
    """One fill's result: `prompts` kept groups (in launch order) and the fill's counters."""

    groups: list[Group]
    target_version: int
    counts: Counter
    stats: RolloutStats
    reward_metrics: dict[str, float]
    wall_s: float
    max_staleness: int = 1
    """The bound the batch was filled under (the staleness histogram's last bin)."""

    def metrics(self) -> dict[str, float]:
        """`rollout/` counters and staleness, `reward/` scoring counters.

        Staleness of a token: `target_version` minus the version that sampled it. Per token:
        `rollout/staleness_mean`, `_max`; per sample, by its oldest token (what the bound
        checks): `rollout/sample_staleness_{k}` for k = 0..max_staleness, the share of the
        batch's samples whose oldest token is k versions behind (every bin logged every step,
        so each is a curve)."""
        versions = [v for g in self.groups for s in g.samples for v in s.token_versions]
        stale = [self.target_version - v for v in versions]
        per_sample = [
            self.target_version - min(s.token_versions)
            for g in self.groups
            for s in g.samples
            if s.token_versions
        ]
        out = {f"rollout/groups_{k}": float(self.counts[k]) for k in _COUNTS}
        out |= {
            "rollout/groups_rejected": float(sum(g.rejected > 0 for g in self.groups)),
            "rollout/groups_failed": float(sum(g.failed > 0 for g in self.groups)),
            "rollout/samples_rejected": float(self.counts["samples_rejected"]),
            "rollout/samples_failed": float(self.counts["samples_failed"]),
            "rollout/staleness_mean": sum(stale) / len(stale) if stale else 0.0,
            "rollout/staleness_max": float(max(stale, default=0)),
            "rollout/continued_samples": float(
                sum(s.chunks > 1 for g in self.groups for s in g.samples)
            ),
        }
        for k in range(max(self.max_staleness, max(per_sample, default=0)) + 1):
            share = sum(x == k for x in per_sample) / len(per_sample) if per_sample else 0.0
            out[f"rollout/sample_staleness_{k}"] = share
        return out | self.reward_metrics


_COUNTS = ("launched", "continued", "kept", "dropped", "aborted", "carried", "restarted", "empty")


def sample_done(s: Sample, max_new_tokens: int) -> bool:
    """Finished for good: a stop token, the total length cap, or an engine that stopped short
    of a chunk's budget (context length)."""
    if s.finish_reason == "stop":
        return True
    if s.finish_reason == "length":
        return len(s.response_ids) >= max_new_tokens or s.stalled
    return False


def extend_sample(base: Sample, more: Sample, version: int) -> Sample:
    """`base` continued by `more` (generated from prompt + base's response): response ids,
    log-probs, mask and per-token versions concatenated; finish state from `more`."""
    if len(more.prompt_ids) != len(base.prompt_ids) + len(base.response_ids):
        raise ValueError("continuation prompt is not prompt + response so far")
    return dataclasses.replace(
        base,
        response_ids=base.response_ids + more.response_ids,
        logprobs=base.logprobs + more.logprobs,
        logprob_mask=base.logprob_mask + more.logprob_mask,
        token_versions=base.token_versions + [version] * len(more.response_ids),
        finish_reason=more.finish_reason,
        truncated=more.truncated,
        weight_version=more.weight_version,
        engine_id=more.engine_id,
        chunks=base.chunks + 1,
        stalled=more.stalled,
        routed_experts=more.routed_experts,  # its prompt was all of base: it covers the lot
    )


def check_staleness(groups: Sequence[Group], target_version: int, max_staleness: int) -> None:
    """Raise `StalenessError` if a token was sampled more than `max_staleness` versions
    before `target_version` (the weights the batch is trained under)."""
    for g in groups:
        oldest = g.oldest_version()
        if oldest is not None and target_version - oldest > max_staleness:
            raise StalenessError(
                f"group {g.uid} holds a token of weight version {oldest}, trained under "
                f"{target_version}: more than rollout.max_staleness={max_staleness} behind"
            )
