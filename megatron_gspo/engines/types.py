"""Rollout data types shared by every engine implementation (no SGLang import here).

A `Sample` is one response to one prompt: the ids the engine generated, the engine's
log-probability of each generated id (pi_old for GSPO), and where it came from (prompt index,
sample index inside the prompt's group, engine, weight version).

Shape legend: `P` prompt tokens, `R` response tokens; `logprobs` has length `R`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # torch-free at import: the type only
    from megatron_gspo.engines.routed_experts import RoutedExperts

FinishReason = Literal["stop", "length", "abort"]

#: SGLang's `sampling_params` keys this bridge may send (the contract rejects unknown keys).
SGLANG_SAMPLING_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
    "n",
)


SEED_PROMPT_STRIDE = 1_000_003
"""Seed distance between prompts: sample `j` of prompt `i` is seeded `seed + i * stride + j`."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SamplingParams:
    """Sampling settings for one rollout call, translated to SGLang's `sampling_params`."""

    max_new_tokens: int = 128
    """Hard cap on response length; a response that hits it is flagged `truncated`."""
    temperature: float = 1.0
    """Softmax temperature; the engine's log-probs are `log_softmax(logits / temperature)`."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off). Log-probs are NOT renormalised for it (SGLang)."""
    top_k: int = -1
    """Top-k cut-off (-1 = whole vocabulary)."""
    min_p: float = 0.0
    """Min-p cut-off (0 = off)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a response (EOS ends it anyway unless `ignore_eos`)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks only)."""
    seed: int | None = None
    """Base seed; sample `j` of prompt `i` gets `seed + i * 1_000_003 + j` so samples differ.
    Honoured by the embedded engine and by SGLang's `pytorch` sampling backend only."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError("SamplingParams.max_new_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("SamplingParams.temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("SamplingParams.top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("SamplingParams.top_k must be -1 (off) or >= 1")

    def sample_seed(self, prompt_index: int, sample_index: int) -> int | None:
        """The per-sample seed (distinct per prompt and sample), or None when unseeded."""
        if self.seed is None:
            return None
        return (self.seed + prompt_index * SEED_PROMPT_STRIDE + sample_index) % (2**63 - 1)

    def to_sglang(self, *, n: int = 1, seed: int | None = None) -> dict[str, Any]:
        """The SGLang `sampling_params` dict (only keys SGLang's contract accepts)."""
        sp: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "ignore_eos": self.ignore_eos,
            "n": n,
        }
        if self.stop_token_ids:
            sp["stop_token_ids"] = list(self.stop_token_ids)
        if seed is not None:
            sp["sampling_seed"] = seed
        assert set(sp) <= set(SGLANG_SAMPLING_KEYS)
        return sp


@dataclasses.dataclass(kw_only=True, slots=True)
class Sample:
    """One generated response and everything needed to train on it."""

    prompt_ids: list[int]
    """Prompt token ids exactly as sent to the engine."""
    response_ids: list[int]
    """Generated ids as returned by the engine (EOS / stop token included)."""
    logprobs: list[float]
    """Engine log-prob of each response id (pi_old); same length as `response_ids`."""
    finish_reason: FinishReason
    """`stop` (EOS/stop token), `length` (hit max_new_tokens) or `abort`."""
    truncated: bool
    """True when the response was cut by `max_new_tokens` (or aborted) before a stop token."""
    weight_version: str
    """The engine's weight version that produced the response."""
    engine_id: str
    """Which engine (its base URL) produced the response."""
    prompt_index: int
    """Index of the prompt in the `generate` call."""
    sample_index: int
    """Index of this response inside its prompt's group (0..n-1)."""
    logprob_mask: list[bool] = dataclasses.field(default_factory=list)
    """False where the engine log-prob was not finite (never train on those tokens)."""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Metadata for debugging and metrics only (rid, prompt_tokens, e2e_latency, multi-turn
    `turns`); nothing decides control flow on it: that is the typed fields below."""
    chunks: int = 1
    """Requests this response took (> 1: continued across partial rollouts)."""
    stalled: bool = False
    """The engine ended a chunk with `length` before its budget (its context is full): the
    response is complete as it is."""
    env_reward: float | None = None
    """Multi-turn: the environment's last reward (None: scored by `reward.kind`)."""
    failed: str | None = None
    """Multi-turn: why the episode failed ("rejected": an engine turn the client rejected;
    "env: ...": the environment failed); a failed sample is never trained on."""
    token_versions: list[int] = dataclasses.field(default_factory=list)
    """Weight version that sampled each response token (filled by the rollout scheduler; a
    response continued after a weight update mixes versions). Empty: not tracked."""
    routed_experts: RoutedExperts | None = None
    """The experts the engine routed each prompt and response token to (all but the last
    response token; `ClientConfig.return_routed_experts`, for `rl.routing_replay`, a study
    control). None: not asked for."""

    @property
    def key(self) -> tuple[int, int]:
        """(prompt_index, sample_index): unique inside one `generate` call."""
        return (self.prompt_index, self.sample_index)

    @property
    def num_valid_logprobs(self) -> int:
        """Number of response tokens whose engine log-prob may be trained on."""
        return sum(self.logprob_mask)


@dataclasses.dataclass(kw_only=True, slots=True)
class RolloutStats:
    """Counters of one `generate` call; surfaced as metrics by the trainer."""

    num_samples: int = 0
    num_truncated: int = 0
    num_aborted: int = 0
    num_masked_logprobs: int = 0
    """Response tokens whose engine log-prob was NaN/inf (masked out)."""
    num_rejected: int = 0
    """Samples dropped because ids and log-probs still disagreed (length or token id) after
    every re-send (`ClientConfig.max_retries`)."""
    num_retries: int = 0
    """HTTP requests re-sent after a connection error / timeout / 5xx / garbage answer /
    inconsistent samples."""
    num_resent_samples: int = 0
    """(prompt, sample) entries those re-sent requests carried."""
    engines_alive: int = 0
    """Engines that generate at the end of the call (dropped and joining ones left out)."""
    engine_restarts: int = 0
    """Restarts of launched engines so far in the job (cumulative)."""
    num_resubmitted: int = 0
    """Aborted samples generated again (`ClientConfig.resubmit_aborted`)."""
    requests_per_engine: Counter = dataclasses.field(default_factory=Counter)
    wall_s: float = 0.0

    def as_metrics(self, prefix: str = "rollout/") -> dict[str, float]:
        """Flat float metrics for logging."""
        out = {
            f"{prefix}{k}": float(getattr(self, k))
            for k in (
                "num_samples",
                "num_truncated",
                "num_aborted",
                "num_masked_logprobs",
                "num_rejected",
                "num_retries",
                "num_resubmitted",
                "num_resent_samples",
                "engines_alive",
                "engine_restarts",
                "wall_s",
            )
        }
        return out


@dataclasses.dataclass(kw_only=True, slots=True)
class RolloutResult:
    """What `RolloutEngine.generate` returns: samples sorted by (prompt, sample) and stats."""

    samples: list[Sample]
    stats: RolloutStats


class SampleValidationError(ValueError):
    """An engine response that cannot be trained on (ids and log-probs disagree)."""


def build_sample(
    *,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    token_logprobs: Sequence[Sequence[Any]],
    finish_reason: dict[str, Any] | None,
    weight_version: str | None,
    engine_id: str,
    prompt_index: int,
    sample_index: int,
    meta: dict[str, Any] | None = None,
) -> Sample:
    """Build a `Sample` from SGLang's `output_ids` and `output_token_logprobs` entries.

    `token_logprobs` entries are SGLang's `[logprob, token_id, text]` triples. A length or
    token-id disagreement raises `SampleValidationError` (the caller counts and drops it);
    a non-finite log-prob is kept as 0.0 with `logprob_mask` False so it can never be
    trained on by accident.
    """
    output_ids = [int(t) for t in output_ids]
    if len(token_logprobs) != len(output_ids):
        raise SampleValidationError(
            f"{len(output_ids)} output ids but {len(token_logprobs)} log-probs "
            f"(prompt {prompt_index}, sample {sample_index})"
        )
    logprobs: list[float] = []
    mask: list[bool] = []
    for pos, (entry, tok) in enumerate(zip(token_logprobs, output_ids)):
        lp, entry_tok = entry[0], entry[1]
        if entry_tok is not None and int(entry_tok) != tok:
            raise SampleValidationError(
                f"log-prob entry {pos} is for token {entry_tok}, output id is {tok} "
                f"(prompt {prompt_index}, sample {sample_index})"
            )
        ok = lp is not None and math.isfinite(float(lp))
        logprobs.append(float(lp) if ok else 0.0)
        mask.append(ok)
    ftype = (finish_reason or {}).get("type", "abort")
    if ftype not in ("stop", "length", "abort"):
        raise SampleValidationError(f"unknown finish_reason {finish_reason!r}")
    return Sample(
        prompt_ids=[int(t) for t in prompt_ids],
        response_ids=output_ids,
        logprobs=logprobs,
        logprob_mask=mask,
        finish_reason=ftype,
        truncated=ftype != "stop",
        weight_version=str(weight_version) if weight_version is not None else "",
        engine_id=engine_id,
        prompt_index=prompt_index,
        sample_index=sample_index,
        meta=dict(meta or {}, finish_reason_detail=finish_reason),
    )
