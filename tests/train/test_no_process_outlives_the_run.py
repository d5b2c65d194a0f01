"""Issue 26 (3): a user reward that forks leaves nothing behind, and a pipeline around the job
(`... 2>&1 | tail`) ends: the forked children held the job's stderr open (was: 16 orphans
after a run that exited 0, and `| tail` waited until they were killed by hand)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
FIX = "tests.sandbox.sandbox_fixtures"

JOB = textwrap.dedent(f"""
    from megatron_gspo.rewards import RewardPool
    from megatron_gspo.sandbox.process import WorkerLimits
    limits = WorkerLimits(pass_env=("MGSPO_TEST_JOB",))  # the marker reaches the sleepers
    with RewardPool("{FIX}:forks", num_workers=2, timeout_s=30, limits=limits) as pool:
        print(pool.score(["p"] * 4, ["r"] * 4, ["a"] * 4).rewards, flush=True)
""")


def _sleepers(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            env = p.info["environ"] or {}
            if (p.info["cmdline"] or [""])[0] == "sleep" and env.get("MGSPO_TEST_JOB") == marker:
                found.append(p)
        except psutil.Error:
            pass
    return found


def test_forking_reward_leaves_no_process_and_the_pipe_closes() -> None:
    """A job that scores with a forking reward (one child in the worker's group, one that left
    it with setsid) and exits 0: reading its output to EOF ends (as `| tail` must), and no
    process it started is left (psutil, by an environment marker the children carry)."""
    marker = f"h26-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MGSPO_TEST_JOB": marker}
    proc = subprocess.Popen(
        [sys.executable, "-c", JOB], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=90)  # returns at EOF only: every holder closed it
        eof = True
    except subprocess.TimeoutExpired:
        eof = False
    left = _sleepers(marker)
    for p in left:
        p.kill()
    if not eof:
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "[1.0, 1.0, 1.0, 1.0]" in out, out
    assert eof, "the job's output stayed open after it exited: a forked child holds it"
    assert not left, [" ".join(p.cmdline()) for p in left]
