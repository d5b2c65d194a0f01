"""`EnvPool`: environment episodes hosted in worker processes, driven from asyncio.

The trainer side of `rollout.env`: it never imports the user's environment class. Each episode
lives in one worker (its state is a Python object there), chosen as the worker with the fewest
open episodes; a worker serves one call at a time (a lock), and the blocking call runs in a
thread so the rollout's event loop keeps generating meanwhile. A call that raises in user code
fails that episode only. A call past `timeout_s`, a crash, or an out-of-memory / CPU-limit kill
replaces the worker: the episodes it hosted are lost too (their next call fails with a message
saying so), which costs those samples, never the run. The workers, their start-up, timeouts and
replacements are `sandbox.pool.WorkerPool`'s (the reward pool's too); this class keeps the
episodes: which worker hosts each, one call at a time per worker, and the failure counts.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass
from typing import Any

from megatron_gspo.sandbox.pool import WorkerCallError, WorkerPool
from megatron_gspo.sandbox.process import WorkerLimits

__all__ = ["EnvError", "EnvPool", "Episode"]

_MAX_ERRORS_KEPT = 8


class EnvError(RuntimeError):
    """An environment call failed (user error, timeout, dead worker); the episode is over."""


@dataclass(frozen=True, slots=True)
class Episode:
    """Handle of one open episode: the worker slot and its generation at open time."""

    id: int
    slot: int
    generation: int


class EnvPool:
    """`num_workers` env worker processes for `spec` ("module:Class")."""

    def __init__(
        self,
        spec: str,
        *,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        limits: WorkerLimits | None = None,
    ) -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"need num_workers >= 1 and timeout_s > 0, got {num_workers}")
        self.spec, self.timeout_s = spec, timeout_s
        self._pool = WorkerPool(
            "env",
            spec,
            num_workers=num_workers,
            timeout_s=timeout_s,
            timeout_key="rollout.env_timeout_s",
            limits=limits,
        )
        self.limits = self._pool.limits
        self._locks = [threading.Lock() for _ in range(num_workers)]
        self._open = [0] * num_workers
        self._ids = itertools.count()
        self._stats_lock = threading.Lock()
        self.failures = 0
        self.timeouts = 0
        self.errors: list[str] = []

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (tests: env code runs there, not here)."""
        return self._pool.worker_pids

    # ---- blocking core (runs in a thread) ----------------------------------------------
    def _call(self, ep: Episode, msg: dict[str, Any]) -> dict[str, Any]:
        with self._locks[ep.slot]:
            if self._pool.generation[ep.slot] != ep.generation:
                raise self._fail(
                    "the env worker hosting this episode was replaced after another "
                    "episode's call failed; episode lost"
                )
            msg = {"id": next(self._ids), **msg}
            try:
                reply = self._pool.call(ep.slot, msg)
            except WorkerCallError as e:
                if e.timed_out:
                    with self._stats_lock:
                        self.timeouts += 1
                raise self._fail(str(e)) from None
            finally:
                if self._pool.generation[ep.slot] != ep.generation:
                    self._open[ep.slot] = 0  # a new worker hosts no episode yet
            if reply.get("error"):
                raise self._fail(reply["error"])
            return reply

    def _fail(self, message: str) -> EnvError:
        with self._stats_lock:
            self.failures += 1
            if len(self.errors) < _MAX_ERRORS_KEPT:
                self.errors.append(message)
        return EnvError(message)

    # ---- async API -----------------------------------------------------------------------
    async def reset(self, record: dict[str, Any]) -> tuple[Episode, str | None]:
        """Open an episode for `record` (JSON-serialisable); returns it and the initial
        observation (None: none)."""
        with self._stats_lock:
            slot = min(range(len(self._open)), key=lambda i: self._open[i])
            self._open[slot] += 1
            ep = Episode(next(self._ids), slot, self._pool.generation[slot])
        try:
            reply = await asyncio.to_thread(
                self._call, ep, {"op": "reset", "ep": ep.id, "record": record}
            )
        except EnvError:
            with self._stats_lock:
                if self._pool.generation[slot] == ep.generation:
                    self._open[slot] = max(0, self._open[slot] - 1)
            raise
        return ep, reply.get("obs")

    async def step(self, ep: Episode, text: str) -> tuple[str | None, float | None, bool]:
        """One environment turn: (observation, reward, done)."""
        reply = await asyncio.to_thread(self._call, ep, {"op": "step", "ep": ep.id, "text": text})
        return reply.get("obs"), reply.get("reward"), bool(reply.get("done"))

    async def close_episode(self, ep: Episode) -> None:
        """Drop the episode's state in its worker (a failure here costs nothing)."""
        with self._stats_lock:
            if self._pool.generation[ep.slot] != ep.generation:
                return  # its worker is gone, and the state with it
            self._open[ep.slot] = max(0, self._open[ep.slot] - 1)
        try:
            await asyncio.to_thread(self._call, ep, {"op": "close", "ep": ep.id})
        except EnvError:
            pass

    def take_report(self) -> tuple[dict[str, float], str | None]:
        """Counters since the last call (metrics) and a stderr block with the first errors
        (None when nothing failed); resets the counters."""
        with self._stats_lock:
            failures, timeouts, errors = self.failures, self.timeouts, self.errors
            self.failures, self.timeouts, self.errors = 0, 0, []
        metrics = {"env/failures": float(failures), "env/timeouts": float(timeouts)}
        if not failures:
            return metrics, None
        head = f"[env] {failures} environment calls failed ({timeouts} timed out); first errors:"
        return metrics, "\n".join([head, *(f"  {e}" for e in errors)])

    def close(self) -> None:
        """Stop the workers (the episodes they host end with them)."""
        self._pool.close()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
