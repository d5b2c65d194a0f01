"""`RolloutDriver`: a `GroupScheduler` on its own event-loop thread, synchronous or one step
ahead of the trainer (asynchronous mode).

The trainer's thread only calls the driver; every scheduler method runs on the loop thread, so
the scheduler needs no locks. Synchronous (`lookahead=0`): `next_batch` fills the batch for the
weights just pushed and returns it. Asynchronous (`lookahead=1`): as soon as a batch is handed
out, the fill of the next one starts (targeting the version the next push will create) and runs
while the trainer trains; weight pushes pause it (`pause` / `resume`: in-flight requests are
aborted and continue, as partial responses, on the new weights).

    driver = RolloutDriver(scheduler, lookahead=1)
    driver.resume(version)            # after every weight push (pause() before it)
    batch, wait_s = driver.next_batch()
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from megatron_gspo.rollout.scheduler import Batch, GroupScheduler

T = TypeVar("T")


class RolloutDriver:
    """See the module docstring."""

    def __init__(self, scheduler: GroupScheduler, *, lookahead: int = 0) -> None:
        if lookahead not in (0, 1):
            raise ValueError(f"lookahead={lookahead} must be 0 (synchronous) or 1")
        self.scheduler = scheduler
        self.lookahead = lookahead
        self.version = 0
        """Last weight version pushed (`resume`)."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="rollout")
        self._thread.start()
        self._next: Future[Batch] | None = None
        self._next_started = 0.0

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _on_loop(self, fn: Callable[..., T], *args: Any) -> T:
        async def call() -> T:
            return fn(*args)

        return self._run(call())

    def next_batch(self) -> tuple[Batch, dict[str, float]]:
        """The next batch and the time metrics of its wait (overlap with training)."""
        tic = time.perf_counter()
        fut = self._next or asyncio.run_coroutine_threadsafe(
            self.scheduler.fill(self.version), self.loop
        )
        self._next = None
        batch = fut.result()
        wait = time.perf_counter() - tic
        self._on_loop(self.scheduler.release, batch)
        if self.lookahead:
            self._next = asyncio.run_coroutine_threadsafe(
                self.scheduler.fill(self.version + 1), self.loop
            )
        hidden = max(0.0, batch.wall_s - wait)
        return batch, {
            "time/rollout_wait_s": wait,
            "rollout/overlap_frac": hidden / batch.wall_s if batch.wall_s > 0 else 0.0,
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

    def load_state_dict(self, state: dict[str, Any], record_type: Any) -> None:
        def load() -> None:
            self.scheduler.queue.load_state_dict(state["queue"], record_type)
            self.scheduler.seq_cursor = int(state["seq_cursor"])

        self._on_loop(load)

    def close(self) -> None:
        """Stop a running fill (its requests are aborted on the engines) and the loop thread."""
        if self._next is not None and not self._next.done():
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
        self._next = None
        self.scheduler.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
