"""`sandbox:` config section: limits of the worker processes that run user code (reward
functions and tool environments alike)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gspo.config_io import positive

__all__ = ["SandboxConfig"]


@dataclass(kw_only=True)
class SandboxConfig:
    """Limits of every reward and environment worker process."""

    max_memory_mb: int | None = 8192
    """Address-space limit (RLIMIT_AS) of each reward and environment worker process; an
    allocation past it fails the call (scored 0, message printed) and the worker is replaced.
    It counts virtual memory: importing torch alone maps ~3 GB. null: no limit."""
    max_cpu_s: float | None = None
    """CPU seconds one reward / environment call may use (RLIMIT_CPU, re-armed per call; the
    kernel kills the worker past it, e.g. many threads spinning inside the wall timeout);
    null: twice the call's wall timeout (reward.timeout_s, rollout.env_timeout_s)."""
    pass_env: list[str] = field(default_factory=list)
    """Names of environment variables reward and environment workers may see (e.g. an API key
    a judge needs). Workers otherwise get only PATH, HOME, USER, LANG, LC_*, TMPDIR, TZ, TERM
    and the import path: secrets in the trainer's environment stay out of user code."""

    def __post_init__(self) -> None:
        positive("sandbox", max_memory_mb=self.max_memory_mb, max_cpu_s=self.max_cpu_s)
