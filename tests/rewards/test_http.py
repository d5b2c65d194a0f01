"""reward.kind=http (`rewards/http.py`) against a local judge server that this test starts and
stops: rewards equal the judge's function called directly; answers the server refuses (503),
delays past the timeout or garbles are retried and/or counted like engine failures, never
raised; a stopped server fails every call and is counted."""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_gspo.config import RewardConfig
from megatron_gspo.config_io import ConfigError
from megatron_gspo.rewards.http import HttpReward
from megatron_gspo.rewards.pool import build_reward_pool
from megatron_gspo.rewards.toy import toy_reward


class Judge(BaseHTTPRequestHandler):
    """A classifier judge: toy_reward of the posted response. A response text picks a fault:
    "busy" answers 503 to its first attempt, "slow" sleeps past the client's timeout on every
    attempt, "garbage" answers a body that is not a reward."""

    attempts: Counter = Counter()
    auth: list[str | None] = []
    release = threading.Event()
    """Set when the test ends: a "slow" answer waits for it (past any client timeout)."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        response = body["response"]
        Judge.attempts[response] += 1
        Judge.auth.append(self.headers.get("Authorization"))
        if response == "busy" and Judge.attempts[response] == 1:
            return self._send(503, b"overloaded")
        if response == "slow":
            Judge.release.wait(60)  # answers only after the client gave up (the test ended)
        if response == "garbage":
            return self._send(200, b"<html>not json</html>")
        reward = toy_reward(body["prompt"], response, body["answer"])
        self._send(200, json.dumps({"reward": reward}).encode())

    def _send(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
            pass

    def log_message(self, *args: object) -> None:  # quiet
        pass


@pytest.fixture
def judge():
    Judge.attempts.clear()
    Judge.auth.clear()
    Judge.release.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    # server_close() joins the handler threads: a "slow" handler must not outlive the test
    # (it would count an attempt into the next test's Judge.attempts)
    server.daemon_threads = False
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score", server
    Judge.release.set()
    server.shutdown()
    server.server_close()
    thread.join(timeout=60)


def test_rewards_equal_the_judge_function_and_faults_are_counted(judge, monkeypatch):
    url, _ = judge
    monkeypatch.setenv("JUDGE_KEY", "s3cret")
    # 2 s: every prompt but "slow" must be answered within it on a loaded machine (0.3 s was
    # the whole budget of an in-process round trip at a load of 20-40 on 2 cores)
    cfg = RewardConfig(
        kind="http", url=url, timeout_s=2.0, retries=1, num_workers=3, api_key_env="JUDGE_KEY"
    )
    responses = ["12", "1", "busy", "7", "slow", "garbage", "123"]
    answers = ["12", "12", "12", "7", "12", "12", "12"]
    prompts = [f"copy {a}=" for a in answers]
    with build_reward_pool(cfg, None) as pool:
        assert isinstance(pool, HttpReward)
        batch = pool.score(prompts, responses, answers)
    want = [toy_reward(p, r, a) for p, r, a in zip(prompts, responses, answers)]
    for i, r in enumerate(responses):
        if r in ("slow", "garbage"):
            assert batch.rewards[i] == 0.0  # scored 0, counted below
        else:  # "busy": the retry got the judge's reward
            assert batch.rewards[i] == pytest.approx(want[i], rel=1e-12), r
    assert batch.timeouts == 1 and batch.failures == 1
    # busy: 1 retry; slow: timed out, retried once, timed out again; garbage: not retried
    assert batch.retries == 2
    assert Judge.attempts["busy"] == 2 and Judge.attempts["garbage"] == 1
    assert Judge.attempts["slow"] == 2
    assert batch.metrics()["reward/retries"] == 2.0
    assert set(Judge.auth) == {"Bearer s3cret"}
    report = batch.report()
    assert "timed out" in report and 'not {"reward": <number>}' in report


def test_a_stopped_server_fails_every_call_without_raising(judge):
    url, server = judge
    server.shutdown()
    server.server_close()
    with HttpReward(url, timeout_s=0.5, retries=2, concurrency=2) as pool:
        batch = pool.score(["copy 1="] * 3, ["1"] * 3, ["1"] * 3)
    assert batch.rewards == [0.0] * 3 and batch.failures == 3 and batch.retries == 6
    assert "cannot reach" in batch.errors[0] and "after 2 retries" in batch.errors[0]


def test_config_needs_a_url_for_http_and_only_then():
    with pytest.raises(ConfigError, match="reward.url"):
        RewardConfig(kind="http")
    with pytest.raises(ConfigError, match="reward.url"):
        RewardConfig(kind="toy", url="http://x")
    RewardConfig(kind="http", url="http://judge/score", num_workers=0)  # no user code here
