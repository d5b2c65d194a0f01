"""What a scored batch of rewards is (`RewardBatch`) and what a scorer promises
(`RewardScorer`): the leaf that the worker pool (`rewards/pool.py`) and the HTTP judge client
(`rewards/http.py`) both build on, so that neither imports the other back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["MAX_ERRORS_KEPT", "RewardBatch", "RewardScorer"]

MAX_ERRORS_KEPT = 8
"""Failure messages a batch keeps for the log (`RewardBatch.errors`)."""


@dataclass(kw_only=True)
class RewardBatch:
    """Rewards of one batch, in input order, and what went wrong."""

    rewards: list[float]
    """One reward per response (0.0 for timeouts and failures)."""
    timeouts: int = 0
    """Calls killed at the timeout."""
    failures: int = 0
    """Calls that raised, crashed their worker, or returned a non-finite / non-number."""
    errors: list[str] = field(default_factory=list)
    """The first few failure messages, for the log."""
    time_s: float = 0.0
    """Wall time of the batch."""
    retries: int = 0
    """Requests retried (reward.kind=http: `rewards/http.py`)."""

    def report(self, what: str = "reward") -> str | None:
        """One block for stderr when a call failed or timed out (None when all went well):
        the counts and the first error messages, so a broken reward function is loud."""
        if not (self.failures or self.timeouts):
            return None
        head = (
            f"[{what}] {self.failures} of {len(self.rewards)} calls failed and "
            f"{self.timeouts} timed out (scored 0); first errors:"
        )
        return "\n".join([head, *(f"  {e}" for e in self.errors)])

    def metrics(self) -> dict[str, float]:
        """Counters for the metrics sink."""
        return {
            "reward/timeouts": float(self.timeouts),
            "reward/failures": float(self.failures),
            "reward/retries": float(self.retries),
            "reward/time_s": self.time_s,
        }


class RewardScorer(Protocol):
    """What the rollout and the evaluation ask of a reward: `RewardPool`, or the HTTP judge
    client (`rewards/http.py`)."""

    def score(
        self, prompts: Sequence[str | None], responses: Sequence[str], answers: Sequence[Any]
    ) -> RewardBatch:
        """Rewards for aligned lists of prompts, responses and answers."""
        ...

    def close(self) -> None:
        """Release workers or connections."""
        ...
