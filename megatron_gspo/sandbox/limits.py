"""The resource limits of a user-code worker process (`sandbox.max_memory_mb`,
`sandbox.max_cpu_s`): the leaf that the sandbox worker (`sandbox/worker.py`) and the agent
worker loop (`agents/worker.py`) both apply, so that neither imports the other back.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import sys

__all__ = ["arm_cpu", "die_with_parent", "limit_memory", "memory_message"]


def die_with_parent() -> None:
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


def limit_memory(max_memory_mb: int | None) -> None:
    """RLIMIT_AS = max_memory_mb (None: no limit); set before the user module is imported."""
    if max_memory_mb is not None:
        limit = int(max_memory_mb) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def arm_cpu(max_cpu_s: float | None) -> None:
    """Soft RLIMIT_CPU = CPU used so far + max_cpu_s (RLIMIT_CPU counts the whole process, so it
    is re-armed before every call). The kernel sends SIGXCPU at the soft limit (kills)."""
    if max_cpu_s is None:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(math.ceil(usage.ru_utime + usage.ru_stime + max_cpu_s))
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def memory_message(error: str, max_memory_mb: int | None) -> tuple[str, bool]:
    """(message, restart): a MemoryError names the key that set the limit and asks for a fresh
    worker (the heap may be left half-allocated); any other error passes unchanged."""
    if error.startswith("MemoryError"):
        return (
            f"MemoryError: the call went over sandbox.max_memory_mb={max_memory_mb} MB "
            "(the worker is replaced)",
            True,
        )
    return error, False
