"""`SGLangClient`: the `RolloutEngine` for SGLang servers (and the embedded engine) over HTTP.

Generation: the (prompt, sample) pairs of one call are expanded client-side, each with its own
rid and seed, and sent as batched `/generate` requests of at most `max_batch_per_request`
entries, concurrently over the engines (least-loaded first, at most
`max_inflight_per_engine` requests per engine), or one pair per request through one
`sglang-router` URL (the router's schema admits no per-entry sampling params or rids). A request
that fails with a connection error, a timeout, a 5xx or an answer that is not a usable
`/generate` answer is re-sent, after an exponential backoff, to another engine (samples whose
ids and log-probs disagree: only those); the failed engine rests for `engine_cooldown_s`. A
request is accounted only when its whole response arrived, so a dead engine loses no sample and
duplicates none. A 4xx is never retried: it raises `EngineError` carrying SGLang's message.

Engines that keep failing are dropped from generation and weight sync until they answer again
and have received the full weights (`engines.pool.EnginePool`). A request that timed out is
aborted on its engine when it is re-sent elsewhere.

Control calls (memory, pause, abort, cache, health) are `client_control.py`'s `ControlPlane`,
the weight calls `client_weights.py`'s `WeightCalls`; this module is generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp

from megatron_gspo.engines import wire as proto
from megatron_gspo.engines.aborts import Lineage, aborted_sample
from megatron_gspo.engines.client_config import ClientConfig
from megatron_gspo.engines.client_control import RETRYABLE
from megatron_gspo.engines.client_weights import WeightCalls
from megatron_gspo.engines.pool import EnginePool
from megatron_gspo.engines.protocols import EngineError
from megatron_gspo.engines.routed_experts import attach_routed_experts
from megatron_gspo.engines.types import (
    RolloutResult,
    RolloutStats,
    Sample,
    SampleValidationError,
    SamplingParams,
    build_sample,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Entry:
    prompt_index: int
    sample_index: int
    prompt: list[int]
    sampling: dict[str, Any]
    rid: str


@dataclasses.dataclass(slots=True)
class _Sending:
    """One `_send_once` call: the entries still to send, the samples so far, the last fault."""

    chunk: list[_Entry]
    n: int  # samples per entry
    attempt: int = 0
    done: list[Sample] = dataclasses.field(default_factory=list)
    last_error: str = "no engine available"
    inconsistent: bool = False  # the last fault: inconsistent samples (dropped, no error)


class _Target:
    """One place `/generate` requests can go (an engine, or the router)."""

    def __init__(self, url: str, limit: int) -> None:
        self.url = url
        self.sem = asyncio.Semaphore(limit)


class SGLangClient(WeightCalls):
    """`RolloutEngine` over SGLang's HTTP API (real servers or the embedded engine): generation
    here, the weight calls (`WeightCalls`) and the control plane (`ControlPlane`) inherited."""

    def __init__(self, config: ClientConfig, *, in_order: bool = False) -> None:
        """`in_order`: each request goes to the first usable engine in `engine_urls` order
        (sticky, e.g. one multi-turn episode per engine for its prefix cache), the others
        only when it is down; default: the least loaded."""
        if not config.engine_urls:
            raise ValueError("SGLangClient needs at least one engine URL (engine_urls)")
        self.config = config
        self._calls = itertools.count()
        self.pool = EnginePool(
            config.engine_urls,
            dead_after_failures=config.dead_after_failures,
            cooldown_s=config.engine_cooldown_s,
        )
        """Live, dead and joining engines; `make_rollout` sets `pool.restart` for launched
        engines."""
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sglang-client")
        # Requests in flight and picks per URL over ALL concurrent `agenerate` calls, so that
        # many small calls (one per group: `rollout/scheduler.py`) still spread over engines.
        self._load: Counter = Counter()
        self._picks: Counter = Counter()
        self._in_order = in_order
        self.lineage = Lineage()
        """Requests in flight and aborted lineages (what an abort must reach)."""
        self._bg = set()

    # ---- generation ----------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, n: int = 1
    ) -> RolloutResult:
        """Blocking `agenerate`."""
        return asyncio.run(self.agenerate(prompts, sampling, n=n))

    async def agenerate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        n: int = 1,
        rid_prefix: str | None = None,
    ) -> RolloutResult:
        """Generate `n` samples for each prompt; see `RolloutEngine.generate`.

        Request ids are `{rid_prefix}-p{i}-s{j}` (`rid_prefix` default: a fresh unique one), so
        a caller that names the prefix can `abort` exactly its own requests."""
        if n < 1:
            raise ValueError("n must be >= 1")
        tic = time.perf_counter()
        call = rid_prefix or f"{uuid.uuid4().hex[:8]}-{next(self._calls)}"
        native = n if self.config.use_native_n else 1  # samples per entry, SGLang-side
        if native > 1 and sampling.seed is not None:
            raise ValueError("use_native_n gives all n samples one seed; unset seed or the flag")
        entries = [
            _Entry(
                pi,
                sj,
                list(map(int, p)),
                sampling.to_sglang(seed=sampling.sample_seed(pi, sj)),
                f"{call}-p{pi}-s{sj}",
            )
            for pi, p in enumerate(prompts)
            for sj in range(n // native)
        ]
        per_req = max(1, self.config.max_batch_per_request // native)
        if self.config.router_url and native == 1:
            per_req = 1  # the router admits only one prompt per request (or native n)
        chunks = [entries[i : i + per_req] for i in range(0, len(entries), per_req)]
        if self.config.router_url:
            limit = self.config.max_inflight_per_engine * len(self.config.engine_urls)
            targets = [_Target(self.config.router_url, limit)]
        else:
            live = set(self.pool.require_live())  # in this client's order (`in_order`)
            urls = [u for u in self.config.engine_urls if u in live]
            targets = [_Target(u, self.config.max_inflight_per_engine) for u in urls]
        stats = RolloutStats()
        self.lineage.live_calls.add(call)
        async with self._session(self.config.request_timeout_s) as session:
            tasks = [
                asyncio.create_task(self._send_chunk(session, targets, c, native, stats))
                for c in chunks
            ]
            try:
                results = await asyncio.gather(*tasks)
            except BaseException:
                # One request failed for good: stop the others before the session closes.
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            finally:
                self.lineage.end_call(call)
                loop = asyncio.get_running_loop()
                mine = [t for t in list(self._bg) if t.get_loop() is loop]
                await asyncio.gather(*mine, return_exceptions=True)  # timed-out requests' aborts
        samples: dict[tuple[int, int], Sample] = {}
        for chunk_samples in results:
            for s in chunk_samples:
                if s.key in samples:  # cannot happen by construction; guard the invariant
                    raise AssertionError(f"duplicate sample {s.key}")
                samples[s.key] = s
        ordered = [samples[k] for k in sorted(samples)]
        stats.num_samples = len(ordered)
        stats.num_truncated = sum(s.finish_reason == "length" for s in ordered)
        stats.num_aborted = sum(s.finish_reason == "abort" for s in ordered)
        stats.num_masked_logprobs = sum(len(s.logprobs) - s.num_valid_logprobs for s in ordered)
        stats.wall_s = time.perf_counter() - tic
        stats.engines_alive = len(self.pool.live())
        stats.engine_restarts = self.pool.restarts
        return RolloutResult(samples=ordered, stats=stats)

    def _usable(self, target: _Target) -> bool:
        return self.config.router_url is not None or target.url in self.pool.live()

    def _pick(self, targets: list[_Target]) -> _Target | None:
        now = time.monotonic()
        up = [t for t in targets if self._usable(t) and self.pool.down_until.get(t.url, 0.0) <= now]
        if not up:
            return None
        # Least loaded first; among equals, the one picked least often (round robin).
        best = (
            up[0]
            if self._in_order
            else min(up, key=lambda t: (self._load[t.url], self._picks[t.url]))
        )
        self._picks[best.url] += 1
        return best

    async def _next_target(self, targets: list[_Target]) -> _Target:
        target = self._pick(targets)
        if target is not None:
            return target
        usable = [t for t in targets if self._usable(t)]
        if not usable:
            self.pool.require_live()  # raises NoEnginesLeft
        soonest = min(self.pool.down_until.get(t.url, 0.0) for t in usable) - time.monotonic()
        await asyncio.sleep(max(0.0, min(soonest, self.config.backoff_max_s)))
        return self._pick(targets) or usable[0]

    def _fault(self, url: str, reason: str) -> None:
        if self.config.router_url:  # the router is not an engine: rest it, drop nothing
            self.pool.down_until[url] = time.monotonic() + self.config.engine_cooldown_s
        else:
            self.pool.failed(url, reason)

    async def _send_chunk(
        self,
        session: aiohttp.ClientSession,
        targets: list[_Target],
        chunk: list[_Entry],
        n: int,
        stats: RolloutStats,
        resubmits: int = 0,
    ) -> list[Sample]:
        samples = await self._send_once(session, targets, chunk, n, stats)
        aborted = {s.key for s in samples if s.finish_reason == "abort"}
        if not aborted or n > 1 or resubmits >= self.config.resubmit_aborted:
            return samples
        redo = [  # not the ones the caller aborted itself
            dataclasses.replace(e, rid=f"{e.rid}-r{resubmits + 1}")
            for e in chunk
            if (e.prompt_index, e.sample_index) in aborted and not self.lineage.is_aborted(e.rid)
        ]
        aborted = {(e.prompt_index, e.sample_index) for e in redo}
        if not redo:
            return samples
        stats.num_resubmitted += len(redo)
        again = await self._send_chunk(session, targets, redo, n, stats, resubmits + 1)
        return [s for s in samples if s.key not in aborted] + again

    def _body(self, chunk: list[_Entry], n: int) -> dict[str, Any]:
        if n > 1:
            body = proto.generate_body_native_n([e.prompt for e in chunk], chunk[0].sampling, n)
        elif self.config.router_url:
            (e,) = chunk
            body = proto.generate_body_single(e.prompt, e.sampling, e.rid)
        else:
            body = proto.generate_body(
                [e.prompt for e in chunk], [e.sampling for e in chunk], [e.rid for e in chunk]
            )
        if self.config.return_routed_experts:
            body["return_routed_experts"] = True
        self._validate("/generate", body)
        return body

    async def _send_once(
        self,
        session: aiohttp.ClientSession,
        targets: list[_Target],
        chunk: list[_Entry],
        n: int,
        stats: RolloutStats,
    ) -> list[Sample]:
        """Generate `chunk`, re-sending to another engine what a fault left without an answer.

        Engine faults: a connection error or timeout, a 5xx, an answer that is no usable JSON
        (the whole request is re-sent), and samples whose ids and log-probs disagree (only
        those entries are re-sent). Only whole answers are accounted, so nothing is lost or
        duplicated. Entries still inconsistent after `max_retries` re-sends are dropped and
        counted (`num_rejected`) rather than failing the step.
        """
        st = _Sending(chunk=chunk, n=n)
        for st.attempt in range(self.config.max_retries + 1):
            if st.attempt:
                await self._before_resend(st, stats)
            target = await self._next_target(targets)
            answer = await self._post(session, target, st)
            if not st.chunk:  # every entry was aborted by the caller before it was sent
                return st.done
            if answer is not None and self._take_answer(st, target.url, answer, stats):
                return st.done
        if st.inconsistent:
            logger.warning("dropping %d samples: %s", len(st.chunk) * n, st.last_error)
            stats.num_rejected += len(st.chunk) * n
            return st.done
        raise EngineError(
            f"/generate failed after {self.config.max_retries + 1} attempts: {st.last_error}",
            url=None,
        )

    async def _before_resend(self, st: _Sending, stats: RolloutStats) -> None:
        """Count the re-send, give its entries fresh rids, and back off."""
        cfg, attempt = self.config, st.attempt
        stats.num_retries += 1
        stats.num_resent_samples += len(st.chunk) * st.n
        # A fresh rid: the engine that timed out may still run the first one, and SGLang
        # refuses a rid it already holds (same seed: the same sample).
        st.chunk = [dataclasses.replace(e, rid=f"{e.rid}-a{attempt}") for e in st.chunk]
        await asyncio.sleep(min(cfg.backoff_s * 2 ** (attempt - 1), cfg.backoff_max_s))

    async def _post(
        self, session: aiohttp.ClientSession, target: _Target, st: _Sending
    ) -> tuple[int, bytes] | None:
        """POST the entries the caller has not aborted to `target`: (status, body), or None
        when none is left or the engine did not answer (a fault, recorded)."""
        url, n = target.url, st.n
        self._load[url] += 1
        try:
            async with target.sem:
                # checked and registered with no await in between: an abort on this loop
                # either finds the request here or stops it from being sent
                stopped = [e for e in st.chunk if self.lineage.is_aborted(e.rid)]
                st.done += [
                    aborted_sample(x.prompt, x.prompt_index, k if n > 1 else x.sample_index)
                    for x in stopped
                    for k in range(n)
                ]
                st.chunk = [x for x in st.chunk if x not in stopped]
                if not st.chunk:
                    return None
                body = self._body(st.chunk, n)
                self.lineage.running.update({x.rid: url for x in st.chunk})
                try:
                    return await self._request(session, "POST", url + "/generate", body)
                finally:
                    for x in st.chunk:
                        self.lineage.running.pop(x.rid, None)
        except RETRYABLE as e:
            self._retry_fault(st, url, f"{type(e).__name__}: {e}")
            if isinstance(e, asyncio.TimeoutError):  # it may still run there: stop it
                self._background(self._abort_on({url: [x.rid for x in st.chunk]}))
            return None
        finally:
            self._load[url] -= 1

    def _take_answer(
        self, st: _Sending, url: str, answer: tuple[int, bytes], stats: RolloutStats
    ) -> bool:
        """Account an engine's answer: True when every entry got its samples; a 5xx, an
        unusable answer or inconsistent samples are faults (the inconsistent entries alone
        stay in `st.chunk`); a 4xx raises EngineError."""
        status, raw = answer
        if status >= 500:
            self._retry_fault(st, url, f"HTTP {status}: {proto.error_message(raw)}")
            return False
        if status >= 400:
            raise EngineError(
                f"{url}/generate refused the request: HTTP {status}: {proto.error_message(raw)}",
                status=status,
                url=url,
            )
        try:
            got, bad = self._to_samples(st.chunk, st.n, json.loads(raw), url)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
            self._retry_fault(st, url, f"unusable answer ({type(e).__name__}: {str(e)[:200]})")
            return False
        stats.requests_per_engine[url] += 1
        st.done += got
        if not bad:
            self.pool.succeeded(url)
            return True
        self._retry_fault(st, url, f"{len(bad)} inconsistent samples ({bad[0][1]})", True)
        st.chunk = [e for e, _ in bad]
        return False

    def _retry_fault(self, st: _Sending, url: str, reason: str, inconsistent: bool = False) -> None:
        """A fault of `url` the next attempt retries: logged, the engine rested or dropped."""
        st.last_error, st.inconsistent = f"{url}/generate: {reason}", inconsistent
        verb = "re-sending" if inconsistent else "retrying"
        logger.warning("%s /generate (attempt %d): %s", verb, st.attempt + 1, st.last_error)
        self._fault(url, reason)

    def _to_samples(
        self, chunk: list[_Entry], n: int, payload: object, url: str
    ) -> tuple[list[Sample], list[tuple[_Entry, str]]]:
        """The samples of a 200 answer, and the entries whose samples were inconsistent (with
        the reason). Raises ValueError & co. for an answer of the wrong shape."""
        items = proto.as_response_list(payload)
        if len(items) != len(chunk) * n:
            raise ValueError(f"{len(items)} responses for {len(chunk) * n} requests")
        if n == 1:
            by_rid = {it.get("meta_info", {}).get("id"): it for it in items}
            if set(by_rid) == {e.rid for e in chunk}:
                items = [by_rid[e.rid] for e in chunk]
        out: list[tuple[int, Sample]] = []
        bad: dict[int, str] = {}
        for k, item in enumerate(items):
            if self.config.validate_requests:
                proto.validate_generate_response(item)
            entry = chunk[k // n]
            meta = item.get("meta_info", {})
            try:
                sample = build_sample(
                    prompt_ids=entry.prompt,
                    output_ids=item.get("output_ids") or [],
                    token_logprobs=meta.get("output_token_logprobs") or [],
                    finish_reason=meta.get("finish_reason"),
                    weight_version=meta.get("weight_version"),
                    engine_id=url,
                    prompt_index=entry.prompt_index,
                    sample_index=k % n if n > 1 else entry.sample_index,
                    meta={
                        "rid": meta.get("id"),
                        "prompt_tokens": meta.get("prompt_tokens"),
                        "e2e_latency": meta.get("e2e_latency"),
                    },
                )
            except SampleValidationError as e:
                bad.setdefault(k // n, str(e))
                continue
            if self.config.return_routed_experts:
                attach_routed_experts(sample, meta, self.config.num_experts_per_tok, url)
            out.append((k // n, sample))
        # With native n an entry's samples are re-sent together: keep none of a bad entry's.
        good = [sample for i, sample in out if i not in bad]
        return good, [(chunk[i], why) for i, why in sorted(bad.items())]


def requests_per_engine(results: Sequence[RolloutResult]) -> Counter:
    """Sum of `/generate` requests each engine answered over several calls."""
    total: Counter = Counter()
    for r in results:
        total.update(r.stats.requests_per_engine)
    return total
