"""A deterministic in-process engine for the scheduler tests (no HTTP, no model).

Token t of a response is a pure function of the context so far (prompt + response before t)
and, for the first token only, of the sample's seed; its log-prob is a pure function of the
context, the token and the weight version. So a response continued after an abort is checked
against `reference` token by token, and every token's version is logged as it is produced.
Each token takes 1-4 x `token_s` seconds (asyncio sleep; by prompt), so groups overlap, finish
at different times, and aborts land mid-way.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from megatron_gspo.engines.types import RolloutResult, RolloutStats, Sample, SamplingParams

VOCAB = 97
STOP = 0


PROMPT_LEN = 3
"""The tests' prompts are 3 tokens: the seed picks the first response token only."""


def next_token(context: Sequence[int], seed: int | None) -> int:
    h = (sum((i + 1) * t for i, t in enumerate(context[-6:])) * 31 + len(context) * 7) % VOCAB
    if len(context) == PROMPT_LEN:
        h = (h + 13 * (seed or 0)) % VOCAB
    return h


def logprob(context: Sequence[int], token: int, version: int) -> float:
    return -((len(context) * 5 + token) % 17 + 1) / 10.0 - 0.001 * version


class FakeEngine:
    """`agenerate(prompts, sampling, n=, rid_prefix=)`, `abort`, `pause_generation`,
    `continue_generation`; the weight version is `version` (tests bump it)."""

    def __init__(self, *, token_s: float = 0.002, stop_token: int | None = STOP) -> None:
        self.version = 1
        self.token_s = token_s
        self.stop_token = stop_token
        self.aborted: set[str] = set()
        self.abort_calls: list[str] = []
        self.running: set[str] = set()
        self.paused = False
        self.requests: list[tuple[str, tuple[int, ...], int]] = []
        """(rid, prompt, max_new_tokens) of every request."""
        self.log: dict[tuple[tuple[int, ...], int], int] = {}
        """(context, token) -> version it was generated under."""
        self.tokens = 0
        self._calls = itertools.count()

    # ---- control -----------------------------------------------------------------------
    def abort(self, rid: str | None = None) -> None:
        self.abort_calls.append(rid or "*")
        self.aborted |= set(self.running) if rid is None else {rid}

    async def aabort(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self.abort(rid)

    def pause_generation(self, mode: str = "abort") -> None:
        assert mode == "abort"
        self.paused = True
        self.aborted |= set(self.running)

    def continue_generation(self) -> None:
        self.paused = False

    # ---- generation --------------------------------------------------------------------
    async def _one(self, rid: str, prompt: list[int], sp: SamplingParams, seed: int | None):
        while self.paused:  # as SGLang: a request sent during a pause waits, unregistered
            await asyncio.sleep(0.001)
        self.requests.append((rid, tuple(prompt), sp.max_new_tokens))
        self.running.add(rid)
        out: list[int] = []
        lps: list[float] = []
        version = self.version
        try:
            while True:
                if rid in self.aborted:
                    finish = "abort"
                    break
                if len(out) >= sp.max_new_tokens:
                    finish = "length"
                    break
                # prompts differ in speed (1x..4x), so groups finish far apart
                await asyncio.sleep(self.token_s * (1 + prompt[1] % 4))
                if rid in self.aborted:
                    finish = "abort"
                    break
                assert self.version == version, "a weight update landed mid-request"
                ctx = prompt + out
                tok = next_token(ctx, seed)
                out.append(tok)
                lps.append(logprob(ctx, tok, version))
                self.log[(tuple(ctx), tok)] = version
                self.tokens += 1
                if tok == self.stop_token:
                    finish = "stop"
                    break
        finally:
            self.running.discard(rid)
        return out, lps, finish, version

    async def agenerate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        n: int = 1,
        rid_prefix: str | None = None,
    ) -> RolloutResult:
        call = rid_prefix or f"call{next(self._calls)}"
        keys = [(i, j) for i in range(len(prompts)) for j in range(n)]
        outs = await asyncio.gather(
            *(
                self._one(
                    f"{call}-p{i}-s{j}", list(prompts[i]), sampling, sampling.sample_seed(i, j)
                )
                for i, j in keys
            )
        )
        samples = [
            Sample(
                prompt_ids=list(prompts[i]),
                response_ids=out,
                logprobs=lps,
                logprob_mask=[True] * len(out),
                finish_reason=finish,
                truncated=finish != "stop",
                weight_version=str(version),
                engine_id="fake",
                prompt_index=i,
                sample_index=j,
            )
            for (i, j), (out, lps, finish, version) in zip(keys, outs)
        ]
        return RolloutResult(samples=samples, stats=RolloutStats(num_samples=len(samples)))

    def generate(self, prompts, sampling, *, n=1):
        return asyncio.run(self.agenerate(prompts, sampling, n=n))


def check_sample_against_engine(engine: FakeEngine, s: Sample) -> None:
    """Every token of `s` is the engine's own next token for its context, with the log-prob
    and the version the engine logged when it produced it."""
    assert len(s.response_ids) == len(s.logprobs) == len(s.token_versions) == len(s.logprob_mask)
    for t, tok in enumerate(s.response_ids):
        ctx = s.prompt_ids + s.response_ids[:t]
        if len(ctx) > PROMPT_LEN:
            assert tok == next_token(ctx, None), (t, s.response_ids)
        version = engine.log[(tuple(ctx), tok)]
        assert s.token_versions[t] == version, (t, s.token_versions)
        assert s.logprobs[t] == logprob(ctx, tok, version)
