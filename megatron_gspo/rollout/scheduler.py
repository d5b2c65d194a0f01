"""Rank 0's rollout scheduler: one training step's batch of complete, scored groups.

Pure asyncio, no torch.distributed. Every group (one prompt, `group_size` responses) is a task;
`GroupScheduler.fill(target_version)` runs up to `ceil(prompts * oversample)` of them at once
and returns as soon as `prompts` groups are complete and kept. Its steps, in order:
`_sort_carried` (carried groups within the staleness bound first), `_launch` / `_collect` until
the batch is full, `_stop_running` (abort what still runs), `_settle` (carry or return the
leftovers); `_give_back` when a fill raises. The data it hands around (`Group`, `Batch`,
`SchedulerConfig`) lives in `rollout/groups.py`.

* over-sampling / dynamic sampling: a finished group is scored at once; with
  `drop_equal_reward_groups` a group whose rewards are all equal is dropped (its prompt is used
  up) and another prompt starts. When the batch is full the groups still running are stopped
  through the engine (`aabort`: every request a group started, the client's re-sent ones
  included); their prompts go back to the FRONT of the prompt
  queue (`aborted`), or, with partial rollouts, they are kept as they are (`carried`) and
  continue in the next fill. Per fill: launched + continued = kept + dropped + aborted +
  carried + empty. A fill that launched `fill_attempts * ceil(prompts * oversample)` new groups
  without filling its batch raises `RolloutStarved` (e.g. every group of a too easy data set
  has equal rewards).
* short groups: a sample the client rejected (ids vs log-probs, `rejected`) or an episode that
  failed (`failed`: an environment error, see `Sample.failed`) is left out of its group,
  never trained with a made-up reward; a kept group that is short is marked (`Group.rejected`,
  `Group.failed`) and counted (`rollout/groups_rejected`, `rollout/groups_failed`). A group
  left with no sample at all is `empty`: its prompt goes back to the queue (tried again in a
  later fill); it is not a dynamic-sampling drop.
* partial rollouts (`partial_tokens`): every request asks for at most that many new tokens; an
  unfinished response (cut by that budget, or aborted: a weight update's
  `pause_generation("abort")`, or the end of the fill) continues later with prompt + response
  so far as its prompt. Ids, engine log-probs (pi_old) and per-token weight versions
  (`Sample.token_versions`) are concatenated exactly; a group is returned once, complete. A
  continuation the client rejects is retried with the next chunk, at most
  `max_continuation_retries` times in a row (`ContinuationRejected`).
* multi-turn (a custom `group_fn`): `TURN_CONTEXT` gives the episodes the pause gate (a weight
  push holds every episode between two turns) and the served version; an episode's tokens
  carry the version of the turn that sampled them (`Sample.token_versions`).
* staleness: a batch trained under weights `target_version` must hold no token sampled more
  than `max_staleness` versions earlier. A carried group that would break that restarts from
  its prompt (`restarted`); `check_staleness` guards every returned batch.

Aborted / unused prompts are never lost: they wait at the front of `PromptQueue`, whose
checkpoint state also holds the prompts of every group not yet handed to the trainer (those
are regenerated after a resume; nothing is trained twice).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from megatron_gspo.config_io import ConfigError
from megatron_gspo.data.records import PromptRecord
from megatron_gspo.engines.protocols import Generator
from megatron_gspo.engines.types import SEED_PROMPT_STRIDE, RolloutStats, Sample, SamplingParams
from megatron_gspo.rollout.groups import (
    Batch,
    Group,
    SchedulerConfig,
    StalenessError,
    check_staleness,
    extend_sample,
    sample_done,
)

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import PromptLoader

__all__ = [
    "TURN_CONTEXT",
    "Batch",
    "ContinuationRejected",
    "Group",
    "GroupFn",
    "GroupScheduler",
    "PromptQueue",
    "RolloutStarved",
    "SchedulerConfig",
    "ScoreFn",
    "StalenessError",
    "TurnContext",
    "check_staleness",
    "extend_sample",
    "sample_done",
]

GroupFn = Callable[[PromptRecord, list[int], SamplingParams, int, int], Awaitable[list[Sample]]]
"""`async group_fn(record, prompt_ids, sampling, n, prompt_index) -> list[Sample]`: one group's
responses (default: one `engine.agenerate([prompt_ids], sampling, n=n)`)."""
ScoreFn = Callable[[PromptRecord, list[Sample]], tuple[list[float], dict[str, float]]]
"""`score_fn(record, samples) -> (rewards, metrics)`; blocking, run in one worker thread."""

_REABORT_S = 1.0  # a fill's stop re-sends its aborts this often while requests still run
_CHUNK_SEED_STRIDE = 104_729


class RolloutStarved(ConfigError):
    """A fill launched its bounded number of groups without filling the batch."""


class ContinuationRejected(RuntimeError):
    """The client rejected one sample's continuation `max_continuation_retries` times in a row."""


@dataclasses.dataclass(frozen=True, slots=True)
class TurnContext:
    """What a custom `group_fn` (multi-turn episodes) may ask of the scheduler running it."""

    gate: Callable[[], Awaitable[bool]]
    """Wait while a weight push pauses generation; False once the fill stops (end the
    episode as aborted)."""
    version: Callable[[], int]
    """The weight version the engines serve now (for engines whose label is not a number)."""


TURN_CONTEXT: ContextVar[TurnContext | None] = ContextVar("mgspo_turn_context", default=None)
"""Set while the scheduler runs a custom `group_fn`; tasks it starts inherit it."""


@dataclasses.dataclass(kw_only=True, slots=True)
class _Fill:
    """The state of one `GroupScheduler.fill` while it runs (its steps share it)."""

    target: int
    limit: int
    """New groups this fill may launch."""
    seed: int | None = None
    counts: Counter = dataclasses.field(default_factory=Counter)
    ready: deque[Group] = dataclasses.field(default_factory=deque)
    """Carried groups within the staleness bound, not yet continued."""
    active: dict[asyncio.Task, Group] = dataclasses.field(default_factory=dict)
    kept: list[Group] = dataclasses.field(default_factory=list)
    extra: list[Group] = dataclasses.field(default_factory=list)
    """Finished and kept-worthy, but the batch was already full."""
    empty: list[PromptRecord] = dataclasses.field(default_factory=list)
    """Records of groups left with no sample: back to the queue."""
    slots: Iterator[int] = dataclasses.field(default_factory=itertools.count)


class PromptQueue:
    """Prompts in order: returned ones first (front), then the loader's."""

    def __init__(self, loader: PromptLoader, encode: Callable[[PromptRecord], list[int]]) -> None:
        self.loader = loader
        self.encode = encode
        self.front: deque[PromptRecord] = deque()
        self.drawn = 0
        """Records taken from the loader (not counting returned ones taken again)."""

    def take(self) -> PromptRecord:
        if not self.front:
            batch = self.loader.next_batch()
            self.drawn += len(batch)
            self.front.extend(batch)
            return self.front.popleft()
        return self.front.popleft()

    def put_front(self, records: Sequence[PromptRecord]) -> None:
        self.front.extendleft(reversed(list(records)))

    def state_dict(self, owned: Sequence[PromptRecord] = ()) -> dict[str, Any]:
        """Loader position plus every record not yet trained: `owned` (groups in flight),
        then the queue's front. Records are stored as plain dicts."""
        records = [*owned, *self.front]
        return {
            "loader": self.loader.state_dict(),
            "front": [dataclasses.asdict(r) for r in records],
        }

    def load_state_dict(self, state: dict[str, Any], record_type: type[PromptRecord]) -> None:
        self.loader.load_state_dict(state["loader"])
        self.front = deque(record_type(**r) for r in state["front"])


class GroupScheduler:
    """Runs groups on an engine with `agenerate(prompts, sampling, n=, rid_prefix=)` and
    `abort(rid)`; see the module docstring. All methods run on one event loop."""

    def __init__(
        self,
        engine: Generator,
        queue: PromptQueue,
        score_fn: ScoreFn,
        cfg: SchedulerConfig,
        sampling: SamplingParams,
        *,
        group_fn: GroupFn | None = None,
    ) -> None:
        self.engine = engine
        self.queue = queue
        self.score_fn = score_fn
        self.cfg = cfg
        self.sampling = sampling
        """Base sampling; its seed (if any) is offset by `seq_cursor` per fill."""
        self.group_fn = group_fn
        self.continuable = group_fn is None
        """Aborted/cut responses continue (default group_fn); a custom one restarts the group."""
        self.version = 0
        """The weight version the engines serve (set by `resume`)."""
        self.seq_cursor = 0
        """Sequences handed out so far (P * G per fill); seeds a fill as `next_seq_id` did."""
        self.carried: list[Group] = []
        self.owned: dict[int, Group] = {}
        self._uids = itertools.count()
        self._run = uuid.uuid4().hex[:8]
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._filling = False
        self._engine_paused = False
        self._stop = False
        self._stats = RolloutStats()
        self._busy_total = 0.0
        self._busy_since: float | None = None
        self._score_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-score")

    # ---- weight-update hooks ---------------------------------------------------------------
    async def pause(self) -> None:
        """Before a weight push: no new request starts; in-flight ones are aborted and return
        what they generated (continued after `resume`)."""
        self._resumed.clear()
        self._busy(False)
        self._engine_paused = self._filling
        if self._engine_paused:
            await asyncio.to_thread(self.engine.pause_generation, "abort")

    async def resume(self, version: int) -> None:
        """After a weight push of `version`."""
        self.version = int(version)
        if self._engine_paused:
            await asyncio.to_thread(self.engine.continue_generation)
            self._engine_paused = False
        self._resumed.set()
        self._busy(self._filling)

    def _busy(self, on: bool) -> None:
        """Generation runs (a fill, not paused by a weight push) from now on, or not."""
        now = time.perf_counter()
        if self._busy_since is not None:
            self._busy_total += now - self._busy_since
        self._busy_since = now if on else None

    def busy_s(self) -> float:
        """Seconds generation has run so far (the engines' busy time as the scheduler sees it:
        a fill with requests to make, not paused by a weight push)."""
        running = 0.0 if self._busy_since is None else time.perf_counter() - self._busy_since
        return self._busy_total + running

    # ---- one batch ---------------------------------------------------------------------------
    async def fill(self, target_version: int) -> Batch:
        """`cfg.prompts` complete, kept groups, for training under `target_version`."""
        tic = time.perf_counter()
        self._stats, self._stop, self._filling = RolloutStats(), False, True
        self._busy(self._resumed.is_set())
        f = _Fill(target=target_version, limit=self.cfg.width * self.cfg.fill_attempts)
        self._sort_carried(f)
        try:
            while len(f.kept) < self.cfg.prompts:
                self._launch(f)
                await self._collect(f)
            leftovers = await self._stop_running(f)
        except BaseException:
            await self._give_back(f)
            raise
        finally:
            self._filling = False
            self._busy(False)
        self._settle(f, leftovers)
        f.kept.sort(key=lambda g: g.slot)
        f.counts["kept"] = len(f.kept)
        check_staleness(f.kept, target_version, self.cfg.max_staleness)
        self.seq_cursor += sum(len(g.samples) for g in f.kept)
        return Batch(
            groups=f.kept,
            target_version=target_version,
            max_staleness=self.cfg.max_staleness,
            counts=f.counts,
            stats=self._stats,
            reward_metrics=_sum_metrics(g.reward_metrics for g in f.kept),
            wall_s=time.perf_counter() - tic,
        )

    def _sort_carried(self, f: _Fill) -> None:
        """Carried groups within the bound are continued first; one holding a token more than
        `max_staleness` versions older than the target restarts from its prompt (counted)."""
        stale: list[Group] = []
        for g in self.carried:
            oldest = g.oldest_version()
            too_old = oldest is not None and f.target - oldest > self.cfg.max_staleness
            (stale if too_old else f.ready).append(g)
        self.carried = list(f.ready)  # cleared only once this fill succeeded (partial tokens)
        for g in stale:
            f.counts["restarted"] += 1
            del self.owned[g.uid]
        self.queue.put_front([g.record for g in stale])
        f.seed = None if self.sampling.seed is None else self.sampling.seed + self.seq_cursor

    def _launch(self, f: _Fill) -> None:
        """Keep `width` groups in play (running or kept): carried ones first, then new prompts,
        until the fill's launch budget is spent."""
        cfg, counts = self.cfg, f.counts
        while len(f.active) + len(f.kept) < cfg.width and (f.ready or counts["launched"] < f.limit):
            if f.ready:
                g = f.ready.popleft()
                counts["continued"] += 1
            else:
                g = self._new_group()
                counts["launched"] += 1
            g.slot = next(f.slots)
            if not g.samples:  # a (re)started group takes this fill's seed slot
                g.seed = None if f.seed is None else f.seed + g.slot * SEED_PROMPT_STRIDE
            f.active[asyncio.create_task(self._advance(g))] = g
        if not f.active:
            raise RolloutStarved(
                f"{counts['launched']} groups launched for one step, "
                f"{counts['dropped']} dropped for equal rewards, {counts['empty']} left "
                f"with no sample ({counts['samples_rejected']} samples rejected by the "
                f"client, {counts['samples_failed']} episodes failed), only {len(f.kept)} "
                f"of {cfg.prompts} kept; raise rollout.fill_attempts or "
                "rollout.oversample, or set rollout.drop_equal_reward_groups=false"
            )

    async def _collect(self, f: _Fill) -> None:
        """Wait for groups to finish; keep, drop (equal rewards) or return each (empty)."""
        done, _ = await asyncio.wait(f.active, return_when=asyncio.FIRST_COMPLETED)
        for t in sorted(done, key=lambda t: f.active[t].slot):
            g = f.active.pop(t)
            t.result()
            f.counts["samples_rejected"] += g.rejected
            f.counts["samples_failed"] += g.failed
            if not g.samples:  # not a dynamic-sampling drop: the prompt is tried again
                f.counts["empty"] += 1
                f.empty.append(g.record)
                del self.owned[g.uid]
            elif self.cfg.drop_equal_reward_groups and len(set(g.rewards)) <= 1:
                f.counts["dropped"] += 1
                del self.owned[g.uid]
            elif len(f.kept) < self.cfg.prompts:
                f.kept.append(g)
            else:
                f.extra.append(g)

    async def _stop_running(self, f: _Fill) -> list[Group]:
        """The batch is full: abort the groups still running, wait for them to return what
        they generated; returns them and the finished extras, in slot order."""
        self._stop = True
        await self._abort(list(f.active.values()))
        for t, g in f.active.items():
            if not g.rids and self.group_fn is not None:
                t.cancel()  # a custom group_fn has no request ids to abort
        pending = set(f.active)
        while pending:  # an abort that raced its request's arrival is sent again
            _, pending = await asyncio.wait(pending, timeout=_REABORT_S)
            await self._abort([f.active[t] for t in pending])
        for r in await asyncio.gather(*f.active, return_exceptions=True):
            if isinstance(r, Exception):
                raise r
        return sorted([*f.active.values(), *f.extra], key=lambda g: g.slot)

    async def _give_back(self, f: _Fill) -> None:
        """A fill that raised: carried groups stay carried with their tokens; this fill's new
        groups and the empty ones give their prompts back to the queue."""
        for t in f.active:
            t.cancel()
        await asyncio.gather(*f.active, return_exceptions=True)
        carried = {g.uid for g in self.carried}  # owned held only these when the fill started
        new = [g for k, g in sorted(self.owned.items()) if k not in carried]
        for g in new:
            del self.owned[g.uid]
        self.queue.put_front([g.record for g in new] + f.empty)

    def _settle(self, f: _Fill, leftovers: list[Group]) -> None:
        """Groups the batch had no room for: carried to the next fill (partial rollouts) or
        aborted (their prompts to the front of the queue)."""
        back = []
        self.carried = list(f.ready)  # carried groups this fill had no room for: still carried
        for g in leftovers:
            if self.cfg.partial_tokens and self.continuable and g.samples:
                self.carried.append(g)
                f.counts["carried"] += 1
            else:
                back.append(g.record)
                f.counts["aborted"] += 1
                del self.owned[g.uid]
        self.queue.put_front(back + f.empty)

    def release(self, batch: Batch) -> None:
        """The trainer took `batch`: its groups are no longer the scheduler's."""
        for g in batch.groups:
            self.owned.pop(g.uid, None)

    def state_dict(self) -> dict[str, Any]:
        owned = [self.owned[k].record for k in sorted(self.owned)]
        return {"queue": self.queue.state_dict(owned), "seq_cursor": self.seq_cursor}

    def close(self) -> None:
        self._score_pool.shutdown(wait=False, cancel_futures=True)

    # ---- groups ------------------------------------------------------------------------------
    def _new_group(self) -> Group:
        record = self.queue.take()
        g = Group(uid=next(self._uids), record=record, prompt_ids=list(self.queue.encode(record)))
        self.owned[g.uid] = g
        return g

    async def _gate(self) -> bool:
        """Wait while paused; False once the fill is stopping."""
        while not self._resumed.is_set() and not self._stop:
            await asyncio.sleep(0.005)
        return not self._stop

    async def _advance(self, g: Group) -> None:
        """Generate until `g` is complete (then score it) or the fill stops."""
        while not self._complete(g):
            if not await self._gate():
                return
            if g.samples and not self.continuable:
                g.samples = []  # a custom group_fn was cut: start the group again
            if not g.samples:
                g.samples = await self._first_chunk(g)
                if not g.samples:  # every sample rejected / every episode failed: empty
                    return
            else:
                await self._continue(g)
        if not g.rewards:
            loop = asyncio.get_running_loop()
            g.rewards, g.reward_metrics = await loop.run_in_executor(
                self._score_pool, self.score_fn, g.record, g.samples
            )

    def _complete(self, g: Group) -> bool:
        """A custom group_fn (multi-turn) decides when its episodes end; only an aborted one
        (a weight update's pause) restarts. The default one continues to the length cap."""
        if self.continuable:
            return g.complete(self.cfg.max_new_tokens)
        return bool(g.samples) and all(s.finish_reason != "abort" for s in g.samples)

    def _chunk_sampling(self, seed: int | None, budget: int) -> SamplingParams:
        return dataclasses.replace(self.sampling, max_new_tokens=budget, seed=seed)

    def _stamp(self, s: Sample, requested: int) -> int:
        """The weight version of a response chunk: the engine's label when it is a number,
        else the version the scheduler was told."""
        try:
            version = int(s.weight_version)
        except ValueError:
            version = self.version
        if s.finish_reason == "length" and len(s.response_ids) < requested:
            s.stalled = True
        return version

    async def _first_chunk(self, g: Group) -> list[Sample]:
        n, budget = self.cfg.group_size, self.cfg.chunk
        sp = self._chunk_sampling(g.seed, budget)
        g.chunks += 1
        if self.group_fn is not None:
            token = TURN_CONTEXT.set(TurnContext(gate=self._gate, version=lambda: self.version))
            try:
                got = await self.group_fn(g.record, g.prompt_ids, sp, n, g.slot)
            finally:
                TURN_CONTEXT.reset(token)
            # failed episodes are left out (never trained with a made-up reward), and counted
            samples = [s for s in got if not s.failed]
            g.rejected = sum(s.failed == "rejected" for s in got)
            g.failed = max(0, n - len(samples) - g.rejected)
        else:
            prefix = f"{self._run}-g{g.uid}-c{g.chunks}"
            g.rids = [f"{prefix}-p0-s{j}" for j in range(n)]
            try:
                res = await self.engine.agenerate([g.prompt_ids], sp, n=n, rid_prefix=prefix)
            finally:
                g.rids = []
            _add_stats(self._stats, res.stats)
            samples = res.samples
            g.rejected, g.failed = max(0, n - len(samples)), 0
        for s in samples:
            s.prompt_index = g.slot
            if not s.token_versions:
                s.token_versions = [self._stamp(s, budget)] * len(s.response_ids)
        return samples

    async def _continue(self, g: Group) -> None:
        todo = [i for i, s in enumerate(g.samples) if not sample_done(s, self.cfg.max_new_tokens)]
        g.chunks += 1
        seed = None if g.seed is None else g.seed + g.chunks * _CHUNK_SEED_STRIDE
        groups: dict[int, list[int]] = {}
        for i in todo:  # one request per remaining budget (a chunk's max_new_tokens)
            left = self.cfg.max_new_tokens - len(g.samples[i].response_ids)
            groups.setdefault(min(self.cfg.chunk, left), []).append(i)
        for budget, idx in groups.items():
            if self._stop:  # the fill is over: no further request for this group
                break
            prompts = [g.samples[i].prompt_ids + g.samples[i].response_ids for i in idx]
            prefix = f"{self._run}-g{g.uid}-c{g.chunks}-b{budget}"
            g.rids = [f"{prefix}-p{k}-s0" for k in range(len(idx))]
            try:
                res = await self.engine.agenerate(
                    prompts, self._chunk_sampling(seed, budget), n=1, rid_prefix=prefix
                )
            finally:
                g.rids = []
            _add_stats(self._stats, res.stats)
            by_prompt = {s.prompt_index: s for s in res.samples}
            for k, i in enumerate(idx):
                more = by_prompt.get(k)
                if more is None:  # rejected by the client: retried with the next chunk
                    g.rejects[i] += 1
                    if g.rejects[i] > self.cfg.max_continuation_retries:
                        raise ContinuationRejected(
                            f"the client rejected the continuation of sample {i} of prompt "
                            f"{g.prompt_ids[:8]}... {g.rejects[i]} times in a row (ids and "
                            "log-probs disagree, see rollout/num_rejected); check the engine "
                            "or raise rollout.max_continuation_retries"
                        )
                    continue
                g.rejects.pop(i, None)
                version = self._stamp(more, budget)
                g.samples[i] = extend_sample(g.samples[i], more, version)

    async def _abort(self, groups: list[Group]) -> None:
        """Stop the requests of `groups` through the engine (they return partial output): one
        `aabort` for all of them (it reaches the client's re-sent requests too)."""
        rids = [r for g in groups for r in g.rids]
        if rids:
            await self.engine.aabort(rids)


def _add_stats(total: RolloutStats, part: RolloutStats) -> None:
    for name in ("num_rejected", "num_retries", "num_resubmitted", "num_resent_samples"):
        setattr(total, name, getattr(total, name) + getattr(part, name))
    # gauges, not counters: the latest call's view of the engine pool
    total.engines_alive, total.engine_restarts = part.engines_alive, part.engine_restarts
    total.requests_per_engine.update(part.requests_per_engine)


def _sum_metrics(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in parts:
        for k, v in m.items():
            out[k] = out.get(k, 0.0) + float(v)
    return out
