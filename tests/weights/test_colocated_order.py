"""Colocated memory order (issue 20, defect 5), checked on CPU by recording the calls.

On a GPU the order decides whether an engine can reclaim the trainer's freed memory and
whether a CUDA-IPC bucket's memory is reused while SGLang still reads it; on CPU the device
calls are no-ops, so the tests record the order instead of measuring memory.
"""

from __future__ import annotations

import gc
import weakref
from concurrent.futures import Future
from types import SimpleNamespace

import torch

from megatron_gspo import dist, train
from megatron_gspo.engines import wire as proto
from megatron_gspo.engines.client import SGLangClient
from megatron_gspo.engines.client_config import ClientConfig
from megatron_gspo.weights.colocated import resume_engines
from megatron_gspo.weights.stream import Bucket
from megatron_gspo.weights.transports import TensorTransport


class _Engine:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def resume_memory(self) -> None:
        self.calls.append("resume_memory")

    def release_memory(self) -> None:
        self.calls.append("release_memory")

    def update_weights_from_tensor(
        self, tensors, *, weight_version=None, flush_cache=True, layout=None
    ):
        self.calls.append(f"update:{tensors[0][0]}")


def _record(monkeypatch, calls: list[str]) -> None:
    monkeypatch.setattr(dist, "release_device_memory", lambda: calls.append("release_cache"))
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))


def test_engines_resume_only_after_every_rank_released_its_cache(monkeypatch):
    calls: list[str] = []
    _record(monkeypatch, calls)
    resume_engines(_Engine(calls), colocated=True)  # rank 0
    assert calls == ["release_cache", "barrier", "resume_memory"]
    calls.clear()
    resume_engines(None, colocated=True)  # another rank: frees and waits, talks to no engine
    assert calls == ["release_cache", "barrier"]
    calls.clear()
    resume_engines(_Engine(calls), colocated=False)
    assert calls == []


def test_tensor_transport_releases_each_bucket_after_the_engines_answered(monkeypatch):
    calls: list[str] = []
    _record(monkeypatch, calls)
    transport = TensorTransport([_Engine(calls), _Engine(calls)])
    for i in range(2):
        b = Bucket()
        b.add(f"w{i}", torch.zeros(2))
        transport.send(b, version="1", last=i == 1)
    assert calls == ["update:w0", "update:w0", "release_cache", "update:w1", "update:w1",
                     "release_cache"]  # fmt: skip


def test_client_keeps_the_flattened_bucket_until_the_engines_answer(monkeypatch):
    """The IPC payload points into the flattened bucket: it must outlive the HTTP response."""
    client = SGLangClient(ClientConfig(engine_urls=["http://127.0.0.1:9"]))
    seen: dict[str, bool] = {}
    ref: list[weakref.ref] = []

    def flatten(named):
        flat = torch.cat([t.reshape(-1) for _, t in named])
        ref.append(weakref.ref(flat))
        return flat

    def answer(route, bodies):
        fut: Future = Future()
        gc.collect()
        seen["alive_at_response"] = ref[0]() is not None
        fut.set_result(None)
        return fut

    monkeypatch.setattr(proto, "flatten_bucket", flatten)
    monkeypatch.setattr(proto, "bucket_payloads", lambda bucket, tp: ["handle"] * tp)
    monkeypatch.setattr(client, "_in_thread", answer)
    client.update_weights_from_tensor([("w", torch.ones(3))])
    gc.collect()
    assert seen == {"alive_at_response": True}
    assert ref[0]() is None  # dropped once confirmed (the next bucket may reuse the memory)
    client.close()


def test_training_loop_frees_caches_then_resumes_engines_then_pushes(monkeypatch):
    """train._loop, one colocated step, with the parts replaced by recorders: the update, the
    cache release on every rank, the engines' resume and the push come in that order."""
    calls: list[str] = []
    _record(monkeypatch, calls)
    engine = _Engine(calls)
    seq = SimpleNamespace(length=4)
    rollout = SimpleNamespace(
        engine=engine,
        next_batch=lambda: ([seq], {}),
        before_push=lambda: calls.append("before_push"),
        after_push=lambda v: None,
    )
    launch = SimpleNamespace(colocated=True, offload_trainer=False)
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(launch=launch),
        train=SimpleNamespace(steps=1, max_bad_steps=3, max_failed_reward_steps=0),
        checkpoint=SimpleNamespace(dir=None, save_every=0, export_hf_at_end=False),
    )

    def update(seqs, step):
        calls.append("update")
        return {"train/skipped_updates": 0.0}

    def push(model):
        calls.append("push")
        return SimpleNamespace(version=1, verified=False, gb_per_s=0.0)

    policy = SimpleNamespace(update=update, model=[], spec=SimpleNamespace(offload_trainer=False))
    sync = SimpleNamespace(push=push)
    log = SimpleNamespace(log=lambda step, m: None)
    stop = SimpleNamespace(agreed=lambda: False)
    train._loop(cfg, policy, rollout, sync, log, 0, stop, lambda step: {})
    step = calls[calls.index("release_memory") :]
    assert step == [
        "release_memory", "update", "release_cache", "barrier", "resume_memory", "before_push",
        "push",
    ]  # fmt: skip
