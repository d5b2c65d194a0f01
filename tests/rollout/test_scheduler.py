"""The rollout scheduler on a deterministic fake engine: over-sampling, dynamic sampling,
aborts, partial continuation, staleness, asynchronous mode (`rollout/scheduler.py`,
`rollout/driver.py`). Identities are checked record by record; continued responses against the
engine's own token/log-prob/version log; the loss's sequence log-ratio against float64."""

from __future__ import annotations

import asyncio
import math
import time
import types

import pytest
import torch

from megatron_gspo.data.prompts import PromptRecord
from megatron_gspo.engines.types import Sample, SamplingParams
from megatron_gspo.rollout.driver import RolloutDriver
from megatron_gspo.rollout.scheduler import (
    Group,
    GroupScheduler,
    PromptQueue,
    RolloutStarved,
    SchedulerConfig,
    StalenessError,
    check_staleness,
    extend_sample,
)
from tests.engines.fake_engine import FakeEngine, check_sample_against_engine

P, G = 4, 3


class Loader:
    """Endless records with unique indices (each draw is a distinct prompt)."""

    def __init__(self, easy_every: int = 0) -> None:
        self.pos = 0
        self.easy_every = easy_every

    def next_batch(self) -> list[PromptRecord]:
        out = []
        for _ in range(P):
            easy = bool(self.easy_every) and self.pos % self.easy_every == 0
            out.append(PromptRecord(index=self.pos, prompt=f"q{self.pos}", answer=easy))
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def encode(r: PromptRecord) -> list[int]:
    return [1, 2 + r.index % 50, 3 + r.index // 50]


def score(record: PromptRecord, samples: list[Sample]) -> tuple[list[float], dict[str, float]]:
    """Easy records (answer=True) score 1 everywhere: an equal-reward group."""
    rewards = [1.0 if record.answer else float(s.response_ids[0] % 2) for s in samples]
    return rewards, {"reward/time_s": 0.0}


def make(engine, *, max_new=8, loader=None, sampling_seed=5, **kw) -> GroupScheduler:
    cfg = SchedulerConfig(prompts=P, group_size=G, max_new_tokens=max_new, **kw)
    sp = SamplingParams(max_new_tokens=max_new, seed=sampling_seed)
    return GroupScheduler(engine, PromptQueue(loader or Loader(), encode), score, cfg, sp)


def _run_fills(sched: GroupScheduler, steps: int, engine: FakeEngine) -> list:
    async def go():
        batches = []
        for _ in range(steps):
            b = await sched.fill(engine.version)
            sched.release(b)
            batches.append(b)
            await sched.pause()  # a weight push between steps
            engine.version += 1
            await sched.resume(engine.version)
        return batches

    return asyncio.run(go())


def _ids(groups) -> list[int]:
    return [g.record.index for g in groups]


def test_switches_off_equals_one_generate_call():
    """All switches off: the same P groups, in loader order, with the same samples (seeds) as
    one `generate(prompts, n=G)` call, the path before the scheduler existed."""
    engine = FakeEngine(token_s=0.0)
    sched = make(engine)
    (batch,) = _run_fills(sched, 1, engine)
    assert _ids(batch.groups) == [0, 1, 2, 3]
    engine.version = 1  # the version the batch was generated under
    old = engine.generate([encode(g.record) for g in batch.groups], sched.sampling, n=G)
    got = [s for g in batch.groups for s in g.samples]
    assert [(s.response_ids, s.logprobs) for s in got] == [
        (s.response_ids, s.logprobs) for s in old.samples
    ]
    assert batch.counts["launched"] == P and batch.counts["aborted"] == 0
    assert sched.seq_cursor == P * G


def test_oversampling_and_dropping_lose_and_duplicate_nothing():
    engine = FakeEngine()
    loader = Loader(easy_every=3)
    sched = make(engine, loader=loader, oversample=2.0, drop_equal_reward_groups=True)
    batches = _run_fills(sched, 5, engine)
    trained = [i for b in batches for i in _ids(b.groups)]
    assert len(trained) == len(set(trained)) == 5 * P  # no group trained twice
    dropped = sum(b.counts["dropped"] for b in batches)
    aborted = sum(b.counts["aborted"] for b in batches)
    assert dropped > 0 and aborted > 0 and engine.abort_calls  # aborts went to the engine
    assert not engine.running  # nothing left generating on the engine
    for b in batches:  # per fill: every launched group is accounted for once
        c = b.counts
        assert (
            c["launched"] + c["continued"] == c["kept"] + c["dropped"] + c["aborted"] + c["carried"]
        )
        assert all(len(set(g.rewards)) > 1 for g in b.groups)  # no equal-reward group kept
    # every record drawn from the loader: trained, dropped (easy), or waiting in the queue
    waiting = [r.index for r in sched.queue.front]
    assert sorted(trained + waiting) == sorted(set(trained + waiting))
    drawn = set(range(loader.pos))
    lost = drawn - set(trained) - set(waiting)
    assert len(lost) == dropped and all(i % 3 == 0 for i in lost)  # only easy ones are used up


def test_partial_rollouts_continue_exactly_across_weight_versions():
    """Chunks of 2 tokens, over-sampled: cut responses continue in later fills under newer
    weights; each trained sample is the engine's own continuation, token for token, with the
    log-prob and version the engine produced it under; every group is trained once."""
    engine = FakeEngine(stop_token=None)
    sched = make(engine, max_new=7, oversample=2.0, partial_tokens=2, max_staleness=3)
    batches = _run_fills(sched, 4, engine)
    trained = [i for b in batches for i in _ids(b.groups)]
    assert len(trained) == len(set(trained)) == 4 * P
    samples = [s for b in batches for g in b.groups for s in g.samples]
    for s in samples:
        assert len(s.response_ids) == 7 and s.finish_reason == "length"
        check_sample_against_engine(engine, s)
        assert s.token_versions == sorted(s.token_versions)
    assert any(len(set(s.token_versions)) > 1 for s in samples)  # some span a weight update
    assert any(s.chunks > 1 for s in samples)
    carried = sum(b.counts["carried"] for b in batches)
    continued = sum(b.counts["continued"] for b in batches)
    assert carried > 0 and continued > 0
    for b in batches:
        check_staleness(b.groups, b.target_version, 3)
        assert b.metrics()["rollout/staleness_max"] <= 3


def test_stale_carried_groups_restart_from_their_prompt():
    """max_staleness=1: a carried group whose oldest token would be 2 versions old restarts."""
    engine = FakeEngine(stop_token=None)
    sched = make(engine, max_new=7, oversample=3.0, partial_tokens=1, max_staleness=1)
    batches = _run_fills(sched, 4, engine)
    assert sum(b.counts["restarted"] for b in batches) > 0
    for b in batches:
        assert b.metrics()["rollout/staleness_max"] <= 1
    trained = [i for b in batches for i in _ids(b.groups)]
    assert len(trained) == len(set(trained))


def test_staleness_check_trips():
    s = Sample(
        prompt_ids=[1],
        response_ids=[5, 6],
        logprobs=[-1.0, -1.0],
        logprob_mask=[True, True],
        finish_reason="stop",
        truncated=False,
        weight_version="3",
        engine_id="e",
        prompt_index=0,
        sample_index=0,
        token_versions=[1, 3],
    )
    g = Group(uid=0, record=None, prompt_ids=[1], samples=[s])
    check_staleness([g], 3, 2)
    with pytest.raises(StalenessError, match="max_staleness=1"):
        check_staleness([g], 3, 1)


def test_starved_fill_is_a_clear_error():
    engine = FakeEngine(token_s=0.0)
    sched = make(
        engine, loader=Loader(easy_every=1), drop_equal_reward_groups=True, fill_attempts=2
    )
    with pytest.raises(RolloutStarved, match="rollout.fill_attempts"):
        asyncio.run(sched.fill(1))
    assert not engine.running


def test_checkpoint_state_holds_every_untrained_prompt():
    """Carried and waiting groups go into the state; a scheduler resumed from it trains each
    of them once and nothing twice."""
    engine = FakeEngine(stop_token=None)
    loader = Loader()
    sched = make(engine, loader=loader, max_new=7, oversample=2.0, partial_tokens=2)
    first = _run_fills(sched, 2, engine)
    state = sched.state_dict()
    pending = [r["index"] for r in state["queue"]["front"]]
    assert pending and sched.carried  # partial groups exist and are saved as prompts
    assert {g.record.index for g in sched.carried} <= set(pending)
    loader2 = Loader()
    sched2 = make(FakeEngine(stop_token=None), loader=loader2, max_new=7, oversample=2.0)
    sched2.queue.load_state_dict(state["queue"], PromptRecord)
    second = _run_fills(sched2, 3, sched2.engine)
    before = [i for b in first for i in _ids(b.groups)]
    after = [i for b in second for i in _ids(b.groups)]
    assert not set(before) & set(after)
    assert len(after) == len(set(after))
    # every prompt of the saved state, and every one drawn since, is trained after the resume
    # or still waiting in the resumed scheduler's own state: none is lost
    waiting = {r["index"] for r in sched2.state_dict()["queue"]["front"]}
    assert set(pending) | set(range(state["queue"]["loader"]["pos"], loader2.pos)) == (
        set(after) | waiting
    )
    assert not set(after) & waiting


def test_async_driver_overlaps_and_respects_the_staleness_bound():
    """Lookahead 1: the next batch is generated while the trainer "trains"; every trained
    token is at most one version behind the weights it is trained under."""
    engine = FakeEngine(stop_token=None)
    sched = make(engine, max_new=6, oversample=1.5, partial_tokens=3, max_staleness=1)
    driver = RolloutDriver(sched, lookahead=1)
    try:
        driver.resume(engine.version)
        worst = 0
        seen: list[int] = []
        for _ in range(4):
            batch, timing = driver.next_batch()
            train_version = driver.version
            assert batch.target_version == train_version  # staleness is measured against it
            for g in batch.groups:
                for s in g.samples:
                    check_sample_against_engine(engine, s)
                    worst = max(worst, train_version - min(s.token_versions))
                    assert train_version - min(s.token_versions) <= 1
            seen += _ids(batch.groups)
            assert timing["time/rollout_wait_s"] >= 0
            # "training": wait until the prefetch has produced tokens under this version
            start, deadline = engine.tokens, time.monotonic() + 30
            while engine.tokens < start + 2 and time.monotonic() < deadline:
                time.sleep(0.002)
            driver.pause()
            engine.version += 1
            driver.resume(engine.version)
        assert worst == 1  # generation really overlapped training
        assert len(seen) == len(set(seen)) == 4 * P
    finally:
        driver.close()
    assert not driver._thread.is_alive()


def test_extend_sample_concatenates_exactly():
    base = Sample(
        prompt_ids=[1, 2],
        response_ids=[7, 8],
        logprobs=[-0.5, -0.25],
        logprob_mask=[True, False],
        finish_reason="abort",
        truncated=True,
        weight_version="4",
        engine_id="e",
        prompt_index=0,
        sample_index=1,
        token_versions=[4, 4],
    )
    more = Sample(
        prompt_ids=[1, 2, 7, 8],
        response_ids=[9, 0],
        logprobs=[-0.125, -1.0],
        logprob_mask=[True, True],
        finish_reason="stop",
        truncated=False,
        weight_version="5",
        engine_id="e",
        prompt_index=3,
        sample_index=0,
    )
    s = extend_sample(base, more, 5)
    assert s.response_ids == [7, 8, 9, 0] and s.logprobs == [-0.5, -0.25, -0.125, -1.0]
    assert s.logprob_mask == [True, False, True, True] and s.token_versions == [4, 4, 5, 5]
    assert (s.prompt_ids, s.sample_index, s.finish_reason) == ([1, 2], 1, "stop")
    with pytest.raises(ValueError, match="prompt \\+ response"):
        extend_sample(base, dataclass_replace(more, prompt_ids=[1, 2, 7]), 5)


def dataclass_replace(s: Sample, **kw) -> Sample:
    import dataclasses

    return dataclasses.replace(s, **kw)


def test_sequence_log_ratio_of_a_continued_response_covers_its_model_tokens():
    """A continued sample -> TrainSequence (`Rollout._sequence`) -> packed micro-batch ->
    gspo_loss: the sequence log-ratio is the float64 mean of (new - old) over exactly the
    response tokens with a valid engine log-prob, from both chunks."""
    from megatron_gspo.algo.losses import PolicyLossConfig, PolicyLossInputs, gspo_loss
    from megatron_gspo.megatron.packing import pack
    from megatron_gspo.rollout.experience import Rollout

    engine = FakeEngine(stop_token=None)
    sched = make(engine, max_new=7, oversample=2.0, partial_tokens=2, max_staleness=3)
    batches = _run_fills(sched, 3, engine)
    s = next(s for b in batches for g in b.groups for s in g.samples if s.chunks > 2)
    s.logprob_mask[3] = False  # one invalid engine log-prob in a later chunk
    seq = Rollout._sequence(types.SimpleNamespace(next_seq_id=0), s, 1.0, 0.0, 0)
    mb = pack([seq], multiple=1)
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(len(s.response_ids), generator=gen, dtype=torch.float64) * 0.01
    new = torch.zeros_like(mb.old_logp, dtype=torch.float64)
    pos = mb.token_pos >= 0
    new[pos] = mb.old_logp[pos].double() + delta[mb.token_pos[pos]]
    batch = PolicyLossInputs(
        logp=new,
        old_logp=mb.old_logp.double(),
        advantages=torch.tensor([1.0], dtype=torch.float64),
        seq_index=mb.seq_index,
        mask=mb.mask,
        num_seqs=1,
    )
    # clip range wide open: loss = -exp(seq log-ratio) * A
    cfg = PolicyLossConfig(kind="gspo", eps_low=0.9, eps_high=10.0)
    loss, _ = gspo_loss(batch, cfg, denominator=1.0)
    valid = [t for t in range(len(s.response_ids)) if s.logprob_mask[t]]
    ref = sum(delta[t].item() for t in valid) / len(valid)
    assert math.isclose(-loss.item(), math.exp(ref), rel_tol=1e-12)
    # pi_old at each trained position is the engine log-prob of that token, from its chunk
    olds = mb.old_logp[pos][mb.token_pos[pos].argsort()]
    expect = [lp if m else 0.0 for lp, m in zip(s.logprobs, s.logprob_mask)]
    assert olds.tolist() == pytest.approx(expect, abs=1e-6)


def test_pause_waits_requests_and_resume_releases_them():
    """A fill running into a pause: nothing is sent until resume, then it completes."""
    engine = FakeEngine(stop_token=None)
    sched = make(engine, max_new=4)

    async def go():
        task = asyncio.create_task(sched.fill(1))
        await asyncio.sleep(0.01)
        await sched.pause()
        n = len(engine.requests)
        await asyncio.sleep(0.05)
        assert len(engine.requests) == n  # paused: no new request
        engine.version = 2
        await sched.resume(2)
        return await task

    batch = asyncio.run(go())
    assert len(batch.groups) == P
    for g in batch.groups:
        for s in g.samples:
            assert len(s.response_ids) == 4
            check_sample_against_engine(engine, s)


def test_custom_group_fn_decides_completion_and_empty_groups_return_their_prompt():
    """A multi-turn group_fn ends its episodes itself: a `length` finish shorter than
    max_new_tokens (max_turns used up) is complete, not regenerated forever; an `abort` finish
    restarts the group; a group_fn with no sample (every episode failed) leaves the group
    empty: its prompt goes back to the queue, it is not a dynamic-sampling drop."""
    calls: dict[int, int] = {}

    async def group_fn(record, prompt_ids, sampling, n, prompt_index):
        calls[record.index] = calls.get(record.index, 0) + 1
        if record.index % 3 == 1:
            return []  # every episode of this prompt failed
        finish = "abort" if record.index % 3 == 2 and calls[record.index] == 1 else "length"
        return [
            Sample(
                prompt_ids=list(prompt_ids),
                response_ids=[7, 8],
                logprobs=[-0.1, -0.2],
                logprob_mask=[True, False],
                finish_reason=finish,
                truncated=True,
                weight_version="1",
                engine_id="fake",
                prompt_index=prompt_index,
                sample_index=j,
            )
            for j in range(n)
        ]

    engine = FakeEngine()
    cfg = SchedulerConfig(prompts=P, group_size=G, max_new_tokens=8)
    sched = GroupScheduler(
        engine,
        PromptQueue(Loader(), encode),
        score,
        cfg,
        SamplingParams(max_new_tokens=8, seed=5),
        group_fn=group_fn,
    )
    (batch,) = _run_fills(sched, 1, engine)
    kept = _ids(batch.groups)
    assert len(kept) == P and all(i % 3 != 1 for i in kept)
    empty = [i for i in calls if i % 3 == 1]
    assert batch.counts["empty"] == len(empty) > 0 and batch.counts["dropped"] == 0
    assert [r.index for r in sched.queue.front][: len(empty)] == empty
    # completed on the first call, except an aborted one (second call); never looping
    assert all(calls[i] == (2 if i % 3 == 2 else 1) for i in kept)
    assert all(s.finish_reason == "length" for g in batch.groups for s in g.samples)
