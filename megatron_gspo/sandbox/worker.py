"""A user-code worker process: `python -m megatron_gspo.sandbox.worker KIND SPEC [limits]`.

KIND is `reward` (SPEC a reward function, "math", "toy" or "module:function"), `env`
(SPEC an environment class "module:Class", see `megatron_gspo.envs`) or `agent` (SPEC an OpenAI
agent "module:function", see `megatron_gspo.agents.worker`). The worker first applies
its resource limits (`--max-memory-mb`: RLIMIT_AS; `--max-cpu-s`: RLIMIT_CPU per call), then
imports SPEC and writes `{"ready": true}` (or `{"ready": false, "error": ...}` when SPEC cannot be
loaded) on the original stdout. Then one JSON request per line on stdin, one JSON reply per line:

    reward: {"id", "prompt", "response", "answer"}    -> {"id", "reward", "error"}
    env:    {"id", "op": "reset", "ep", "record"}      -> {"id", "obs", "error"}
            {"id", "op": "step", "ep", "text"}         -> {"id", "obs", "reward", "done", "error"}
            {"id", "op": "close", "ep"}                -> {"id", "error"}

A reply may carry `"restart": true` (the call ran out of memory: the parent replaces the
worker). The user code's own prints go to stderr so they cannot corrupt the protocol. Exits when
stdin closes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

from megatron_gspo.sandbox.limits import arm_cpu, die_with_parent, limit_memory, memory_message


def _reward_loop(spec: str, out: TextIO, args: argparse.Namespace) -> None:
    from megatron_gspo.rewards.pool import call_reward, load_reward_fn

    try:
        fn = load_reward_fn(spec)
    except ValueError as e:
        out.write(json.dumps({"ready": False, "error": str(e)}) + "\n")
        return
    if spec in ("math", "toy", "pattern"):
        # A throw-away call pays for lazy imports and parser construction (math-verify builds its
        # LaTeX grammar on first use), which would otherwise eat the first call's timeout. User
        # functions are never called on made-up input.
        call_reward(fn, "", "\\boxed{1}", "1")
    # Imports are done: the parent starts a call's timeout clock only after this line.
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        arm_cpu(args.max_cpu_s)
        reward, error = call_reward(fn, req["prompt"], req["response"], req["answer"])
        restart = False
        if error is not None:
            error, restart = memory_message(error, args.max_memory_mb)
        reply = {"id": req["id"], "reward": reward, "error": error, "restart": restart}
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if restart:
            return


def _env_loop(spec: str, out: TextIO, args: argparse.Namespace) -> None:
    from megatron_gspo.envs import env_call, load_env_class

    try:
        cls = load_env_class(spec)
    except ValueError as e:
        out.write(json.dumps({"ready": False, "error": str(e)}) + "\n")
        return
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    episodes: dict[Any, Any] = {}
    for line in sys.stdin:
        req = json.loads(line)
        arm_cpu(args.max_cpu_s)
        reply = env_call(cls, episodes, req)
        restart = False
        if reply.get("error"):
            reply["error"], restart = memory_message(reply["error"], args.max_memory_mb)
        reply["restart"] = restart
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if restart:
            return


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=("reward", "env", "agent"))
    p.add_argument("spec")
    p.add_argument("--max-memory-mb", type=int, default=None)
    p.add_argument("--max-cpu-s", type=float, default=None)
    args = p.parse_args(argv)
    die_with_parent()
    # Keep the protocol on a private copy of fd 1 and point fd 1 / sys.stdout at stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    limit_memory(args.max_memory_mb)  # before the user module is imported
    if args.kind == "agent":  # rollout.agent: megatron_gspo/agents/worker.py
        from megatron_gspo.agents.worker import agent_loop

        agent_loop(args.spec, out, args)
        return
    (_reward_loop if args.kind == "reward" else _env_loop)(args.spec, out, args)


if __name__ == "__main__":
    main()
