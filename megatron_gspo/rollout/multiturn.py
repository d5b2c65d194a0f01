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
from typing import Any

from megatron_gspo.engines.protocols import Sampler
from megatron_gspo.engines.types import SEED_PROMPT_STRIDE, Sample, SamplingParams
from megatron_gspo.envs.pool import EnvError, EnvPool
from megatron_gspo.rollout.scheduler import TURN_CONTEXT

__all__ = ["MultiTurn", "ObservationCodec", "episode_metrics", "record_dict"]

_SENTINEL = "MGSPO7731"  # a content string no template rewrites


class ObservationCodec:
    """Token ids of an observation turn, identical for the engine and the trainer."""

    def __init__(self, tokenizer: Any, *, chat_template: bool, role: str = "tool") -> None:
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


def record_dict(record: Any) -> dict[str, Any]:
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
    tokenizer: Any
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
        record: Any,
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
        record: Any,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        prompt_index: int,
        sample_index: int,
    ) -> Sample:
        prompt = [int(t) for t in prompt_ids]
        resp: list[int] = []
        logprobs: list[float] = []
        mask: list[bool] = []
        turns: list[dict[str, Any]] = []
        meta: dict[str, Any] = {"turns": turns, "env_error": None}
        env_reward: float | None = None
        failed: str | None = None
        finish: Any = "length"
        last: Sample | None = None
        sched = TURN_CONTEXT.get()
        base_seed = sampling.sample_seed(prompt_index, sample_index)

        def add_env(ids: list[int]) -> bool:
            """Append env tokens (cut at the budget); False when the budget is spent."""
            room = self.max_total_tokens - len(resp)
            ids = ids[: max(0, room)]
            if ids:
                turns.append({"kind": "env", "start": len(resp), "end": len(resp) + len(ids)})
                resp.extend(ids)
                logprobs.extend([0.0] * len(ids))
                mask.extend([False] * len(ids))
            return len(resp) < self.max_total_tokens

        k = prompt_index * SEED_PROMPT_STRIDE + sample_index
        client = self.engines[k % len(self.engines)] if self.engines else self.engine
        ep = None
        try:
            ep, obs = await self.envs.reset(record_dict(record))
            room = add_env(self.codec.encode(obs, prompt)) if obs else True
            for turn in range(self.max_turns if room else 0):
                budget = min(sampling.max_new_tokens, self.max_total_tokens - len(resp))
                seed = None if base_seed is None else (base_seed + turn * 7_777_777) % (2**63 - 1)
                sp = dataclasses.replace(
                    sampling,
                    max_new_tokens=budget,
                    stop_token_ids=tuple(sampling.stop_token_ids) + self.stop_ids,
                    seed=seed,
                )
                if sched is not None and not await sched.gate():  # held while weights move
                    finish = "abort"  # the fill stopped: the group restarts from its prompt
                    break
                result = await client.agenerate([prompt + resp], sp, n=1)
                if not result.samples:  # the engine's answer was rejected (ids vs log-probs)
                    meta["env_error"], failed = "engine turn rejected", "rejected"
                    break
                last = result.samples[0]
                turns.append(
                    {
                        "kind": "model",
                        "start": len(resp),
                        "end": len(resp) + len(last.response_ids),
                        "weight_version": last.weight_version,
                        "version": _version(last.weight_version, sched),
                        "prompt_tokens": last.meta.get("prompt_tokens"),
                        "engine": last.engine_id,
                    }
                )
                resp.extend(last.response_ids)
                logprobs.extend(last.logprobs)
                mask.extend(last.logprob_mask)
                if last.finish_reason == "abort":
                    finish = "abort"
                    break
                text = self.tokenizer.decode(last.response_ids, skip_special_tokens=True)
                obs, reward, done = await self.envs.step(ep, text)
                if reward is not None:
                    env_reward = float(reward)
                if done:
                    finish = "stop"
                    break
                if len(resp) >= self.max_total_tokens:
                    break
                if obs and not add_env(self.codec.encode(obs, last.response_ids)):
                    break
        except EnvError as e:  # counted and reported by the pool; the episode ends here
            meta["env_error"], failed = str(e), f"env: {e}"
        finally:
            if ep is not None:
                await self.envs.close_episode(ep)
        if last is None and finish != "abort":  # reset failed, or the first turn was rejected
            failed = failed or "env: no model turn"
        meta["num_model_turns"] = sum(t["kind"] == "model" for t in turns)
        meta["num_env_turns"] = sum(t["kind"] == "env" and t["start"] > 0 for t in turns)
        return Sample(
            prompt_ids=prompt,
            response_ids=resp,
            logprobs=logprobs,
            logprob_mask=mask,
            finish_reason=finish,
            truncated=finish != "stop",
            weight_version=last.weight_version if last else "",
            engine_id=last.engine_id if last else "",
            prompt_index=prompt_index,
            sample_index=sample_index,
            meta=meta,
            token_versions=token_versions(turns, len(resp)),
            env_reward=env_reward,
            failed=failed,
        )


def _version(label: str, sched: Any) -> int | None:
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
