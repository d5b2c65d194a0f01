"""`WorkerPool`: a fixed number of sandbox workers of one kind, replaced when a call goes wrong.

The one pool behind reward scoring (`rewards/pool.py`) and environment episodes
(`envs/pool.py`). It owns the workers (`process.WorkerProcess`: scrubbed environment, limits)
and what every user of them needs alike: start them all and fail at start-up with the worker's
message when the spec cannot be loaded; kill and replace a worker whose call ran past
`timeout_s`, that died (crash, out of memory, SIGXCPU), or that asked for a restart; count the
replacements per slot (`generation`: state a worker held, an open episode, is gone with it).

Two ways to call:

* `call(slot, msg)`: one blocking call on the worker the caller chose (environment episodes
  live in one worker; the caller serialises calls per slot and runs them in threads);
* `map(msgs)`: a batch spread over every worker at once, one call per worker at a time, read
  with a selector (reward scoring); each item ends as the worker's reply or a `CallFailed`.
"""

from __future__ import annotations

import selectors
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_gspo.sandbox.process import WorkerDied, WorkerLimits, WorkerProcess, WorkerTimeout

__all__ = ["CallFailed", "WorkerCallError", "WorkerPool"]


@dataclass(frozen=True, slots=True)
class CallFailed:
    """A `map` item without a reply: its message, and whether the wall timeout ended it."""

    message: str
    timed_out: bool = False


class WorkerCallError(RuntimeError):
    """A `call` without a reply (the worker has been replaced); `timed_out` as in CallFailed."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class WorkerPool:
    """`num_workers` (>= 1) workers `python -m megatron_gspo.sandbox.worker KIND SPEC`.

    `timeout_key` is the config key of `timeout_s`, named in timeout messages. Use as a context
    manager, or call `close()`; after `close()`, `map` starts fresh workers.
    """

    def __init__(
        self,
        kind: str,
        spec: str,
        *,
        num_workers: int,
        timeout_s: float,
        timeout_key: str,
        limits: WorkerLimits | None = None,
    ) -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"need num_workers >= 1 and timeout_s > 0, got {num_workers}")
        self.kind, self.spec, self.timeout_key = kind, spec, timeout_key
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self.limits = limits or WorkerLimits()
        self.generation = [0] * num_workers
        """Per slot: how often its worker was replaced."""
        # Start them all now so a typo fails at start-up (with the worker's message), not as a
        # stream of failed calls. The user module is imported there, never here.
        self._workers = [self._spawn() for _ in range(num_workers)]
        try:
            for w in self._workers:
                w.wait_ready()  # a bad spec raises ValueError with the worker's message
        except BaseException:
            self.close()
            raise

    def _spawn(self) -> WorkerProcess:
        return WorkerProcess(self.kind, self.spec, self.limits)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (tests: user code runs there, not here)."""
        return [w.pid for w in self._workers]

    def replace(self, slot: int) -> WorkerProcess:
        """Kill the worker in `slot` and start another there (ready on its first call)."""
        self._workers[slot].kill()
        self._workers[slot] = new = self._spawn()
        self.generation[slot] += 1
        return new

    def call(self, slot: int, msg: dict[str, Any]) -> dict[str, Any]:
        """One request to the worker in `slot` and its reply (blocking: async callers run it in
        a thread, one at a time per slot). A timeout, a dead worker or a restart request
        replaces the worker; the first two raise WorkerCallError."""
        try:
            reply = self._workers[slot].call(msg, self.timeout_s)
        except WorkerTimeout as e:
            self.replace(slot)
            raise WorkerCallError(
                f"{e} ({self.timeout_key}; worker replaced)", timed_out=True
            ) from None
        except (WorkerDied, OSError) as e:
            self.replace(slot)
            raise WorkerCallError(f"{e} (worker replaced)") from None
        if reply.get("restart"):
            self.replace(slot)
        return reply

    def map(self, msgs: Sequence[dict[str, Any]]) -> list[dict[str, Any] | CallFailed]:
        """Each message (its `id` set to its index) to the next idle worker, all workers busy at
        once; the replies (or failures) in input order. Messages that cannot be serialised,
        workers that die, and calls past the timeout fail their item only."""
        while len(self._workers) < self.num_workers:  # after close(): a fresh set
            self._workers.append(self._spawn())
        out: list[dict[str, Any] | CallFailed | None] = [None] * len(msgs)
        pending = deque(range(len(msgs)))
        idle = list(range(len(self._workers)))
        busy: dict[int, int] = {}  # stdout fd -> slot
        sel = selectors.DefaultSelector()
        try:
            while pending or busy:
                while idle and pending:
                    self._send_next(idle, pending, busy, sel, msgs, out)
                if busy:
                    self._collect(idle, busy, sel, out)
        finally:
            sel.close()
        done = [o for o in out if o is not None]
        assert len(done) == len(out), "every item ends with a reply or a failure"
        return done

    def _send_next(
        self,
        idle: list[int],
        pending: deque[int],
        busy: dict[int, int],
        sel: selectors.BaseSelector,
        msgs: Sequence[dict[str, Any]],
        out: list[dict[str, Any] | CallFailed | None],
    ) -> None:
        slot, i = idle.pop(), pending.popleft()
        w = self._workers[slot]
        if not w.ready:  # a replacement for a killed worker
            w.wait_ready()
        try:
            w.send({"id": i, **msgs[i]})
        except (BrokenPipeError, OSError):  # died while idle: replace, retry
            self.replace(slot)
            idle.append(slot)
            pending.appendleft(i)
            return
        except TypeError as e:  # the message is not JSON-serialisable
            idle.append(slot)
            out[i] = CallFailed(f"cannot send to worker: {e}")
            return
        stdout = w.proc.stdout
        assert stdout is not None
        busy[stdout.fileno()] = slot
        sel.register(stdout, selectors.EVENT_READ)

    def _collect(
        self,
        idle: list[int],
        busy: dict[int, int],
        sel: selectors.BaseSelector,
        out: list[dict[str, Any] | CallFailed | None],
    ) -> None:
        """Wait for the first reply or the first timeout; record what ended."""
        first = min(self._workers[slot].started for slot in busy.values())
        wait = first + self.timeout_s - time.monotonic()
        for key, _ in sel.select(timeout=max(0.0, wait)):
            slot = busy.pop(key.fd)
            sel.unregister(key.fileobj)
            w = self._workers[slot]
            task = w.task
            try:
                reply = w.read_reply()
            except WorkerDied as e:  # os._exit, segfault, SIGXCPU, OOM kill
                assert task is not None
                out[task] = CallFailed(str(e))
                self.replace(slot)
                idle.append(slot)
                continue
            out[reply["id"]] = reply
            if reply.get("restart"):
                self.replace(slot)
            idle.append(slot)
        now = time.monotonic()
        for fd, slot in list(busy.items()):
            w = self._workers[slot]
            if now - w.started >= self.timeout_s:
                del busy[fd]
                sel.unregister(fd)
                assert w.task is not None
                out[w.task] = CallFailed(
                    f"timed out after {self.timeout_key}={self.timeout_s:g} s "
                    "(worker killed and replaced)",
                    timed_out=True,
                )
                self.replace(slot)
                idle.append(slot)

    def close(self) -> None:
        """Stop the workers (they also exit on their own when the trainer's pipes close)."""
        for w in self._workers:
            w.kill()
        self._workers = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
