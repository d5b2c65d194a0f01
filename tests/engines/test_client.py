"""`SGLangClient` behaviour: every body it sends passes SGLang's validation, retries, errors."""

from __future__ import annotations

import json
import time

import pytest
import torch

from megatron_gspo.dist import free_port
from megatron_gspo.engines import wire as proto
from megatron_gspo.engines.client import ClientConfig, SGLangClient
from megatron_gspo.engines.protocols import EngineError
from megatron_gspo.engines.types import SamplingParams
from tests.engines.helpers import ThreadedApp

pytestmark = pytest.mark.timeout(240)  # a hung server must fail, not stall CI


def test_every_request_the_client_sends_passes_sglang_validation(
    engine_a, ckpt_a, weights_a, monkeypatch
):
    sent: list[tuple[str, str, object, int, bytes]] = []
    real = SGLangClient._request

    async def recording(session, method, url, body=None):
        route = "/" + url.split("/", 3)[3]
        if route in ("/init_weights_update_group", "/update_weights_from_distributed"):
            status, raw = 200, b'{"success": true, "message": "not sent"}'  # needs a trainer
        else:
            status, raw = await real(session, method, url, body)
        sent.append((method, route, body, status, raw))
        return status, raw

    monkeypatch.setattr(SGLangClient, "_request", staticmethod(recording))
    client = SGLangClient(ClientConfig(engine_urls=[engine_a.url], max_batch_per_request=3))
    client.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=3, seed=1), n=2)
    client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, temperature=0.0))
    SGLangClient(ClientConfig(engine_urls=[engine_a.url], use_native_n=True)).generate(
        [[7, 8], [9]], SamplingParams(max_new_tokens=2), n=3
    )
    named = sorted(weights_a.items())
    with client.weight_update_session(weight_version="default"):
        client.update_weights_from_tensor(named[:2], weight_version="x")
    client.init_weights_update_group("127.0.0.1", 1234, backend="gloo").result()
    with client.weight_update_session():
        client.update_weights_from_distributed(
            [n for n, _ in named], [t.dtype for _, t in named], [t.shape for _, t in named]
        ).result()
    client.update_weights_from_disk(ckpt_a, weight_version="default")
    client.weight_version()
    assert client.takes_expert_slices()  # /server_info lists our loader (engines.sglang_loader)
    client.weights_checksum()
    client.get_weights_by_name("lm_head.weight", 1)
    client.release_memory(["kv_cache"])
    client.resume_memory()
    client.pause_generation("in_place")
    client.continue_generation()
    client.abort()
    client.abort("some-rid")
    client.flush_cache()
    client.health()

    routes = {r for _, r, *_ in sent}
    assert set(proto.ROUTES) - {"/health", "/destroy_weights_update_group"} <= routes
    for method, route, body, status, raw in sent:
        assert method in proto.ROUTES[route][0], (method, route)
        assert status == 200, (route, raw)
        if route == "/generate":
            proto.validate_generate_body(body, vocab_size=128)
            items = proto.as_response_list(json.loads(raw))
            for item in items:
                proto.validate_generate_response(item)
        elif body is not None:
            parsed = proto.validate_control_body(route, body)
            assert parsed is not None
    n_gen = sum(r == "/generate" for _, r, *_ in sent)
    assert n_gen == 2 + 1 + 1  # 4 entries / 3 per request, then one request each


class FakeEngine(ThreadedApp):
    """A loopback HTTP server answering `/generate` with a fixed status (and counting)."""

    def __init__(self, status: int, message: str) -> None:
        from aiohttp import web

        self.hits = 0

        async def handler(request):
            self.hits += 1
            return web.json_response({"error": {"message": message}}, status=status)

        app = web.Application()
        app.router.add_post("/generate", handler)
        self.serve(app)


@pytest.fixture
def failing_engine():
    srv = FakeEngine(503, "engine overloaded")
    yield srv
    srv.stop()


@pytest.fixture
def refusing_engine():
    srv = FakeEngine(400, "sampling_params.top_p must be in (0, 1]")
    yield srv
    srv.stop()


def _fast(urls, **kw) -> SGLangClient:
    kw = {"backoff_s": 0.05, "engine_cooldown_s": 0.5, "max_batch_per_request": 2, **kw}
    return SGLangClient(ClientConfig(engine_urls=urls, **kw))


def test_5xx_and_connection_errors_are_retried_on_another_engine(engine_a, failing_engine):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    client = _fast([failing_engine.url, dead, engine_a.url], max_inflight_per_engine=1)
    res = client.generate([[1, i] for i in range(4)], SamplingParams(max_new_tokens=2), n=2)
    assert sorted(s.key for s in res.samples) == [(i, j) for i in range(4) for j in range(2)]
    assert failing_engine.hits >= 1 and res.stats.num_retries >= 2
    assert set(res.stats.requests_per_engine) == {engine_a.url}


def test_retries_back_off_then_fail_with_the_last_error(failing_engine):
    client = _fast(
        [failing_engine.url], max_retries=3, engine_cooldown_s=0.0, dead_after_failures=10
    )
    tic = time.perf_counter()
    with pytest.raises(EngineError, match="after 4 attempts.*HTTP 503: engine overloaded"):
        client.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    assert failing_engine.hits == 4
    assert time.perf_counter() - tic >= 0.05 + 0.1 + 0.2  # exponential backoff


def test_4xx_is_not_retried_and_carries_sglang_message(refusing_engine, engine_a):
    client = _fast([refusing_engine.url])
    with pytest.raises(EngineError, match=r"HTTP 400: sampling_params.top_p must be in") as e:
        client.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    assert e.value.status == 400 and e.value.url == refusing_engine.url
    assert refusing_engine.hits == 1
    # Control calls report SGLang's message per engine, too.
    with pytest.raises(EngineError, match="no weight-update session is open"):
        _fast([engine_a.url]).end_weight_update()


def test_expert_slices_are_asked_once_and_never_drop_an_engine(engine_a, refusing_engine):
    """`takes_expert_slices` reads each engine's `/server_info` once: an engine without the
    route (404) takes whole parameters; one that does not answer is asked again next time;
    neither is dropped from the pool (it is a question, not a failed call); engines the pool
    dropped are not asked."""
    assert _fast([engine_a.url]).takes_expert_slices()
    client = _fast([engine_a.url, refusing_engine.url])  # it serves /generate only
    assert not client.takes_expert_slices()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens
    client = _fast([engine_a.url, dead])
    assert not client.takes_expert_slices()
    assert client.__dict__["_slices"] == {engine_a.url: True}  # the dead one: asked again
    assert set(client.pool.require_targets()) == {engine_a.url, dead}
    client.pool.drop(dead, "test")  # a dropped engine gets no push, so it is not asked
    assert client.takes_expert_slices()


def test_inconsistent_sample_is_regenerated_nan_logprob_masked(engine_a, monkeypatch):
    """A sample whose ids and log-probs disagree is generated again (same seed), alone; a NaN
    log-prob is masked. When every re-send is inconsistent too, it is dropped and counted."""
    real = SGLangClient._request
    spoil = {"first": True, "always": False}

    async def corrupting(session, method, url, body=None):
        status, raw = await real(session, method, url, body)
        items = json.loads(raw)
        if spoil["first"] or spoil["always"]:
            items[0]["meta_info"]["output_token_logprobs"].pop()  # one log-prob short
        if spoil["first"]:
            items[1]["meta_info"]["output_token_logprobs"][0][0] = float("nan")
        spoil["first"] = False
        return status, json.dumps(items).encode()

    monkeypatch.setattr(SGLangClient, "_request", staticmethod(corrupting))
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True, seed=3)
    res = _fast([engine_a.url]).generate([[1, 2]], sp, n=2)
    assert [s.key for s in res.samples] == [(0, 0), (0, 1)]
    assert res.stats.num_rejected == 0 and res.stats.num_resent_samples == 1
    assert res.samples[1].logprob_mask[0] is False and res.stats.num_masked_logprobs == 1
    assert torch.isfinite(torch.tensor(res.samples[1].logprobs)).all()
    spoil["always"] = True
    res = _fast([engine_a.url], max_retries=2, dead_after_failures=10).generate([[1, 2]], sp, n=2)
    assert [s.key for s in res.samples] == [(0, 1)] and res.stats.num_rejected == 1
