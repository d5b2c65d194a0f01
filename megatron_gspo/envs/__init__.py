"""Environments for multi-turn rollouts (tool use): the interface user code implements.

An environment is a class named in the config as `rollout.env: "package.module:Class"`. It is
imported and instantiated ONLY in environment worker processes (the reward pool's sandbox:
scrubbed environment, `sandbox.max_memory_mb` / `sandbox.max_cpu_s` limits, `rollout.env_timeout_s`
per call; see `megatron_gspo.sandbox.process`), never in the trainer. One instance serves one
episode (one sample of a group):

    class MyEnv:
        def __init__(self) -> None: ...                  # no arguments
        def reset(self, record: dict) -> str | None:     # the prompt's record
            ...                                          # -> text appended after the prompt
        def step(self, model_text: str) -> tuple[str | None, float | None, bool]:
            ...                                          # -> (observation, reward, done)
        def close(self) -> None: ...                     # optional

* `record` is the prompt's JSONL record as a dict: `prompt`, `messages`, `answer`, `meta`,
  `index` (`PromptRecord` fields).
* `reset` may return an initial observation (text put into the context after the prompt, before
  the first model turn, masked from the loss) or None.
* `step` receives the text of the model's last turn (decoded, special tokens dropped; the turn
  ends at EOS, at a `rollout.turn_stop` text, or at the token budget). It returns the
  observation to append (None or "": nothing), a reward (None: no reward yet) and whether the
  episode is over. When not done, the model takes another turn on the whole context.
* The episode's reward is the last non-None reward `step` returned; when the env never gives
  one, the reward function (`reward.kind`) scores the whole response text (model and env turns
  after the prompt, as the trainer sees it). An episode also ends at `rollout.max_turns` model
  turns or `rollout.max_total_tokens` response tokens (flagged truncated).
* Everything crossing the process boundary is JSON: texts, float rewards, bools. An env call that
  raises, times out or kills its worker fails the episode (never trained), counted in
  `env/failures` and printed (first messages) once per step.
"""

from __future__ import annotations

import importlib
import math
import traceback
from typing import Any

__all__ = ["env_call", "load_env_class"]


def load_env_class(spec: str) -> type:
    """Resolve "package.module:Class" (imported: call this in a worker only)."""
    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise ValueError(f'rollout.env={spec!r} is not "module:Class"')
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"rollout.env={spec!r}: cannot import {module_name!r} ({e})") from e
    cls: Any = module
    for part in attr.split("."):
        cls = getattr(cls, part, None)
        if cls is None:
            raise ValueError(f"rollout.env={spec!r}: {module_name!r} has no attribute {attr!r}")
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise ValueError(f"rollout.env={spec!r}: {attr!r} has no {method}() method")
    return cls


def _error(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    at = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
    return f"{type(e).__name__}: {e}{at}"[:400]


def _check_step(result: object) -> tuple[str | None, float | None, bool]:
    if not (isinstance(result, tuple | list) and len(result) == 3):
        raise TypeError(f"step() must return (observation, reward, done), got {result!r:.80}")
    obs, reward, done = result
    if obs is not None and not isinstance(obs, str):
        raise TypeError(f"step() observation must be str or None, got {type(obs).__name__}")
    if reward is not None:
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"step() returned a non-finite reward {reward}")
    return obs or None, reward, bool(done)


def env_call(cls: type, episodes: dict[Any, Any], req: dict[str, Any]) -> dict[str, Any]:
    """Run one worker request against the episodes of this worker (guarded: user errors come
    back as the reply's `error`, never as an exception)."""
    op, ep = req.get("op"), req.get("ep")
    reply: dict[str, Any] = {"id": req.get("id"), "error": None}
    try:
        if op == "reset":
            env = cls()
            episodes[ep] = env
            obs = env.reset(req["record"])
            if obs is not None and not isinstance(obs, str):
                raise TypeError(f"reset() must return str or None, got {type(obs).__name__}")
            reply["obs"] = obs or None
        elif op == "step":
            if ep not in episodes:
                raise KeyError(f"episode {ep!r} is not open in this worker")
            reply["obs"], reply["reward"], reply["done"] = _check_step(
                episodes[ep].step(req["text"])
            )
        elif op == "close":
            env = episodes.pop(ep, None)
            if env is not None and callable(getattr(env, "close", None)):
                env.close()
        else:
            raise ValueError(f"unknown env op {op!r}")
    except Exception as e:  # a user env's bug costs one episode, not the run
        reply["error"] = _error(e)
        if op != "close":
            episodes.pop(ep, None)
    return reply
