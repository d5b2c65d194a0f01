"""Engine faults (issue 15): an engine that fails, hangs, answers garbage or dies costs a
re-send, never a sample and never the step; a dead engine is dropped from generation, control
calls and weight syncs, and gets the full weights before it serves again.

Answers are spoiled by `helpers.FaultyProxy` in front of the in-process engine; engines that
die or hang run in subprocesses (`ServerGroup`) and get SIGKILL / SIGSTOP.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_gspo.config_io import ConfigError
from megatron_gspo.dist import free_port, free_ports
from megatron_gspo.engines.client import ClientConfig, SGLangClient
from megatron_gspo.engines.launch import LaunchConfig, ServerGroup
from megatron_gspo.engines.protocols import EngineError, NoEnginesLeft
from megatron_gspo.engines.types import SamplingParams
from megatron_gspo.weights.sync import WeightSync, WeightSyncConfig
from tests.engines.helpers import FaultyProxy, HFBridge

pytestmark = pytest.mark.timeout(300)  # a hung server must fail, not stall CI

PROMPTS = [[1, 10 + i] for i in range(6)]
SP = SamplingParams(max_new_tokens=3, ignore_eos=True, seed=11)
KEYS = [(i, j) for i in range(len(PROMPTS)) for j in range(2)]


# A healthy engine's answer must come within these on a machine at a load of 20-40: with 5 s,
# test_failing_engine_is_dropped_after_dead_after_failures failed under load ("/generate failed
# after 7 attempts": the in-process engine_a timed out on 3 of them while the proxy 503'd).
# Only the "hang" mode needs a timeout to fire, and sets its own.
HEALTHY_TIMEOUT_S = 60.0
HANG_TIMEOUT_S = 10.0  # the hung requests end here, then go to engine_a (which must answer)


def _client(urls, **kw) -> SGLangClient:
    kw = {
        "backoff_s": 0.02,
        "engine_cooldown_s": 0.3,
        "max_batch_per_request": 2,
        "request_timeout_s": HEALTHY_TIMEOUT_S,
        "control_timeout_s": HEALTHY_TIMEOUT_S,
        "connect_timeout_s": 30.0,
        **kw,
    }
    return SGLangClient(ClientConfig(engine_urls=urls, **kw))


@pytest.mark.parametrize("mode", ["5xx", "text", "shape", "mismatch", "hang"])
def test_faulty_answers_are_resent_to_another_engine(engine_a, mode):
    """5xx, a non-JSON body, JSON of the wrong shape, a sample one log-prob short, no answer
    within request_timeout_s: each is an engine fault, re-sent elsewhere; every (prompt,
    sample) comes back exactly once, with the same tokens as from a healthy engine alone."""
    proxy = FaultyProxy(engine_a.url, mode)
    try:
        timeout = {"request_timeout_s": HANG_TIMEOUT_S} if mode == "hang" else {}
        res = _client([proxy.url, engine_a.url], **timeout).generate(PROMPTS, SP, n=2)
    finally:
        proxy.stop()
    assert [s.key for s in res.samples] == KEYS  # none lost, none twice, in order
    assert proxy.hits >= 1 and res.stats.num_retries >= 1
    assert res.stats.num_resent_samples >= 1 and res.stats.num_rejected == 0
    alone = _client([engine_a.url]).generate(PROMPTS, SP, n=2)
    assert [s.response_ids for s in res.samples] == [s.response_ids for s in alone.samples]


def test_nan_logprobs_are_masked_not_trained(engine_a):
    """Decision: a non-finite log-prob is kept as 0.0 with its mask off (the token never enters
    the loss), the sample is kept and counted in num_masked_logprobs."""
    proxy = FaultyProxy(engine_a.url, "nan")
    try:
        res = _client([proxy.url]).generate(PROMPTS, SP, n=2)
    finally:
        proxy.stop()
    assert [s.key for s in res.samples] == KEYS
    assert all(s.logprob_mask[0] is False and s.logprobs[0] == 0.0 for s in res.samples)
    assert all(all(s.logprob_mask[1:]) for s in res.samples)
    assert res.stats.num_masked_logprobs == len(KEYS)


def test_failing_engine_is_dropped_after_dead_after_failures(engine_a, capfd):
    """`rollout.client.dead_after_failures`: after that many failures in a row the engine gets
    nothing more (no generation, no control call); below it, it is tried again."""
    proxy = FaultyProxy(engine_a.url, "5xx")
    try:
        keep = _client([proxy.url, engine_a.url], engine_cooldown_s=0.0, dead_after_failures=50)
        keep.generate(PROMPTS, SP, n=2)
        first = proxy.hits
        keep.generate(PROMPTS, SP, n=2)
        assert proxy.hits > first >= 1  # kept: tried again by the next call
        proxy.hits = 0
        drop = _client([proxy.url, engine_a.url], engine_cooldown_s=0.0, dead_after_failures=1)
        res = drop.generate(PROMPTS, SP, n=2)  # requests already in flight to it fail too
        first = proxy.hits
        assert first >= 1 and list(drop.pool.dead) == [proxy.url]
        assert res.stats.engines_alive == 1
        again = drop.generate(PROMPTS, SP, n=2)
        assert proxy.hits == first and [s.key for s in again.samples] == KEYS
        proxy.mode = "ok"  # it would answer now, but a dropped engine gets no control call
        assert list(drop.weight_version()) == [engine_a.url]
    finally:
        proxy.stop()
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if "dropped" in ln]
    assert len(lines) == 1 and lines[0].startswith(f"[rollout] engine {proxy.url} dropped: ")
    assert "HTTP 503" in lines[0] and "(1 of 2 engines left)" in lines[0]
    with pytest.raises(ConfigError, match="rollout.client.dead_after_failures"):
        ClientConfig(engine_urls=[engine_a.url], dead_after_failures=0)


def test_no_engine_left_is_one_clear_error():
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens
    client = _client([dead], dead_after_failures=2)
    with pytest.raises(NoEnginesLeft, match=rf"no rollout engine left .*{dead}: 2 failed") as e:
        client.generate(PROMPTS[:1], SP)
    assert "\n" not in str(e.value)
    with pytest.raises(NoEnginesLeft):
        client.begin_weight_update()
    with pytest.raises(NoEnginesLeft):  # a control call that finds none answering, too
        _client([dead]).begin_weight_update()


def test_4xx_on_a_control_call_still_fails(engine_a):
    """A refusal is the request's fault, not the engine's: it is raised, nothing dropped."""
    client = _client([engine_a.url])
    with pytest.raises(EngineError, match="no weight-update session is open"):
        client.end_weight_update()
    assert client.pool.dead == {}


# ---- engines in subprocesses: killed, hung, restarted -----------------------------------------
@pytest.fixture(scope="module")
def group(ckpt_a, tmp_path_factory):
    cfg = LaunchConfig(
        model_path=ckpt_a,
        backend="embedded",
        num_engines=2,
        # Engine i listens on base + i: reserve both, below the ephemeral range (32768-60999)
        # that outgoing connections take local ports from. free_port() held only the first, and
        # CI once lost the second: the engine exited 3, uvicorn's bind failure.
        base_port=free_ports("127.0.0.1", 2, 20000 + os.getpid() % 12000),
        max_restarts=1,
        startup_timeout_s=240,
        log_dir=str(tmp_path_factory.mktemp("engine_logs")),
    )
    g = ServerGroup(cfg)
    try:
        g.start()
        yield g
    finally:
        g.shutdown()


def _wait_answering(client: SGLangClient, url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not client._healthy([url]) and time.monotonic() < deadline:
        time.sleep(0.5)


@pytest.mark.slow  # 12-25 s: engine restarts and a full weight sync
def test_sync_goes_on_without_a_dead_engine_and_the_restarted_one_gets_the_weights(
    group, weights_b, capfd
):
    """Two engines; one is SIGKILLed between steps. The next sync completes and is verified on
    the survivor (before: the refusal failed the step). The dead engine is restarted
    (max_restarts), comes back with its initial weights, generates nothing until the next
    sync pushed it the current weights (checksums verified), then serves again."""
    url0, url1 = group.cfg.engine_urls
    client = _client(group.cfg.engine_urls, max_batch_per_request=1)
    client.pool.restart = group.restart_engine
    cfg = WeightSyncConfig(transport="tensor", experts_to_first=False, verify_every=1)
    sync = WeightSync(HFBridge(weights_b), [client], cfg)  # every push verified
    assert sync.push([]).verified
    assert client.weight_version() == {url0: "1", url1: "1"}

    group.kill_engine(0)
    report = sync.push([])  # v2: begin_weight_update finds engine 0 dead
    assert report.verified and client.weight_version() == {url1: "2"}
    assert list(client.pool.dead) == [url0] and group.restarts == {0: 1}
    err = capfd.readouterr().err
    assert f"[rollout] engine {url0} dropped: /begin_weight_update: HTTP 599" in err
    assert f"[rollout] engine {url0} restarting (1 of rollout.launch.max_restarts=1)" in err

    _wait_answering(client, url0)  # restarted, serving the initial checkpoint (ckpt_a)
    res = client.generate(PROMPTS, SP, n=2)
    assert [s.key for s in res.samples] == KEYS
    assert set(res.stats.requests_per_engine) == {url1}  # not before it has the weights
    assert (res.stats.engines_alive, res.stats.engine_restarts) == (1, 1)

    assert sync.push([]).verified  # v3: engine 0 joins, gets and is checked for weights_b
    assert client.weight_version() == {url0: "3", url1: "3"}
    res = client.generate(PROMPTS, SP, n=2)
    assert [s.key for s in res.samples] == KEYS
    assert set(res.stats.requests_per_engine) == {url0, url1}
    assert {s.weight_version for s in res.samples} == {"3"}
    assert f"[rollout] engine {url0} is back, serving weight version 3" in capfd.readouterr().err
    # restarts are bounded: the second death of engine 0 is not restarted
    assert group.restart_engine(url0, "test") is False


@pytest.mark.slow  # 12-25 s: engine restarts and a full weight sync
def test_hung_engine_is_dropped_then_rejoins_with_the_weights(group, weights_b, monkeypatch):
    """SIGSTOP: generation times out on it, drops it and goes elsewhere; the sync leaves it
    out; after SIGCONT it answers its probe, joins the next sync and serves
    that version (no restart: this client was given no restart hook)."""
    from megatron_gspo.engines import aborts

    # The generation ends once the timed-out requests' aborts on the hung engine time out
    # too: 10 s by default, 11 of this test's 18 s.
    monkeypatch.setattr(aborts, "ABORT_TIMEOUT_S", 1.0)
    url0, url1 = group.cfg.engine_urls
    client = _client(  # short: the SIGSTOPped engine is found out by these timing out
        group.cfg.engine_urls,
        max_batch_per_request=1,
        request_timeout_s=2.0,
        control_timeout_s=5.0,
        connect_timeout_s=2.0,
    )
    client.pool.restart = None
    cfg = WeightSyncConfig(transport="tensor", experts_to_first=False, verify_every=1)
    sync = WeightSync(HFBridge(weights_b), [client], cfg)  # every push verified
    _wait_answering(client, url0)
    sync.push([])
    pid = group.engines[1].pid
    os.killpg(pid, signal.SIGSTOP)
    try:
        res = client.generate(PROMPTS, SP, n=2)
        assert [s.key for s in res.samples] == KEYS and res.stats.num_retries >= 1
        assert sync.push([]).verified and url1 in client.pool.dead
        version = str(sync.version)
        assert client.weight_version() == {url0: version}
    finally:
        os.killpg(pid, signal.SIGCONT)
    assert sync.push([]).verified and client.pool.dead == {}
    version = str(sync.version)
    assert client.weight_version() == {url0: version, url1: version}
