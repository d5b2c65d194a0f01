"""A reward worker process: `python -m megatron_gspo.rewards.worker SPEC`.

Reads one JSON request per line on stdin ({"id", "prompt", "response", "answer"}), writes one
JSON reply per line ({"id", "reward", "error"}) on the original stdout, after a first
{"ready": true} line once the function is imported. The user function's own
prints go to stderr so they cannot corrupt the protocol. Exits when stdin closes.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the trainer dies, even if a call is stuck in user code (a closed
    stdin is only noticed between calls)."""
    if sys.platform != "linux":
        return
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        sys.exit(0)


def main(spec: str) -> None:
    _die_with_parent()
    # Keep the protocol on a private copy of fd 1 and point fd 1 / sys.stdout at stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from megatron_gspo.rewards.pool import call_reward, load_reward_fn

    fn = load_reward_fn(spec)
    if spec in ("math", "toy"):
        # A throw-away call pays for lazy imports and parser construction (math-verify builds its
        # LaTeX grammar on first use), which would otherwise eat the first call's timeout. User
        # functions are never called on made-up input.
        call_reward(fn, "", "\\boxed{1}", "1")
    # Imports are done: the parent starts a call's timeout clock only after this line.
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        reward, error = call_reward(fn, req["prompt"], req["response"], req["answer"])
        out.write(json.dumps({"id": req["id"], "reward": reward, "error": error}) + "\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1])
