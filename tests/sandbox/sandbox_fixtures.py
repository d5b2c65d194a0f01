"""User code for the sandbox tests, loaded by "module:function" / "module:Class" in workers.

The tests check that the trainer process never imports this module (only workers do)."""

import os
import threading


def hog(prompt, response, answer):
    """Allocate `response` MiB (e.g. "1024") and touch it."""
    block = bytearray(int(response) * 2**20)
    block[:: 2**20] = b"x" * len(block[:: 2**20])
    return 1.0


def spin(prompt, response, answer):
    """Busy loop on `response` threads forever (only a limit or the timeout ends it)."""
    if response == "ok":
        return 1.0

    def loop():
        while True:
            pass

    for _ in range(int(response) - 1):
        threading.Thread(target=loop, daemon=True).start()
    loop()


def secret(prompt, response, answer):
    """1.0 when the planted secret (or the planted API key) is visible, else 0.5."""
    seen = "MGSPO_TEST_SECRET" in os.environ or "OPENAI_API_KEY" in os.environ
    return 1.0 if seen else 0.5


def pid(prompt, response, answer):
    return float(os.getpid())


class PidEnv:
    """An env that reports the process it runs in (reward = pid) and ends at the first step."""

    def reset(self, record):
        return None

    def step(self, text):
        return None, float(os.getpid()), True


def forks(prompt, response, answer):
    """Start a `sleep` that outlives the call (as a compiler or a shell the reward runs would),
    in this process group, and one more in a session of its own; returns nothing useful."""
    import subprocess

    subprocess.Popen(["sleep", "300"])  # inherits the worker's stderr, as forked code does
    subprocess.Popen(["sleep", "301"], start_new_session=True)
    return 1.0
