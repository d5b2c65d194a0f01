"""The agent side of a sandbox worker (`python -m megatron_gspo.sandbox.worker agent SPEC`).

SPEC is the user's agent, `rollout.agent: "package.module:function"`:

    def my_agent(record: dict, client: openai.OpenAI) -> float | None:
        ...   # any code written against the OpenAI API; `client` talks to the policy

`record` is the prompt's JSONL record (`prompt`, `messages`, `answer`, `meta`, `index`);
`client` is a real `openai.OpenAI` whose base URL names this episode's trajectory, so every call
the agent makes (with this client, or with its own client on `client.base_url`) is recorded
token-exact by the endpoint. The return value is the episode's reward; None leaves it to
`reward.kind` (which scores the text of the agent's last model turn).

Protocol (JSON lines, as the other worker kinds):
    {"id", "record", "base_url", "trajectory_id", "timeout_s"} -> {"id", "reward", "error"}
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from megatron_gspo.sandbox.limits import arm_cpu, memory_message

__all__ = ["agent_loop", "load_agent_fn", "run_agent"]

AgentFn = Callable[[dict[str, Any], Any], Any]


def load_agent_fn(spec: str) -> AgentFn:
    """Resolve "package.module:function" (imported: call this in a worker only)."""
    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise ValueError(f'rollout.agent={spec!r} is not "module:function"')
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"rollout.agent={spec!r}: cannot import {module_name!r} ({e})") from e
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"rollout.agent={spec!r}: {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"rollout.agent={spec!r}: {attr!r} is not callable")
    return fn


def run_agent(fn: AgentFn, req: dict[str, Any]) -> tuple[float | None, str | None]:
    """One guarded episode: (reward or None, None) or (None, error message)."""
    import openai

    client = openai.OpenAI(
        base_url=f"{req['base_url']}/t/{req['trajectory_id']}/v1",
        api_key="megatron-gspo",  # the endpoint needs none; the client insists on one
        timeout=float(req.get("timeout_s") or 600.0),
    )
    try:
        value = fn(dict(req["record"]), client)
        reward = None if value is None else float(value)
    except Exception as e:  # an agent's bug costs its episode, not the run
        return None, f"{type(e).__name__}: {e}"[:400]
    finally:
        client.close()
    if reward is not None and not math.isfinite(reward):
        return None, f"non-finite reward {reward}"
    return reward, None


def agent_loop(spec: str, out: TextIO, args: argparse.Namespace) -> None:
    """The worker's request loop (see the module docstring)."""
    try:
        fn = load_agent_fn(spec)
        import openai  # noqa: F401  (paid before the first call's timeout starts)
    except (ValueError, ImportError) as e:
        out.write(json.dumps({"ready": False, "error": str(e)}) + "\n")
        return
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        arm_cpu(args.max_cpu_s)
        reward, error = run_agent(fn, req)
        restart = False
        if error is not None:
            error, restart = memory_message(error, args.max_memory_mb)
        out.write(
            json.dumps({"id": req["id"], "reward": reward, "error": error, "restart": restart})
            + "\n"
        )
        out.flush()
        if restart:
            return
