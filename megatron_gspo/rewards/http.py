"""A reward served over HTTP by a model server (`reward.kind: http`): a classifier or a
generative judge running in its own process or machine.

Protocol, one request per response (the server batches concurrent requests itself, as SGLang
or a text-classification server does):

    POST reward.url   {"prompt": str, "response": str, "answer": <the record's answer>}
    200               {"reward": <finite number>}

`reward.num_workers` requests are in flight at once (0: one at a time). Failures are handled
like the rollout engines' (`engines/client.py`): a connection error, a timeout
(`reward.timeout_s` per attempt), HTTP 429 or 5xx is retried up to `reward.retries` times with
exponential backoff; any other 4xx, a body that is not JSON with a finite numeric "reward",
or the last failed retry scores 0 and is counted: `reward/timeouts` when the last attempt timed
out, else `reward/failures` (the first messages printed once per step), and every retry in
`reward/retries`. The judge never raises into the trainer. With `reward.api_key_env` the value
of that environment variable is sent as `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from megatron_gspo.rewards.batch import MAX_ERRORS_KEPT, RewardBatch

if TYPE_CHECKING:
    from megatron_gspo.rewards.config import RewardConfig

__all__ = ["HttpReward"]

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_BACKOFF_S, _BACKOFF_MAX_S = 0.2, 5.0


class _Outcome:
    __slots__ = ("reward", "error", "timed_out", "retries")

    def __init__(self) -> None:
        self.reward = 0.0
        self.error: str | None = None
        self.timed_out = False
        self.retries = 0


class HttpReward:
    """`score(prompts, responses, answers) -> RewardBatch` against a judge server; the same
    interface as `RewardPool`."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        retries: int = 2,
        concurrency: int = 1,
        api_key: str | None = None,
    ) -> None:
        if timeout_s <= 0 or retries < 0 or concurrency < 1:
            raise ValueError(
                f"need timeout_s > 0, retries >= 0, concurrency >= 1; got {timeout_s}, "
                f"{retries}, {concurrency}"
            )
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="reward-http")

    def score(
        self, prompts: Sequence[str | None], responses: Sequence[str], answers: Sequence[Any]
    ) -> RewardBatch:
        """Rewards for aligned lists of prompts, responses and answers (never raises for a
        server problem: see the module docstring)."""
        if not len(prompts) == len(responses) == len(answers):
            raise ValueError(
                f"prompts/responses/answers lengths differ: "
                f"{len(prompts)}/{len(responses)}/{len(answers)}"
            )
        t0 = time.monotonic()
        outcomes = list(self._pool.map(self._one, prompts, responses, answers))
        batch = RewardBatch(rewards=[o.reward for o in outcomes])
        for i, o in enumerate(outcomes):
            batch.retries += o.retries
            if o.error is None:
                continue
            if o.timed_out:
                batch.timeouts += 1
            else:
                batch.failures += 1
            if len(batch.errors) < MAX_ERRORS_KEPT:
                batch.errors.append(f"sample {i}: {o.error}")
        batch.time_s = time.monotonic() - t0
        return batch

    __call__ = score

    def _one(self, prompt: str | None, response: str, answer: object) -> _Outcome:
        out = _Outcome()
        try:
            body = json.dumps({"prompt": prompt, "response": response, "answer": answer})
        except (TypeError, ValueError) as e:
            out.error = f"cannot send to {self.url}: {e}"
            return out
        for attempt in range(self.retries + 1):
            if attempt:
                out.retries += 1
                time.sleep(min(_BACKOFF_MAX_S, _BACKOFF_S * 2 ** (attempt - 1)))
            retry, out.error, out.timed_out = self._attempt(body.encode(), out)
            if out.error is None or not retry:
                return out
        out.error = f"{out.error} (after {self.retries} retries)"
        return out

    def _attempt(self, body: bytes, out: _Outcome) -> tuple[bool, str | None, bool]:
        """One request: (retry?, error or None, timed out?); sets out.reward on success."""
        req = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:200].decode("utf-8", "replace")
            return e.code in _RETRY_STATUS, f"HTTP {e.code} from {self.url}: {detail}", False
        except TimeoutError as e:
            return True, f"timed out after reward.timeout_s={self.timeout_s:g} s ({e})", True
        except urllib.error.URLError as e:
            timed_out = isinstance(e.reason, TimeoutError)
            return True, f"cannot reach {self.url}: {e.reason}", timed_out
        except (ConnectionError, OSError) as e:  # reset mid-response, ...
            return True, f"connection to {self.url} failed: {e}", False
        try:
            reward = float(json.loads(raw)["reward"])
        except (ValueError, KeyError, TypeError) as e:
            return (
                False,
                f'{self.url} answered {raw[:120]!r}, not {{"reward": <number>}} ({e})',
                False,
            )
        if not math.isfinite(reward):
            return False, f"{self.url} answered a non-finite reward {reward}", False
        out.reward = reward
        return False, None, False

    def close(self) -> None:
        """Stop the request threads (idle between steps; nothing is in flight then)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> HttpReward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def http_reward_from_config(reward_cfg: RewardConfig) -> HttpReward:
    """A judge client from a `megatron_gspo.config.RewardConfig` with kind "http"."""
    key = os.environ.get(reward_cfg.api_key_env) if reward_cfg.api_key_env else None
    assert reward_cfg.url is not None, "RewardConfig requires reward.url for kind http"
    return HttpReward(
        reward_cfg.url,
        timeout_s=reward_cfg.timeout_s,
        retries=reward_cfg.retries,
        concurrency=max(1, reward_cfg.num_workers),
        api_key=key,
    )
