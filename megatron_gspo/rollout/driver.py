"""`RolloutDriver`: a `GroupScheduler` on its own event-loop thread, synchronous or k steps
ahead of the trainer (asynchronous mode).

The trainer's thread only calls the driver; every scheduler method runs on the loop thread, so
the scheduler needs no locks. Synchronous (`lookahead=0`): `next_batch` fills the batch for the
weights just pushed and returns it. Asynchronous (`lookahead=k`, k = `rollout.max_staleness`):
as soon as the batch for version v is handed out, the fills of the batches for v+1 .. v+k are
queued and run one after another while the trainer trains (the batch for v+j is trained after
j more pushes, so its tokens are at most j <= k versions old); the engines stop only when k
batches are ready and waiting. Weight pushes pause generation (`pause` / `resume`: in-flight
requests are aborted and continue, as partial responses, on the new weights, each token keeping
the version that sampled it).

    driver = RolloutDriver(scheduler, lookahead=4)
    driver.resume(version)            # after every weight push (pause() before it)
    batch, metrics = driver.next_batch()

Metrics of `next_batch`: `time/rollout_wait_s` (what the trainer waited), `rollout/overlap_frac`
(share of the batch's generation hidden behind training), `rollout/engine_busy_frac` (share of
the trainer's time since it took the previous batch, training, weight push and logging, during
which generation ran: 0 when synchronous; from the second batch on), `rollout/batches_ready`
(batches complete and waiting when the trainer asked).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from megatron_gspo.rollout.scheduler import Batch, GroupScheduler, check_staleness

if TYPE_CHECKING:
    from megatron_gspo.data.records import PromptRecord

T = TypeVar("T")


class RolloutDriver:
    """See the module docstring."""

    def __init__(self, scheduler: GroupScheduler, *, lookahead: int = 0) -> None:
        if lookahead < 0:
            raise ValueError(f"lookahead={lookahead} must be >= 0 (0: synchronous)")
        self.scheduler = scheduler
        self.lookahead = lookahead
        self.version = 0
        """Last weight version pushed (`resume`)."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="rollout")
        self._thread.start()
        self._ahead: deque[tuple[int, Future[Batch]]] = deque()
        """(target version, fill) of the batches queued ahead, in the order they run."""
        self._handed: tuple[float, float] | None = None
        """(wall time, scheduler busy seconds) when the trainer took the last batch."""

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _on_loop(self, fn: Callable[..., T], *args: object) -> T:
        async def call() -> T:
            return fn(*args)

        return self._run(call())

    def _queue(self, target: int) -> None:
        """Queue the fill of the batch for `target`, to start once the fills before it ended
        (one fill at a time: the scheduler's state is per fill)."""
        prev = self._ahead[-1][1] if self._ahead else None

        async def after() -> Batch:
            if prev is not None:
                try:
                    await asyncio.wrap_future(prev)
                except Exception:  # noqa: BLE001 - raised to the trainer by its own batch
                    pass  # (a cancel, on close, is a BaseException: it ends this fill too)
            return await self.scheduler.fill(target)

        self._ahead.append((target, asyncio.run_coroutine_threadsafe(after(), self.loop)))

    def next_batch(self) -> tuple[Batch, dict[str, float]]:
        """The batch for the weights pushed last, and the metrics of its wait (module
        docstring)."""
        tic = time.perf_counter()
        metrics: dict[str, float] = {}
        if self._handed is not None:  # the trainer's time away: how much of it generated
            since, busy = self._handed
            away = tic - since
            busy_now = self._on_loop(self.scheduler.busy_s)
            metrics["rollout/engine_busy_frac"] = (
                min(1.0, (busy_now - busy) / away) if away > 0 else 0.0
            )
        metrics["rollout/batches_ready"] = float(sum(f.done() for _, f in self._ahead))
        if not self._ahead:
            self._queue(self.version)
        target, fut = self._ahead.popleft()
        batch = fut.result()
        if target != self.version:  # one push per step keeps these equal; else re-check
            check_staleness(batch.groups, self.version, self.scheduler.cfg.max_staleness)
        wait = time.perf_counter() - tic
        self._on_loop(self.scheduler.release, batch)
        while len(self._ahead) < self.lookahead:
            self._queue(self.version + len(self._ahead) + 1)
        self._handed = (time.perf_counter(), self._on_loop(self.scheduler.busy_s))
        hidden = max(0.0, batch.wall_s - wait)
        return batch, {
            "time/rollout_wait_s": wait,
            "rollout/overlap_frac": hidden / batch.wall_s if batch.wall_s > 0 else 0.0,
            **metrics,
        }

    def pause(self) -> None:
        """Before a weight push (in-flight requests return what they generated)."""
        self._run(self.scheduler.pause())

    def resume(self, version: int) -> None:
        """After the push of `version`."""
        self.version = int(version)
        self._run(self.scheduler.resume(self.version))

    def state_dict(self) -> dict[str, Any]:
        """Loader position and every prompt not yet handed to the trainer (a running fill's
        included: after a resume they are generated again)."""
        return self._on_loop(self.scheduler.state_dict)

    def load_state_dict(self, state: dict[str, Any], record_type: type[PromptRecord]) -> None:
        def load() -> None:
            self.scheduler.queue.load_state_dict(state["queue"], record_type)
            self.scheduler.seq_cursor = int(state["seq_cursor"])

        self._on_loop(load)

    def close(self) -> None:
        """Stop a running fill (its requests are aborted on the engines) and the loop thread."""
        if any(not f.done() for _, f in self._ahead):
            owned = self._on_loop(lambda: list(self.scheduler.owned.values()))
            rids = [r for g in owned for r in g.rids]

            async def cancel() -> None:  # the fill and its group tasks, to the end
                fills = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in fills:
                    t.cancel()
                await asyncio.gather(*fills, return_exceptions=True)

            try:  # before the cancel: the client still knows where each (re-sent) request runs
                if rids:
                    self._run(self.scheduler.engine.aabort(rids))
            except Exception:  # noqa: BLE001 - best effort on shutdown
                pass
            self._run(cancel())
        self._ahead.clear()
        self.scheduler.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
