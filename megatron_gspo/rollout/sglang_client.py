"""`SGLangClient`: the `RolloutEngine` for SGLang servers (and the embedded engine) over HTTP.

Generation: the (prompt, sample) pairs of one call are expanded client-side, each with its own
rid and seed, and sent as batched `/generate` requests of at most `max_batch_per_request`
entries, concurrently over the engines (least-loaded first, at most
`max_inflight_per_engine` requests per engine), or one pair per request through one
`sglang-router` URL (the router's schema admits no per-entry sampling params or rids). A request
that fails with a connection error, a timeout or a 5xx is re-sent, after an exponential
backoff, to another engine; the failed engine rests for `engine_cooldown_s`. A request is
accounted only when its whole response arrived, so a dead engine loses no sample and
duplicates none. A 4xx is never retried: it raises `EngineError` carrying SGLang's message.

Control calls (weights, memory, pause, abort, cache) go to every engine directly: the router
does not proxy them.
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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import aiohttp
import torch

from megatron_gspo.config_io import ConfigError
from megatron_gspo.rollout import sglang_protocol as proto
from megatron_gspo.rollout.engine import EngineError, RolloutEngine
from megatron_gspo.rollout.types import (
    RolloutResult,
    RolloutStats,
    Sample,
    SampleValidationError,
    SamplingParams,
    build_sample,
)

logger = logging.getLogger(__name__)

_RETRYABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


@dataclasses.dataclass(kw_only=True, slots=True)
class ClientConfig:
    """How the client reaches its engines."""

    engine_urls: list[str] = dataclasses.field(default_factory=list)
    """Base URL of every engine (`http://host:port`); control calls go to each of them. In a run
    config: only for engines already running (`rollout.launch: null`); launched engines fill
    it in."""
    router_url: str | None = None
    """If set, `/generate` goes through this `sglang-router` instead of client-side balancing."""
    engine_tp_sizes: list[int] | None = None
    """TP size of each engine (ranks in the weight-update group); default 1 each."""
    max_batch_per_request: int = 64
    """Most (prompt, sample) entries in one `/generate` request."""
    max_inflight_per_engine: int = 4
    """Most concurrent `/generate` requests per engine."""
    request_timeout_s: float = 1800.0
    """Total timeout of one `/generate` request."""
    control_timeout_s: float = 600.0
    """Total timeout of one control call (weight updates can be slow)."""
    connect_timeout_s: float = 10.0
    """Timeout of opening one TCP connection to an engine."""
    max_retries: int = 6
    """Re-sends of one `/generate` request before giving up."""
    backoff_s: float = 0.2
    """First retry delay; doubles per retry, capped at `backoff_max_s`."""
    backoff_max_s: float = 10.0
    """Longest retry delay."""
    engine_cooldown_s: float = 5.0
    """How long an engine that failed is skipped."""
    resubmit_aborted: int = 0
    """Times a sample that finished with `abort` (e.g. `pause_generation("abort")` during a
    weight sync) is generated again from scratch, same seed; 0 returns it flagged `abort`."""
    use_native_n: bool = False
    """Use SGLang's `n` instead of client-side expansion (unseeded sampling only)."""
    validate_requests: bool = False
    """Check every body with SGLang's own request classes before sending (tests, debugging)."""
    api_key: str | None = None
    """Bearer token if the servers run with `--api-key` / `--admin-api-key`."""

    def __post_init__(self) -> None:
        for url in self.engine_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"rollout.client.engine_urls entry {url!r} is not an http(s) URL; fix it"
                )
        self.engine_urls = [u.rstrip("/") for u in self.engine_urls]
        if self.engine_tp_sizes is None:
            self.engine_tp_sizes = [1] * len(self.engine_urls)
        if len(self.engine_tp_sizes) != len(self.engine_urls):
            raise ConfigError(
                "rollout.client.engine_tp_sizes needs one entry per rollout.client.engine_urls"
            )


@dataclasses.dataclass(slots=True)
class _Entry:
    prompt_index: int
    sample_index: int
    prompt: list[int]
    sampling: dict[str, Any]
    rid: str


class _Target:
    """One place `/generate` requests can go (an engine, or the router)."""

    def __init__(self, url: str, limit: int) -> None:
        self.url = url
        self.sem = asyncio.Semaphore(limit)
        self.inflight = 0
        self.picks = 0


class SGLangClient(RolloutEngine):
    """`RolloutEngine` over SGLang's HTTP API (real servers or the embedded engine)."""

    def __init__(self, config: ClientConfig) -> None:
        if not config.engine_urls:
            raise ValueError("SGLangClient needs at least one engine URL (engine_urls)")
        self.config = config
        self._calls = itertools.count()
        # Engines that failed rest until this time (kept across calls, so a dead engine is not
        # re-tried by every later call's first request).
        self._down_until: dict[str, float] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sglang-client")
        # Requests in flight and picks per URL over ALL concurrent `agenerate` calls, so that
        # many small calls (one per group: `rollout/scheduler.py`) still spread over engines.
        self._load: Counter = Counter()
        self._picks: Counter = Counter()

    # ---- HTTP plumbing ---------------------------------------------------------------------
    def _session(self, timeout_s: float) -> aiohttp.ClientSession:
        headers = {}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=self.config.connect_timeout_s)
        return aiohttp.ClientSession(timeout=timeout, headers=headers)

    @staticmethod
    async def _request(
        session: aiohttp.ClientSession, method: str, url: str, body: Any = None
    ) -> tuple[int, bytes]:
        async with session.request(method, url, json=body) as resp:
            return resp.status, await resp.read()

    def _validate(self, route: str, body: dict[str, Any]) -> None:
        if not self.config.validate_requests:
            return
        if route == "/generate":
            proto.validate_generate_body(body)
        elif proto.ROUTES[route][1] is not None:
            proto.validate_control_body(route, body)

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
            urls = self.config.engine_urls
            targets = [_Target(u, self.config.max_inflight_per_engine) for u in urls]
        stats = RolloutStats()
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
        return RolloutResult(samples=ordered, stats=stats)

    def _pick(self, targets: list[_Target]) -> _Target | None:
        now = time.monotonic()
        up = [t for t in targets if self._down_until.get(t.url, 0.0) <= now]
        if not up:
            return None
        # Least loaded first; among equals, the one picked least often (round robin).
        best = min(up, key=lambda t: (self._load[t.url], self._picks[t.url]))
        best.picks += 1
        self._picks[best.url] += 1
        return best

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
        redo = [
            dataclasses.replace(e, rid=f"{e.rid}-r{resubmits + 1}")
            for e in chunk
            if (e.prompt_index, e.sample_index) in aborted
        ]
        stats.num_resubmitted += len(redo)
        again = await self._send_chunk(session, targets, redo, n, stats, resubmits + 1)
        return [s for s in samples if s.key not in aborted] + again

    async def _send_once(
        self,
        session: aiohttp.ClientSession,
        targets: list[_Target],
        chunk: list[_Entry],
        n: int,
        stats: RolloutStats,
    ) -> list[Sample]:
        if n > 1:
            body = proto.generate_body_native_n([e.prompt for e in chunk], chunk[0].sampling, n)
        elif self.config.router_url:
            (e,) = chunk
            body = proto.generate_body_single(e.prompt, e.sampling, e.rid)
        else:
            body = proto.generate_body(
                [e.prompt for e in chunk], [e.sampling for e in chunk], [e.rid for e in chunk]
            )
        self._validate("/generate", body)
        cfg = self.config
        last_error = "no engine available"
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                stats.num_retries += 1
                await asyncio.sleep(min(cfg.backoff_s * 2 ** (attempt - 1), cfg.backoff_max_s))
            target = self._pick(targets)
            if target is None:
                soonest = min(self._down_until.get(t.url, 0.0) for t in targets) - time.monotonic()
                await asyncio.sleep(max(0.0, min(soonest, cfg.backoff_max_s)))
                target = self._pick(targets) or targets[0]
            target.inflight += 1
            self._load[target.url] += 1
            try:
                async with target.sem:
                    status, raw = await self._request(
                        session, "POST", target.url + "/generate", body
                    )
            except _RETRYABLE as e:
                last_error = f"{target.url}/generate: {type(e).__name__}: {e}"
                logger.warning("retrying /generate (attempt %d): %s", attempt + 1, last_error)
                self._down_until[target.url] = time.monotonic() + cfg.engine_cooldown_s
                continue
            finally:
                target.inflight -= 1
                self._load[target.url] -= 1
            if status >= 500:
                last_error = f"{target.url}/generate: HTTP {status}: {proto.error_message(raw)}"
                logger.warning("retrying /generate (attempt %d): %s", attempt + 1, last_error)
                self._down_until[target.url] = time.monotonic() + cfg.engine_cooldown_s
                continue
            if status >= 400:
                raise EngineError(
                    f"{target.url}/generate refused the request: HTTP {status}: "
                    f"{proto.error_message(raw)}",
                    status=status,
                    url=target.url,
                )
            stats.requests_per_engine[target.url] += 1
            return self._to_samples(chunk, n, json.loads(raw), target.url, stats)
        raise EngineError(
            f"/generate failed after {cfg.max_retries + 1} attempts: {last_error}", url=None
        )

    def _to_samples(
        self, chunk: list[_Entry], n: int, payload: Any, url: str, stats: RolloutStats
    ) -> list[Sample]:
        items = proto.as_response_list(payload)
        if len(items) != len(chunk) * n:
            raise EngineError(f"{url}: {len(items)} responses for {len(chunk) * n} requests")
        if n == 1:
            by_rid = {it.get("meta_info", {}).get("id"): it for it in items}
            if set(by_rid) == {e.rid for e in chunk}:
                items = [by_rid[e.rid] for e in chunk]
        out = []
        for k, item in enumerate(items):
            if self.config.validate_requests:
                proto.validate_generate_response(item)
            entry = chunk[k // n]
            meta = item.get("meta_info", {})
            try:
                out.append(
                    build_sample(
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
                )
            except SampleValidationError as e:
                logger.warning("dropping sample: %s", e)
                stats.num_rejected += 1
        return out

    # ---- control plane -------------------------------------------------------------------
    async def _acall(
        self,
        route: str,
        bodies: dict[str, dict[str, Any] | None],
        *,
        method: str = "POST",
        retries: int = 0,
    ) -> dict[str, tuple[int, bytes]]:
        """`route` on each engine URL with its body, concurrently; connection failures of
        idempotent calls (`retries` > 0) are retried, then reported as status 599."""
        for b in bodies.values():
            if b is not None:
                self._validate(route, b)

        async def one(session: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
            for attempt in range(retries + 1):
                try:
                    return await self._request(session, method, url + route, bodies[url])
                except _RETRYABLE as e:
                    if attempt == retries:
                        return 599, f"{type(e).__name__}: {e}".encode()
                    await asyncio.sleep(self.config.backoff_s * 2**attempt)
            raise AssertionError("unreachable")

        async with self._session(self.config.control_timeout_s) as session:
            got = await asyncio.gather(*(one(session, u) for u in bodies))
        return dict(zip(bodies, got))

    @staticmethod
    def _check(route: str, res: dict[str, tuple[int, bytes]]) -> dict[str, tuple[int, bytes]]:
        """Raise `EngineError` naming every engine that did not answer 200, with its message."""
        bad = {u: r for u, r in res.items() if r[0] != 200}
        if bad:
            detail = "; ".join(
                f"{u}: HTTP {s}: {proto.error_message(raw)}" for u, (s, raw) in bad.items()
            )
            raise EngineError(f"{route} failed: {detail}", status=next(iter(bad.values()))[0])
        return res

    def _control(
        self, route: str, body: dict[str, Any] | None = None, *, method: str = "POST", **kw: Any
    ) -> dict[str, tuple[int, bytes]]:
        """Call `route` with the same body on every engine and wait."""
        bodies = {u: body for u in self.config.engine_urls}
        return self._check(route, asyncio.run(self._acall(route, bodies, method=method, **kw)))

    def _in_thread(self, route: str, bodies: dict[str, dict[str, Any]]) -> Future[None]:
        """Per-engine calls in a worker thread (the caller acts on the process group meanwhile)."""

        def run() -> None:
            self._check(route, asyncio.run(self._acall(route, bodies)))

        return self._pool.submit(run)

    def set_weight_version(self, weight_version: str) -> None:
        # abort_all_requests defaults to True in SGLang: a version stamp must not kill rollouts.
        body = {"new_version": str(weight_version), "abort_all_requests": False}
        self._control("/update_weight_version", body)

    def begin_weight_update(self) -> None:
        self._control("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self._control("/end_weight_update", {})

    def update_weights_from_tensor(
        self,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        # One flattened copy for all engines, one payload per TP rank of each engine (SGLang's
        # rank r reads entry r: an engine given fewer entries than ranks fails its update).
        bucket = proto.flatten_bucket(named_tensors)
        bodies = {
            url: {
                "serialized_named_tensors": proto.bucket_payloads(bucket, tp),
                "load_format": "flattened_bucket",
                "flush_cache": flush_cache,
                "weight_version": weight_version,
            }
            for url, tp in zip(self.config.engine_urls, self.config.engine_tp_sizes, strict=True)
        }
        # The payloads are handles onto `bucket`'s memory: keep it alive until every engine
        # answered (result() below), as SGLang requires.
        self._in_thread("/update_weights_from_tensor", bodies).result()
        del bucket

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> Future[None]:
        world = 1 + sum(self.config.engine_tp_sizes)
        offsets = itertools.accumulate([1] + self.config.engine_tp_sizes[:-1])
        bodies = {
            url: {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": off,
                "world_size": world,
                "group_name": group_name,
                "backend": backend,
            }
            for url, off in zip(self.config.engine_urls, offsets)
        }
        return self._in_thread("/init_weights_update_group", bodies)

    @property
    def weight_update_world_size(self) -> int:
        """World size of the weight-update group (trainer + every engine rank)."""
        return 1 + sum(self.config.engine_tp_sizes)

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype | str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        flattened_bucket: bool = True,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> Future[None]:
        body = {
            "names": list(names),
            "dtypes": [proto.dtype_name(d) for d in dtypes],
            "shapes": [list(map(int, s)) for s in shapes],
            "group_name": group_name,
            "load_format": "flattened_bucket" if flattened_bucket else None,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        return self._in_thread(
            "/update_weights_from_distributed", {u: body for u in self.config.engine_urls}
        )

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._control("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_disk(self, path: str, *, weight_version: str | None = None) -> None:
        body = {"model_path": str(path), "weight_version": weight_version}
        self._control("/update_weights_from_disk", body)

    def weight_version(self) -> dict[str, str]:
        res = self._control("/model_info", method="GET", retries=2)
        return {u: json.loads(raw)["weight_version"] for u, (_, raw) in res.items()}

    def weights_checksum(self) -> dict[str, dict[str, Any]]:
        res = self._control("/weights_checker", {"action": "checksum"})
        return {u: json.loads(raw) for u, (_, raw) in res.items()}

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> dict[str, Any]:
        """SGLang's `/get_weights_by_name` on every engine (fp32 nested lists, truncated)."""
        body = {"name": name, "truncate_size": truncate_size}
        res = self._control("/get_weights_by_name", body)
        return {u: json.loads(raw) for u, (_, raw) in res.items()}

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        self._control("/release_memory_occupation", {"tags": list(tags) if tags else None})

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self._control("/resume_memory_occupation", {"tags": list(tags) if tags else None})

    def flush_cache(self) -> None:
        self._control("/flush_cache", retries=2)

    def pause_generation(self, mode: str = "abort") -> None:
        self._control("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._control("/continue_generation", {})

    def abort(self, rid: str | None = None) -> None:
        body = {"abort_all": True} if rid is None else {"rid": rid}
        self._control("/abort_request", body)

    def health(self) -> dict[str, bool]:
        bodies = {u: None for u in self.config.engine_urls}
        res = asyncio.run(self._acall("/health_generate", bodies, method="GET"))
        return {u: s == 200 for u, (s, _) in res.items()}

    def close(self) -> None:
        """Release the client's worker threads."""
        self._pool.shutdown(wait=False)


def requests_per_engine(results: Sequence[RolloutResult]) -> Counter:
    """Sum of `/generate` requests each engine answered over several calls."""
    total: Counter = Counter()
    for r in results:
        total.update(r.stats.requests_per_engine)
    return total
