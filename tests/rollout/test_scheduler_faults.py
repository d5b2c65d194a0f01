"""The rollout scheduler when things fail (`rollout/scheduler.py`, `rollout/multiturn.py`): a
fill that raises keeps its carried partial responses; rejected samples and failed episodes are
left out of their group and counted, an empty group's prompt goes back to the queue; rejected
continuations are retried a bounded number of times; multi-turn episodes carry per-turn weight
versions and a weight push holds them between turns. References: the fake engine's own token /
log-prob / version log, record identities, and the versions the test itself set."""

from __future__ import annotations

import asyncio
import types

import pytest

from megatron_gspo.engines.types import RolloutResult, RolloutStats, Sample, SamplingParams
from megatron_gspo.rollout.multiturn import MultiTurn
from megatron_gspo.rollout.scheduler import (
    ContinuationRejected,
    GroupScheduler,
    PromptQueue,
    SchedulerConfig,
    StalenessError,
    check_staleness,
)
from tests.engines.fake_engine import PROMPT_LEN, FakeEngine, check_sample_against_engine
from tests.rollout.test_scheduler import G, Loader, P, _ids, _run_fills, encode, make, score


class FlakyEngine(FakeEngine):
    """The fake engine whose client "rejects" chosen samples (they are missing from the
    answer, as `SGLangClient` leaves out samples whose ids and log-probs disagree)."""

    def __init__(self, reject, **kw) -> None:
        super().__init__(**kw)
        self.reject = reject
        """`reject(prompt, sample_index, call) -> bool`."""
        self.calls = 0
        self.fail: Exception | None = None

    async def agenerate(self, prompts, sampling, *, n=1, rid_prefix=None):
        if self.fail is not None:
            await asyncio.sleep(0.005)
            raise self.fail
        self.calls += 1
        res = await super().agenerate(prompts, sampling, n=n, rid_prefix=rid_prefix)
        keep = [s for s in res.samples if not self.reject(s.prompt_ids, s.sample_index, self.calls)]
        stats = RolloutStats(num_samples=len(keep), num_rejected=len(res.samples) - len(keep))
        return RolloutResult(samples=keep, stats=stats)


def test_a_failed_fill_keeps_the_carried_groups_tokens():
    """`fill` raising (an engine error mid-fill) leaves the carried partial groups carried, with
    every token they had; the next fill continues them exactly and nothing is lost."""
    engine = FlakyEngine(lambda *a: False, stop_token=None)
    loader = Loader()
    sched = make(
        engine, loader=loader, max_new=7, oversample=2.0, partial_tokens=2, max_staleness=3
    )
    first = _run_fills(sched, 1, engine)
    before = {g.uid: [list(s.response_ids) for s in g.samples] for g in sched.carried}
    assert before and any(r for rs in before.values() for r in rs)
    engine.fail = RuntimeError("engine down")
    with pytest.raises(RuntimeError, match="engine down"):
        asyncio.run(sched.fill(engine.version))
    after = {g.uid: [list(s.response_ids) for s in g.samples] for g in sched.carried}
    assert after == before  # same groups, same tokens
    engine.fail = None
    rest = _run_fills(sched, 3, engine)
    assert sum(b.counts["continued"] for b in rest) >= len(before)
    trained = [i for b in first + rest for i in _ids(b.groups)]
    assert len(trained) == len(set(trained))
    for b in rest:
        for g in b.groups:
            for s in g.samples:
                check_sample_against_engine(engine, s)
    # every record drawn: trained, or waiting (queue front / carried), none lost
    waiting = {r.index for r in sched.queue.front} | {g.record.index for g in sched.carried}
    assert set(range(loader.pos)) == set(trained) | waiting


def test_rejected_samples_mark_their_group_and_an_empty_group_returns_its_prompt():
    """Record 1: every sample rejected on its first try -> an empty group (prompt back to the
    queue, trained in a later fill, not a dynamic-sampling drop). Record 2: one sample rejected
    -> kept, marked and counted as rejected, with G-1 samples."""
    tries: dict[tuple[int, ...], int] = {}

    def reject(prompt, j, call):
        key = tuple(prompt)
        if j == 0:
            tries[key] = tries.get(key, 0) + 1
        index = prompt[1] - 2
        return (index == 1 and tries[key] == 1) or (index == 2 and j == 0)

    engine = FlakyEngine(reject)
    sched = make(engine)
    b1, b2 = _run_fills(sched, 2, engine)
    assert 1 not in _ids(b1.groups) and 1 in _ids(b2.groups)
    m = b1.metrics()
    assert m["rollout/groups_empty"] == 1 and m["rollout/groups_dropped"] == 0
    assert m["rollout/samples_rejected"] == G + 1
    assert m["rollout/groups_rejected"] == 1  # the kept short group
    short = next(g for g in b1.groups if g.record.index == 2)
    assert short.rejected == 1 and len(short.samples) == G - 1
    assert all(len(g.samples) == G for g in b1.groups if g.record.index != 2)
    c = b1.counts
    assert c["launched"] + c["continued"] == (
        c["kept"] + c["dropped"] + c["aborted"] + c["carried"] + c["empty"]
    )


def test_rejected_continuations_are_retried_a_bounded_number_of_times():
    """A client that rejects every continuation: the fill stops with a one-line error naming
    rollout.max_continuation_retries instead of retrying forever."""
    engine = FlakyEngine(lambda prompt, j, call: len(prompt) > PROMPT_LEN, stop_token=None)
    sched = make(engine, max_new=7, partial_tokens=2, max_continuation_retries=2)

    async def go():
        return await asyncio.wait_for(sched.fill(1), timeout=20)

    with pytest.raises(ContinuationRejected, match="rollout.max_continuation_retries") as e:
        asyncio.run(go())
    assert "\n" not in str(e.value)
    assert not engine.running


def _episode(prompt_ids, j, *, failed: str | None = None) -> Sample:
    return Sample(
        prompt_ids=list(prompt_ids),
        response_ids=[7, 8],
        logprobs=[-0.1, -0.2],
        logprob_mask=[True, True],
        finish_reason="stop",
        truncated=False,
        weight_version="1",
        engine_id="fake",
        prompt_index=0,
        sample_index=j,
        failed=failed or None,
    )


def test_failed_episodes_are_left_out_and_counted():
    """Episodes marked failed (an environment error) are never in the batch; a group with some
    failed is kept, marked and counted; a group with all failed returns its prompt."""

    async def group_fn(record, prompt_ids, sampling, n, prompt_index):
        bad = {0: {0}, 1: set(range(n))}.get(record.index, set())
        return [_episode(prompt_ids, j, failed="env: boom" if j in bad else None) for j in range(n)]

    engine = FakeEngine()
    cfg = SchedulerConfig(prompts=P, group_size=G, max_new_tokens=8)
    sp = SamplingParams(max_new_tokens=8, seed=5)
    sched = GroupScheduler(engine, PromptQueue(Loader(), encode), score, cfg, sp, group_fn=group_fn)
    (batch,) = _run_fills(sched, 1, engine)
    assert 1 not in _ids(batch.groups)
    assert [r.index for r in sched.queue.front][:1] == [1]  # not consumed
    assert all(not s.failed for g in batch.groups for s in g.samples)
    m = batch.metrics()
    assert m["rollout/samples_failed"] == G + 1 and m["rollout/groups_failed"] == 1
    assert m["rollout/groups_empty"] == 1 and m["rollout/groups_dropped"] == 0
    g0 = next(g for g in batch.groups if g.record.index == 0)
    assert g0.failed == 1 and [s.sample_index for s in g0.samples] == list(range(1, G))


class TurnEngine:
    """One multi-turn model turn: two tokens, labelled with the engine's weight version (or
    "default", SGLang's label when nobody set one). Counts requests sent during a pause."""

    def __init__(self, numeric: bool) -> None:
        self.version, self.numeric, self.paused = 1, numeric, False
        self.requests, self.during_pause = 0, 0

    def pause_generation(self, mode: str = "abort") -> None:
        self.paused = True

    def continue_generation(self) -> None:
        self.paused = False

    async def agenerate(self, prompts, sampling, *, n=1, rid_prefix=None):
        (p,) = prompts
        self.requests += 1
        self.during_pause += self.paused
        await asyncio.sleep(0.001)
        s = _episode(p, 0)
        s.weight_version = str(self.version) if self.numeric else "default"
        s.finish_reason = "length"
        return RolloutResult(samples=[s], stats=RolloutStats())


class HeldEnvs:
    """An in-process `EnvPool` stand-in whose step waits until the test releases it."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.in_step = 0

    async def reset(self, record):
        return object(), None

    async def step(self, ep, text):
        self.in_step += 1
        await self.release.wait()
        return "obs", None, False

    async def close_episode(self, ep) -> None:
        return None


@pytest.mark.parametrize("numeric", [True, False], ids=["engine-label", "scheduler-version"])
def test_multiturn_tokens_carry_their_turns_version_and_a_push_holds_episodes(numeric):
    """Turn 1 under version 1, a weight push (pause, version 2, resume) while every episode is
    in its environment step, turn 2 under version 2: no request goes out during the pause, and
    each token carries its own turn's version, so the staleness metric and `check_staleness`
    see the episode's oldest turn."""
    engine = TurnEngine(numeric)
    envs = HeldEnvs()
    codec = types.SimpleNamespace(encode=lambda text, last: [50, 51, 52])
    tok = types.SimpleNamespace(decode=lambda ids, **kw: "x")
    multi = MultiTurn(engine, tok, envs, codec, max_turns=2, max_total_tokens=64)  # type: ignore[arg-type]
    cfg = SchedulerConfig(prompts=2, group_size=2, max_new_tokens=4)
    sp = SamplingParams(max_new_tokens=4, seed=5)
    sched = GroupScheduler(
        engine, PromptQueue(Loader(), encode), score, cfg, sp, group_fn=multi.group_fn
    )

    async def go():
        await sched.resume(1)
        task = asyncio.create_task(sched.fill(2))
        while envs.in_step < 4:  # every episode finished turn 1 and is in its env step
            await asyncio.sleep(0.001)
        await sched.pause()
        engine.version = 2
        envs.release.set()
        await asyncio.sleep(0.05)
        held = engine.requests
        await sched.resume(2)
        return await task, held

    batch, held = asyncio.run(go())
    assert engine.during_pause == 0 and held == 4  # only the 4 first turns before the resume
    # turn 1 (2 tokens), observation (3), turn 2 (2), observation (3)
    want = [1, 1] + [1] * 3 + [2, 2] + [2] * 3
    for g in batch.groups:
        for s in g.samples:
            assert s.token_versions == want, s.meta["turns"]
    m = batch.metrics()
    assert m["rollout/staleness_max"] == 1.0
    check_staleness(batch.groups, 2, 1)
    with pytest.raises(StalenessError):
        check_staleness(batch.groups, 2, 0)
