"""Reward functions by name, scored in a pool of worker processes with a per-call timeout.

A reward function has the signature

    fn(prompt: str | None, response: str, answer: Any) -> float

and is named by `reward.kind`: "math" (`math_answer.math_reward`), "toy" (`toy.toy_reward`),
"pattern" (`pattern.pattern_reward`) or
"package.module:function" for a user function. `RewardPool` keeps `num_workers` subprocesses
alive between steps, hands each one call at a time, and kills a worker whose call runs past
`timeout_s` (that call scores 0 and counts in `reward/timeouts`; a fresh worker replaces it), so
neither an endless loop nor a C extension stuck without checking signals can hang the trainer.
A call that raises, crashes its worker, runs out of memory or CPU time (`sandbox.max_memory_mb`,
`sandbox.max_cpu_s`) or returns a non-finite / non-numeric value scores 0 and counts in
`reward/failures`; the first messages are kept in `RewardBatch.errors` and the trainer prints
them once per step (`RewardBatch.report`).

User code runs only in the workers (`sandbox/process.py`: scrubbed environment, limits): the
trainer never imports a user reward module. Only the built-in kinds may run in-process
(`num_workers=0`, no timeout or limit enforced).

Workers are plain `python -m megatron_gspo.sandbox.worker` subprocesses speaking JSON lines
(not multiprocessing): they never fork the trainer (threads, CUDA, process groups) and never
re-import its `__main__`. Answers must therefore be JSON-serialisable, as JSONL answers are.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from megatron_gspo.rewards.batch import MAX_ERRORS_KEPT, RewardBatch, RewardScorer
from megatron_gspo.sandbox.pool import CallFailed, WorkerPool
from megatron_gspo.sandbox.process import WorkerLimits

if TYPE_CHECKING:
    from megatron_gspo.rewards.config import RewardConfig
    from megatron_gspo.sandbox.config import SandboxConfig

__all__ = [
    "RewardBatch",
    "RewardFn",
    "RewardPool",
    "RewardScorer",
    "build_reward_pool",
    "load_reward_fn",
    "worker_limits",
]

RewardFn = Callable[[str | None, str, Any], float]

_BUILTIN = {
    "math": "megatron_gspo.rewards.math_answer:math_reward",
    "toy": "megatron_gspo.rewards.toy:toy_reward",
    "pattern": "megatron_gspo.rewards.pattern:pattern_reward",
}


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve "math", "toy" or "package.module:function" to the callable."""
    target = _BUILTIN.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not (sep and module_name and attr):
        raise ValueError(f'reward.kind={spec!r} is not math, toy or "module:function"')
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward.kind={spec!r}: cannot import {module_name!r} ({e})") from e
    fn: object = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"reward.kind={spec!r}: {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward.kind={spec!r}: {attr!r} is not callable")
    return cast(RewardFn, fn)  # its signature is the user's promise (reward.kind)


def call_reward(
    fn: RewardFn, prompt: str | None, response: str, answer: object
) -> tuple[float, str | None]:
    """One guarded call: (reward, None) or (0.0, error message)."""
    try:
        value = fn(prompt, response, answer)
        reward = float(value)  # bool and numpy scalars pass; None / strings fail here
    except Exception as e:  # a user function's bug costs one sample, not the run
        return 0.0, f"{type(e).__name__}: {e}"[:300]
    if not math.isfinite(reward):
        return 0.0, f"non-finite reward {reward}"
    return reward, None


class RewardPool:
    """Score batches with `reward.kind` in worker processes (see `sandbox/process.py`: scrubbed
    environment, memory / CPU limits, wall timeout), or in-process when num_workers=0, which
    only the built-in kinds may use (it enforces nothing). Use as a context manager, or call
    `close()`."""

    def __init__(
        self,
        spec: str,
        *,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        limits: WorkerLimits | None = None,
    ) -> None:
        if num_workers < 0 or timeout_s <= 0:
            raise ValueError(
                f"need num_workers >= 0 and timeout_s > 0, got {num_workers}, {timeout_s}"
            )
        if num_workers == 0 and spec not in _BUILTIN:
            raise ValueError(
                f"reward.kind={spec!r}: user reward code runs only in worker processes; "
                "set reward.num_workers >= 1"
            )
        self.spec = spec
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.limits = limits or WorkerLimits()
        self._pool: WorkerPool | None = None
        self.fn: RewardFn | None = None
        if num_workers == 0:
            self.fn = load_reward_fn(spec)
        else:
            # `sandbox/pool.py`: starts the workers now (a typo fails at start-up); the user
            # module is imported there, never here
            self._pool = WorkerPool(
                "reward",
                spec,
                num_workers=num_workers,
                timeout_s=timeout_s,
                timeout_key="reward.timeout_s",
                limits=self.limits,
            )

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (tests: user code runs there, not here)."""
        return [] if self._pool is None else self._pool.worker_pids

    def score(
        self, prompts: Sequence[str | None], responses: Sequence[str], answers: Sequence[Any]
    ) -> RewardBatch:
        """Rewards for aligned lists of prompts, responses and answers."""
        if not len(prompts) == len(responses) == len(answers):
            raise ValueError(
                f"prompts/responses/answers lengths differ: "
                f"{len(prompts)}/{len(responses)}/{len(answers)}"
            )
        t0 = time.monotonic()
        batch = RewardBatch(rewards=[0.0] * len(prompts))
        if self.fn is not None:
            for i, item in enumerate(zip(prompts, responses, answers)):
                reward, error = call_reward(self.fn, *item)
                self._record(batch, i, reward, error)
        elif self._pool is not None and len(prompts):
            msgs = [
                {"prompt": p, "response": r, "answer": a}
                for p, r, a in zip(prompts, responses, answers, strict=True)
            ]
            for i, out in enumerate(self._pool.map(msgs)):
                self._record_outcome(batch, i, out)
        batch.time_s = time.monotonic() - t0
        return batch

    __call__ = score

    @staticmethod
    def _record(batch: RewardBatch, i: int, reward: float, error: str | None) -> None:
        batch.rewards[i] = reward
        if error is not None:
            batch.failures += 1
            if len(batch.errors) < MAX_ERRORS_KEPT:
                batch.errors.append(f"sample {i}: {error}")

    @classmethod
    def _record_outcome(cls, batch: RewardBatch, i: int, out: dict[str, Any] | CallFailed) -> None:
        if not isinstance(out, CallFailed):
            cls._record(batch, i, out["reward"], out["error"])
        elif not out.timed_out:
            cls._record(batch, i, 0.0, out.message)
        else:  # a timeout is counted apart from the failures
            batch.rewards[i] = 0.0
            batch.timeouts += 1
            if len(batch.errors) < MAX_ERRORS_KEPT:
                batch.errors.append(f"sample {i}: {out.message}")

    def close(self) -> None:
        """Stop the workers (they also exit on their own when the trainer's pipes close);
        a later `score` starts fresh ones."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def worker_limits(sandbox_cfg: SandboxConfig, timeout_s: float) -> WorkerLimits:
    """The limits of reward and environment workers from a `RewardConfig`; `timeout_s` is the
    calls' wall timeout (the CPU limit defaults to twice it)."""
    cpu = sandbox_cfg.max_cpu_s if sandbox_cfg.max_cpu_s is not None else 2.0 * timeout_s
    return WorkerLimits(
        max_memory_mb=sandbox_cfg.max_memory_mb,
        max_cpu_s=cpu,
        pass_env=tuple(sandbox_cfg.pass_env),
    )


def build_reward_pool(reward_cfg: RewardConfig, sandbox_cfg: SandboxConfig) -> RewardScorer:
    """A pool from a `megatron_gspo.config.RewardConfig`; for reward.kind=http the judge
    client (`rewards/http.py`: the same `score` / `close` interface; no user code, so no
    sandbox)."""
    if reward_cfg.kind == "http":
        from megatron_gspo.rewards.http import http_reward_from_config

        return http_reward_from_config(reward_cfg)
    return RewardPool(
        reward_cfg.kind,
        num_workers=reward_cfg.num_workers,
        timeout_s=reward_cfg.timeout_s,
        limits=worker_limits(sandbox_cfg, reward_cfg.timeout_s),
    )
