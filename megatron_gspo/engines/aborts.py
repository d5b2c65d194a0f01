"""Request lineage and aborts of the SGLang client (`engines.client.SGLangClient`).

A re-sent request's rid is its original's plus a suffix (`-a{k}` a retry, `-r{k}` a resubmit),
so aborting the original reaches every request it became: `Lineage` keeps rid -> engine URL of
the `/generate` entries in flight and the aborted rids whose call still runs (a lineage aborted
while it waits for its next re-send is not sent again).

SGLang 0.5.23's `AbortReq` carries one `rid`, matched exactly by the tokenizer manager (a rid it
does not hold is ignored, so a prefix never reaches the scheduler's prefix match), or
`abort_all`. So an abort is one `/abort_request` per running request, sent to the engine that
runs it only, all of them concurrently over one HTTP session; `abort_all` is not used for a set
of requests because it would also stop other clients' requests on a shared engine (evaluation,
another job). An abort that fails or times out is logged: it never drops an engine (a timeout
says the engine is busy, not that it is gone).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp

from megatron_gspo.engines import wire as proto
from megatron_gspo.engines.types import Sample

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 10.0
"""Wall limit of one abort call: SGLang answers at once (it only dispatches the abort), and a
fill's stop must not wait the control calls' long timeout on a busy engine."""

_FAULTS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


def in_lineage(rid: str, root: str) -> bool:
    """`rid` is `root` or a request re-sent for it (`root-a1`, `root-r1-a2`, ...); `root-p1-s1`
    is not an ancestor of `root-p1-s10`."""
    return rid == root or rid.startswith(root + "-")


class Lineage:
    """What an abort must reach: running entries by rid, aborted lineages of live calls."""

    def __init__(self) -> None:
        self.running: dict[str, str] = {}
        """rid -> engine URL of each `/generate` entry in flight."""
        self.aborted: set[str] = set()
        """Aborted rids whose call still runs: their lineage is not (re-)sent."""
        self.live_calls: set[str] = set()

    def is_aborted(self, rid: str) -> bool:
        return any(in_lineage(rid, r) for r in self.aborted)

    def end_call(self, call: str) -> None:
        self.live_calls.discard(call)
        self.aborted -= {r for r in self.aborted if r.startswith(call + "-")}

    def plan(self, rids: Iterable[str], all_urls: list[str]) -> dict[str, list[str | None]]:
        """Mark `rids` aborted; return url -> the running rids of their lineages there. A rid
        this client never sent (another client's) goes to every engine of `all_urls`."""
        roots = set(rids)
        ours = {r for r in roots if any(r.startswith(c + "-") for c in self.live_calls)}
        self.aborted |= ours
        per_url: dict[str, list[str | None]] = {}
        found: set[str] = set()
        for rid, url in list(self.running.items()):
            root = next((r for r in roots if in_lineage(rid, r)), None)
            if root is not None:
                per_url.setdefault(url, []).append(rid)
                found.add(root)
        for r in sorted(roots - found - ours):
            for url in all_urls:
                per_url.setdefault(url, []).append(r)
        return per_url


async def abort_on(
    session_for: Callable[[float], aiohttp.ClientSession],
    per_url: dict[str, list[str | None]],
    validate: Callable[[str, dict], None],
    request: Callable[[aiohttp.ClientSession, str, str, Any], Awaitable[tuple[int, bytes]]],
) -> None:
    """`/abort_request` for each (url, rid) concurrently (rid None: `abort_all`) through
    `request(session, method, url, body) -> (status, body)`; failures and timeouts are logged,
    never raised."""
    if not per_url:
        return

    async def one(session: aiohttp.ClientSession, url: str, rid: str | None) -> None:
        body = {"abort_all": True} if rid is None else {"rid": rid}
        validate("/abort_request", body)
        try:
            status, raw = await request(session, "POST", url + "/abort_request", body)
        except _FAULTS as e:
            logger.warning("abort of %s on %s: %s: %s", rid, url, type(e).__name__, e)
            return
        if status != 200:
            why = proto.error_message(raw)
            logger.warning("abort of %s on %s: HTTP %d: %s", rid, url, status, why)

    async with session_for(ABORT_TIMEOUT_S) as session:
        await asyncio.gather(
            *(one(session, u, r) for u, rs in per_url.items() for r in dict.fromkeys(rs))
        )


def aborted_sample(prompt: list[int], prompt_index: int, sample_index: int) -> Sample:
    """The answer for an entry aborted before it was (re-)sent: no token, `abort`."""
    return Sample(
        prompt_ids=list(prompt),
        response_ids=[],
        logprobs=[],
        finish_reason="abort",
        truncated=True,
        weight_version="",
        engine_id="",
        prompt_index=prompt_index,
        sample_index=sample_index,
        meta={"aborted_before_send": True},
    )
