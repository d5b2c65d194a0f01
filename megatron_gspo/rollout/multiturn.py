"""Multi-turn rollouts: engine turns alternate with environment turns (`rollout.env`).

`MultiTurn.group_fn(record, prompt_ids, sampling, n, prompt_index) -> list[Sample]` generates one
prompt's group of `n` episodes concurrently. One episode:

    ctx = prompt_ids (+ reset observation)
    repeat up to rollout.max_turns:
        model turn: engine.agenerate([ctx]) with stop on EOS / rollout.turn_stop, at most
                    rollout.max_new_tokens and the tokens left of rollout.max_total_tokens
        env turn:   env.step(text of the model turn) in an env worker -> (obs, reward, done)
        done -> stop; else ctx += ids(obs)          (the next engine prompt is exactly ctx)

The episode's `Sample` has `prompt_ids` = the original prompt and `response_ids` = everything
after it (model and env tokens interleaved); `logprobs` are the engine's on model tokens and 0.0
on env tokens; `logprob_mask` is True only on model tokens with a finite engine log-prob, so env
tokens are context but never in the loss (the trainer's `loss_mask` is this mask).
`meta["turns"]` lists each turn as {"kind": "model"|"env", "start", "end"} (offsets into
`response_ids`), `Sample.env_reward` the env's last reward (None: score with `reward.kind`).

Run by the rollout scheduler (`scheduler.TURN_CONTEXT`), an episode waits before each model
turn while a weight push pauses generation, and ends as aborted when the fill stops. Each
response token carries the weight version of the turn that sampled it (`token_versions`; env
tokens that of the model turn before them, or of the first one), so an episode that spans a
weight push is measured by its oldest turn. An episode whose environment failed, or whose
engine turn the client rejected, is returned marked (`Sample.failed`: "env: ..." or
"rejected"); the scheduler leaves it out of the group and counts it, it is never trained.

Ids are built incrementally and never re-tokenised: each engine turn receives exactly
`prompt_ids + response_ids[:k]`, the ids the trainer trains on. Observations are tokenised on
their own: as plain text (`add_special_tokens=False`), or with a chat template (the tokenizer has
one and `data.chat_template` is on) as the template's delta for one more message of role
`tool` plus the generation prompt, after the model's turn closed (see `ObservationCodec`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from megatron_gspo.engines.protocols import Sampler
from megatron_gspo.engines.types import SEED_PROMPT_STRIDE, FinishReason, Sample, SamplingParams
from megatron_gspo.envs.pool import EnvError, EnvPool, Episode
from megatron_gspo.rollout.scheduler import TURN_CONTEXT, TurnContext

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import PromptRecord
    from megatron_gspo.data.tokenizer import Tokenizer

__all__ = ["MultiTurn", "ObservationCodec", "episode_metrics", "record_dict"]

_SENTINEL = "MGSPO7731"  # a content string no template rewrites


class ObservationCodec:
    """Token ids of an observation turn, identical for the engine and the trainer."""

    def __init__(self, tokenizer: Tokenizer, *, chat_template: bool, role: str = "tool") -> None:
        self.tokenizer = tokenizer
        self.role = role
        self.templated = bool(chat_template and getattr(tokenizer, "chat_template", None))
        if self.templated:
            self.delta("probe", [])  # a template that cannot do deltas fails at start-up

    def _render(self, messages: list[dict[str, str]], gen: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        )

    def delta(self, text: str, last_model_ids: Sequence[int]) -> str:
        """The template text that follows the model's turn: the rest of the assistant turn's
        closing (what the model did not emit itself), the observation message, and the
        generation prompt of the next assistant turn."""
        head = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENTINEL}]
        base = self._render(head, False)
        try:
            full = self._render([*head, {"role": self.role, "content": text}], True)
        except Exception:  # a template without a tool role: the observation is a user message
            self.role = "user"
            full = self._render([*head, {"role": "user", "content": text}], True)
        end = base.find(_SENTINEL)
        if end < 0 or not full.startswith(base[: end + len(_SENTINEL)]):
            raise ValueError(
                "the tokenizer's chat template renders earlier turns differently once a message "
                "follows; multi-turn rollouts need a template that appends (set "
                "data.chat_template=false to use plain text)"
            )
        end += len(_SENTINEL)
        closing = base[end:]
        emitted = self.tokenizer.decode(list(last_model_ids[-1:]), skip_special_tokens=False)
        if emitted and closing.startswith(emitted):  # e.g. the model's own <|im_end|>
            end += len(emitted)
        return full[end:]

    def encode(self, text: str, last_model_ids: Sequence[int]) -> list[int]:
        """Ids to append after the model turn `last_model_ids` for observation `text`."""
        if self.templated:
            text = self.delta(text, last_model_ids)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def record_dict(record: PromptRecord) -> dict[str, Any]:
    """A `PromptRecord` as the JSON dict an environment's `reset` receives."""
    return {
        "index": record.index,
        "prompt": record.prompt,
        "messages": record.messages,
        "answer": record.answer,
        "meta": record.meta,
    }


@dataclasses.dataclass
class MultiTurn:
    """The multi-turn rollout of one run (rank 0)."""

    engine: Sampler
    """The rollout's engines (the SGLang client): `agenerate` only."""
    tokenizer: Tokenizer
    envs: EnvPool
    codec: ObservationCodec
    max_turns: int
    """Most model turns per episode (`rollout.max_turns`)."""
    max_total_tokens: int
    """Most response tokens (model + env) per episode (`rollout.max_total_tokens`)."""
    stop_ids: tuple[int, ...] = ()
    """Token ids that end a model turn besides EOS (`rollout.turn_stop`)."""
    engines: tuple[Sampler, ...] = ()
    """Generation-only clients, one per engine, each listing every engine with a different one
    first (`engines.connect.per_engine_clients`): episode k sends all its turns to client
    k mod len, so the
    episodes spread over the engines, an episode's turns reuse one engine's prefix cache, and a
    failed request still fails over. Empty: every turn goes through `engine`."""

    async def group_fn(
        self,
        record: PromptRecord,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        n: int,
        prompt_index: int,
    ) -> list[Sample]:
        """`n` episodes for one prompt, concurrently, sorted by sample index; failed ones are
        marked `Sample.failed` (the scheduler leaves them out and counts them)."""
        return list(
            await asyncio.gather(
                *(self.episode(record, prompt_ids, sampling, prompt_index, j) for j in range(n))
            )
        )

    async def episode(
        self,
        record: PromptRecord,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        prompt_index: int,
        sample_index: int,
    ) -> Sample:
        """One episode (module docstring): reset, then model and env turns until the env is
        done, a budget is spent, the fill stops, or a call fails; the env state is dropped."""
        st = _Episode(prompt=[int(t) for t in prompt_ids], max_total=self.max_total_tokens)
        base_seed = sampling.sample_seed(prompt_index, sample_index)
        k = prompt_index * SEED_PROMPT_STRIDE + sample_index
        client = self.engines[k % len(self.engines)] if self.engines else self.engine
        ep = None
        try:
            ep, obs = await self.envs.reset(record_dict(record))
            room = st.add_env(self.codec.encode(obs, st.prompt)) if obs else True
            for turn in range(self.max_turns if room else 0):
                seed = None if base_seed is None else (base_seed + turn * 7_777_777) % (2**63 - 1)
                if not await self._turn(st, ep, client, self._turn_sampling(sampling, st, seed)):
                    break
        except EnvError as e:  # counted and reported by the pool; the episode ends here
            st.meta["env_error"], st.failed = str(e), f"env: {e}"
        finally:
            if ep is not None:
                await self.envs.close_episode(ep)
        return st.sample(prompt_index, sample_index)

    def _turn_sampling(
        self, sampling: SamplingParams, st: _Episode, seed: int | None
    ) -> SamplingParams:
        """A model turn's sampling: the tokens left of the episode's budget, EOS and
        rollout.turn_stop as stops, the turn's own seed."""
        return dataclasses.replace(
            sampling,
            max_new_tokens=min(sampling.max_new_tokens, self.max_total_tokens - len(st.resp)),
            stop_token_ids=tuple(sampling.stop_token_ids) + self.stop_ids,
            seed=seed,
        )

    async def _turn(self, st: _Episode, ep: Episode, client: Sampler, sp: SamplingParams) -> bool:
        """One model turn and the env's answer to it; False when the episode is over."""
        sched = TURN_CONTEXT.get()
        if sched is not None and not await sched.gate():  # held while weights move
            st.finish = "abort"  # the fill stopped: the group restarts from its prompt
            return False
        result = await client.agenerate([st.prompt + st.resp], sp, n=1)
        if not result.samples:  # the engine's answer was rejected (ids vs log-probs)
            st.meta["env_error"], st.failed = "engine turn rejected", "rejected"
            return False
        last = result.samples[0]
        st.add_model(last, _version(last.weight_version, sched))
        if last.finish_reason == "abort":
            st.finish = "abort"
            return False
        text = self.tokenizer.decode(last.response_ids, skip_special_tokens=True)
        obs, reward, done = await self.envs.step(ep, text)
        if reward is not None:
            st.env_reward = float(reward)
        if done:
            st.finish = "stop"
            return False
        if len(st.resp) >= self.max_total_tokens:
            return False
        return not obs or st.add_env(self.codec.encode(obs, last.response_ids))


@dataclasses.dataclass
class _Episode:
    """What one episode has built so far: the response ids (model and env tokens), their
    engine log-probs and loss mask, the turns, and how it ended."""

    prompt: list[int]
    max_total: int
    """rollout.max_total_tokens: most response tokens, model and env together."""
    resp: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    mask: list[bool] = dataclasses.field(default_factory=list)
    turns: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    env_reward: float | None = None
    failed: str | None = None
    finish: FinishReason = "length"
    last: Sample | None = None
    """The last model turn."""

    def __post_init__(self) -> None:
        self.meta.update(turns=self.turns, env_error=None)

    def add_env(self, ids: list[int]) -> bool:
        """Append env tokens (cut at the budget); False when the budget is spent."""
        ids = ids[: max(0, self.max_total - len(self.resp))]
        if ids:
            self.turns.append(
                {"kind": "env", "start": len(self.resp), "end": len(self.resp) + len(ids)}
            )
            self.resp.extend(ids)
            self.logprobs.extend([0.0] * len(ids))
            self.mask.extend([False] * len(ids))
        return len(self.resp) < self.max_total

    def add_model(self, last: Sample, version: int | None) -> None:
        """Append a model turn: its ids, engine log-probs and mask, and its weight version."""
        self.turns.append(
            {
                "kind": "model",
                "start": len(self.resp),
                "end": len(self.resp) + len(last.response_ids),
                "weight_version": last.weight_version,
                "version": version,
                "prompt_tokens": last.meta.get("prompt_tokens"),
                "engine": last.engine_id,
            }
        )
        self.resp.extend(last.response_ids)
        self.logprobs.extend(last.logprobs)
        self.mask.extend(last.logprob_mask)
        self.last = last

    def sample(self, prompt_index: int, sample_index: int) -> Sample:
        """The episode as one training sample (marked failed when no model turn ran)."""
        last, turns = self.last, self.turns
        if last is None and self.finish != "abort":  # reset failed, or the first turn rejected
            self.failed = self.failed or "env: no model turn"
        self.meta["num_model_turns"] = sum(t["kind"] == "model" for t in turns)
        self.meta["num_env_turns"] = sum(t["kind"] == "env" and t["start"] > 0 for t in turns)
        return Sample(
            prompt_ids=self.prompt,
            response_ids=self.resp,
            logprobs=self.logprobs,
            logprob_mask=self.mask,
            finish_reason=self.finish,
            truncated=self.finish != "stop",
            weight_version=last.weight_version if last else "",
            engine_id=last.engine_id if last else "",
            prompt_index=prompt_index,
            sample_index=sample_index,
            meta=self.meta,
            token_versions=token_versions(turns, len(self.resp)),
            env_reward=self.env_reward,
            failed=self.failed,
        )


def _version(label: str, sched: TurnContext | None) -> int | None:
    """A model turn's weight version: the engine's label when it is a number, else the version
    the scheduler says the engines serve (None outside a scheduler)."""
    try:
        return int(label)
    except (TypeError, ValueError):
        return None if sched is None else int(sched.version())


def token_versions(turns: Sequence[dict[str, Any]], length: int) -> list[int]:
    """Per-token weight versions of an episode's `length` response tokens: a model turn's
    tokens get its version, env tokens that of the model turn before them (of the first model
    turn when none is before). Empty when a model turn's version is unknown."""
    model = [t for t in turns if t["kind"] == "model"]
    if not model or any(t.get("version") is None for t in model):
        return []
    out = [int(model[0]["version"])] * length
    current = out[0] if length else 0
    for t in sorted(turns, key=lambda t: t["start"]):
        if t["kind"] == "model":
            current = int(t["version"])
        out[t["start"] : t["end"]] = [current] * (t["end"] - t["start"])
    return out


def episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Per-step multi-turn metrics: turns, tool-call rate (share of episodes where the env
    answered a model turn with an observation), env-token share, env rewards given."""
    if not samples:
        return {}
    k = len(samples)
    env_tokens = sum(len(s.response_ids) - sum(s.logprob_mask) for s in samples)
    tokens = sum(len(s.response_ids) for s in samples)
    return {
        "env/turns_mean": sum(s.meta.get("num_model_turns", 0) for s in samples) / k,
        "env/tool_call_rate": sum(s.meta.get("num_env_turns", 0) > 0 for s in samples) / k,
        "env/env_token_frac": env_tokens / max(1, tokens),
        "env/reward_from_env_frac": sum(s.env_reward is not None for s in samples) / k,
    }
