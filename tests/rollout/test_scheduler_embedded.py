"""The rollout scheduler on the embedded engine (SGLang's HTTP API, a real model on CPU):
partial responses continued across a weight update carry, token by token, the log-prob of the
weights that sampled them (checked against plain HF forwards of each version), and the
engine's pause(abort) semantics the asynchronous mode relies on."""

from __future__ import annotations

import asyncio
import threading
import time

from megatron_gspo.data.prompts import PromptRecord
from megatron_gspo.engines.types import SamplingParams
from megatron_gspo.rollout.scheduler import GroupScheduler, PromptQueue, SchedulerConfig
from tests.engines.helpers import hf_model, rescore, wait_generating

PROMPTS = [[1, 17, 33, 9], [1, 5, 7]]


class _Loader:
    def __init__(self) -> None:
        self.pos = 0

    def next_batch(self) -> list[PromptRecord]:
        out = [PromptRecord(index=self.pos + i, prompt=str(i)) for i in range(len(PROMPTS))]
        self.pos += len(out)
        return out

    def state_dict(self) -> dict:
        return {"pos": self.pos}


def _score(record, samples):
    return [float(len(s.response_ids)) for s in samples], {}


def test_continuation_across_a_weight_update_keeps_each_tokens_logprob(
    client_a, engine_a, ckpt_a, ckpt_b, weights_b
):
    cfg = SchedulerConfig(prompts=2, group_size=2, max_new_tokens=9, partial_tokens=3)
    sp = SamplingParams(max_new_tokens=9, seed=11, ignore_eos=True)
    queue = PromptQueue(_Loader(), lambda r: PROMPTS[r.index % len(PROMPTS)])
    sched = GroupScheduler(client_a, queue, _score, cfg, sp)
    named = sorted(weights_b.items())

    def push() -> None:
        with client_a.weight_update_session(weight_version="2"):
            client_a.update_weights_from_tensor(named)

    async def go():
        await sched.resume(1)
        served = engine_a.tm.num_requests_served
        task = asyncio.create_task(sched.fill(2))
        while engine_a.tm.num_requests_served == served:  # a first chunk is back
            await asyncio.sleep(0.01)
        await sched.pause()
        await asyncio.to_thread(push)
        await sched.resume(2)
        return await task

    client_a.set_weight_version("1")
    try:
        batch = asyncio.run(go())
    finally:
        client_a.update_weights_from_disk(ckpt_a, weight_version="default")
    refs = {1: hf_model(ckpt_a), 2: hf_model(ckpt_b)}
    versions = set()
    for g in batch.groups:
        for s in g.samples:
            assert len(s.response_ids) == 9 == len(s.token_versions) == len(s.logprobs)
            assert s.token_versions == sorted(s.token_versions)
            versions |= set(s.token_versions)
            for v, model in refs.items():
                ref = rescore(model, s.prompt_ids, s.response_ids)
                for t, tv in enumerate(s.token_versions):
                    if tv == v:
                        assert abs(ref[t] - s.logprobs[t]) < 1e-4, (t, v, s.token_versions)
    assert versions == {1, 2}  # the batch really spans the update


def test_weight_update_during_an_abort_pause_with_a_waiting_request(
    client_a, engine_a, ckpt_a, weights_b
):
    """pause(abort): a request sent during the pause waits unregistered (as in SGLang), so a
    weight update with a cache flush succeeds; the aborted request reports the version it ran
    under; after continue the waiting one runs on the new weights."""
    long = SamplingParams(max_new_tokens=400, ignore_eos=True, seed=3)
    client_a.set_weight_version("old")
    out: dict = {}
    t1 = threading.Thread(target=lambda: out.update(a=client_a.generate([[1, 2]], long)))
    t1.start()
    wait_generating(engine_a)
    client_a.pause_generation("abort")
    short = SamplingParams(max_new_tokens=3, ignore_eos=True, seed=4)
    t2 = threading.Thread(target=lambda: out.update(b=client_a.generate([[1, 3]], short)))
    t2.start()
    time.sleep(0.3)  # the second request is waiting on the pause by now
    try:
        named = [(k, v) for k, v in sorted(weights_b.items())]
        with client_a.weight_update_session(weight_version="new"):
            client_a.update_weights_from_tensor(named, flush_cache=True)
        client_a.continue_generation()
        t1.join(60)
        t2.join(60)
    finally:
        client_a.continue_generation()
        client_a.update_weights_from_disk(ckpt_a, weight_version="default")
    (a,) = out["a"].samples
    (b,) = out["b"].samples
    assert a.finish_reason == "abort" and 0 < len(a.response_ids) < 400
    assert a.weight_version == "old" and b.weight_version == "new"
    assert b.finish_reason == "length" and len(b.response_ids) == 3


def test_concurrent_small_calls_spread_over_engines(engine_a, engine_b):
    """One `agenerate` per group: concurrent calls are balanced over the engines by the
    client's in-flight count across calls (per-call counters sent every call to engine 0)."""
    from megatron_gspo.engines.client import ClientConfig, SGLangClient
    from megatron_gspo.engines.client import requests_per_engine as per_engine

    client = SGLangClient(ClientConfig(engine_urls=[engine_a.url, engine_b.url]))
    sp = SamplingParams(max_new_tokens=4, seed=1)

    async def go():
        calls = [client.agenerate([PROMPTS[k % 2]], sp, n=2) for k in range(4)]
        return await asyncio.gather(*calls)

    try:
        results = asyncio.run(go())
    finally:
        client.close()
    assert dict(per_engine(results)) == {engine_a.url: 2, engine_b.url: 2}
