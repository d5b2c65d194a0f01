"""Aborts through `SGLangClient` (`engines/aborts.py`) on the embedded engine behind
`helpers.FaultyProxy`: an abort reaches the request a retry became, a request that timed out is
aborted on its engine, each abort goes only to the engine that runs the request, and an abort
that times out drops no engine. References: the engine's own finish reasons and token counts,
and the `/abort_request` bodies each proxy received."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from megatron_gspo.engines import aborts
from megatron_gspo.engines.client import ClientConfig, SGLangClient
from megatron_gspo.engines.types import SamplingParams
from tests.engines.helpers import FaultyProxy, wait_generating

pytestmark = pytest.mark.timeout(300)

LONG = SamplingParams(max_new_tokens=480, ignore_eos=True, seed=3)


def _client(urls, **kw) -> SGLangClient:
    kw = {
        "backoff_s": 0.02,
        "engine_cooldown_s": 30.0,
        "max_batch_per_request": 1,
        "request_timeout_s": 60.0,
        "control_timeout_s": 5.0,
        "connect_timeout_s": 2.0,
        **kw,
    }
    return SGLangClient(ClientConfig(engine_urls=urls, **kw), in_order=True)


def _start(client, prompts, prefix) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        out["res"] = asyncio.run(client.agenerate(prompts, LONG, rid_prefix=prefix))

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_abort_reaches_the_retry_and_the_timed_out_request_is_aborted(engine_a):
    """The first attempt hangs on a proxy and times out: the client aborts it there, and re-sends
    it (rid + "-a1") to the healthy engine. Aborting the original rid stops the re-sent one."""
    hung = FaultyProxy(engine_a.url, "hang")
    client = _client([hung.url, engine_a.url], request_timeout_s=3.0)
    try:
        t, out = _start(client, [[1, 5, 9]], "t1")
        wait_generating(engine_a, 1)
        deadline = time.monotonic() + 120  # a bound for a hang: the abort follows the 3 s timeout
        while not hung.aborts and time.monotonic() < deadline:
            time.sleep(0.01)
        early = list(hung.aborts)  # before anybody asked for an abort
        client.abort("t1-p0-s0")
        t.join(120)
    finally:
        hung.stop()
        client.close()
    (s,) = out["res"].samples
    assert s.finish_reason == "abort" and 0 < len(s.response_ids) < LONG.max_new_tokens
    assert early == [{"rid": "t1-p0-s0"}]  # the timed-out request, on its own engine


def test_each_abort_goes_only_to_the_engine_that_runs_it(engine_a):
    """Four requests over two engines: four `/abort_request` calls, each to its own engine (not
    every rid to every engine), and every request stops."""
    proxies = [FaultyProxy(engine_a.url, "ok"), FaultyProxy(engine_a.url, "ok")]
    client = _client([p.url for p in proxies])
    client._in_order = False  # spread the requests over both
    roots = [f"t2-p{i}-s0" for i in range(4)]
    try:
        t, out = _start(client, [[1, 20 + i] for i in range(4)], "t2")
        wait_generating(engine_a, 4)
        for r in roots:
            client.abort(r)
        t.join(120)
    finally:
        for p in proxies:
            p.stop()
        client.close()
    assert all(s.finish_reason == "abort" for s in out["res"].samples)
    got = [[a["rid"] for a in p.aborts] for p in proxies]
    assert sorted(got[0] + got[1]) == roots and all(got)  # once each, both engines used


def test_an_abort_that_times_out_drops_no_engine(engine_a, monkeypatch):
    """An engine too busy to answer `/abort_request` within its limit keeps serving."""
    monkeypatch.setattr(aborts, "ABORT_TIMEOUT_S", 0.5)
    proxy = FaultyProxy(engine_a.url, "ok")
    proxy.hang_aborts = True
    client = _client([proxy.url], control_timeout_s=0.5)
    try:
        client.abort("nobody")
        client.abort()
        assert client.pool.live() == [proxy.url] and not client.pool.dead
        res = client.generate([[1, 7]], SamplingParams(max_new_tokens=2, seed=1))
    finally:
        proxy.stop()
        client.close()
    assert len(res.samples) == 1 and len(proxy.aborts) == 2
