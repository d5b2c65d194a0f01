"""The control plane of `SGLangClient`: HTTP sessions, calls to every engine, the engine
pool's health, memory, pause and abort (`engines.protocols.MemoryControl`, `Generator`'s
control half), as a base class of the client and of its weight calls (`client_weights.py`).

Control calls go to every engine directly: the router does not proxy them. Engines that fail a
control call (no answer, 5xx) are dropped from the pool until they answer again and have
received the full weights (`engines.pool.EnginePool`); a 4xx is the request's fault and raises
`EngineError` carrying SGLang's message. Aborts reach every request an aborted one became
(retries, resubmits), on the engine that runs it, and never drop an engine (`engines/aborts.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import aiohttp

from megatron_gspo.engines import wire as proto
from megatron_gspo.engines.aborts import Lineage, abort_on
from megatron_gspo.engines.client_config import ClientConfig
from megatron_gspo.engines.pool import EnginePool
from megatron_gspo.engines.protocols import EngineError, NoEnginesLeft

__all__ = ["RETRYABLE", "ControlPlane"]

RETRYABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)
"""The faults of an HTTP call that say nothing about the request: retried, or the engine's."""


class ControlPlane:
    """HTTP plumbing and the calls every engine gets (set up by `SGLangClient.__init__`)."""

    config: ClientConfig
    pool: EnginePool
    lineage: Lineage
    _executor: ThreadPoolExecutor
    _bg: set[asyncio.Task[object]]

    # ---- HTTP plumbing ---------------------------------------------------------------------
    def _session(self, timeout_s: float) -> aiohttp.ClientSession:
        headers = {}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=self.config.connect_timeout_s)
        return aiohttp.ClientSession(timeout=timeout, headers=headers)

    @staticmethod
    async def _request(
        session: aiohttp.ClientSession, method: str, url: str, body: object = None
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

    # ---- control plane -------------------------------------------------------------------
    async def _acall(
        self,
        route: str,
        bodies: Mapping[str, dict[str, Any] | None],
        *,
        method: str = "POST",
        retries: int = 0,
        timeout_s: float | None = None,
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
                except RETRYABLE as e:
                    if attempt == retries:
                        return 599, f"{type(e).__name__}: {e}".encode()
                    await asyncio.sleep(self.config.backoff_s * 2**attempt)
            raise AssertionError("unreachable")

        async with self._session(timeout_s or self.config.control_timeout_s) as session:
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

    def _drop_failed(
        self, route: str, res: dict[str, tuple[int, bytes]]
    ) -> dict[str, tuple[int, bytes]]:
        """Drop the engines that did not answer (connection error, timeout: 599) or failed
        (5xx); the rest carry on. A 4xx is the request's fault and stays for `_check`."""
        for url, (status, raw) in list(res.items()):
            if status >= 500:
                self.pool.drop(url, f"{route}: HTTP {status}: {proto.error_message(raw)[:200]}")
                del res[url]
        if not res:
            self.pool.require_targets()  # raises NoEnginesLeft when none is left
            raise NoEnginesLeft(f"{route}: no engine answered")
        return res

    def _control(
        self,
        route: str,
        body: dict[str, Any] | None = None,
        *,
        method: str = "POST",
        retries: int = 0,
        timeout_s: float | None = None,
    ) -> dict[str, tuple[int, bytes]]:
        """Call `route` with the same body on every engine still in the pool and wait."""
        bodies = {u: body for u in self.pool.require_targets()}
        res = asyncio.run(
            self._acall(route, bodies, method=method, retries=retries, timeout_s=timeout_s)
        )
        return self._check(route, self._drop_failed(route, res))

    def _in_thread(self, route: str, bodies: dict[str, dict[str, Any]]) -> Future[None]:
        """Per-engine calls in a worker thread (the caller acts on the process group meanwhile)."""

        def run() -> None:
            self._check(route, self._drop_failed(route, asyncio.run(self._acall(route, bodies))))

        return self._executor.submit(run)

    def prepare_sync(self) -> list[str]:
        """Dropped engines that pass their health probe join this sync (full weights); returns
        every engine still joining (back, but not yet through a verified sync)."""
        self.pool.probe_dead(self._healthy)
        return sorted(self.pool.joining)

    def commit_sync(self, weight_version: str) -> None:
        self.pool.commit(weight_version)

    def _healthy(self, urls: list[str]) -> set[str]:
        # Short: a hung engine must not stall every sync; one still starting joins a later one.
        timeout = self.config.connect_timeout_s
        res = asyncio.run(
            self._acall("/health_generate", dict.fromkeys(urls), method="GET", timeout_s=timeout)
        )
        return {u for u, (status, _) in res.items() if status == 200}

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
        """Abort `rid` (and every re-sent request of its lineage), or every request."""
        if rid is None:
            targets = self.pool.control_targets()
            asyncio.run(self._abort_on({u: [None] for u in targets}))
        else:
            asyncio.run(self.aabort([rid]))

    async def aabort(self, rids: Sequence[str]) -> None:
        """Abort `rids` and every request of their lineage (retries, resubmits) on the engine
        that runs it, concurrently; a lineage not yet re-sent is not sent any more. A rid this
        client does not know goes to every engine. Never drops an engine."""
        await self._abort_on(self.lineage.plan(rids, self.pool.control_targets()))

    async def _abort_on(self, per_url: dict[str, list[str | None]]) -> None:
        await abort_on(self._session, per_url, self._validate, self._request)

    def _background(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def health(self) -> dict[str, bool]:
        bodies = {u: None for u in self.config.engine_urls}
        res = asyncio.run(self._acall("/health_generate", bodies, method="GET"))
        return {u: s == 200 for u, (s, _) in res.items()}

    def close(self) -> None:
        """Release the client's worker threads and its held weight-payload buffers."""
        self._executor.shutdown(wait=False)
        self.__dict__.pop("_direct_bufs", None)
