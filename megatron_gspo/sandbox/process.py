"""Worker processes for user code (reward functions and environments), parent side and limits.

User code never runs in the trainer: `python -m megatron_gspo.sandbox.worker KIND SPEC` imports
it in a child process that speaks JSON lines (see `worker.py`). A child:

* starts from a **scrubbed environment**: only `SAFE_ENV` (PATH, HOME, LANG, ...), the
  trainer's import path as PYTHONPATH, and the variables named in `sandbox.pass_env`; API keys,
  tokens and cluster credentials of the trainer's environment are not inherited;
* runs under **resource limits** set with `resource.setrlimit` in the child before the user
  module is imported: address space `RLIMIT_AS` (`sandbox.max_memory_mb`; an allocation past it
  raises MemoryError, the call fails loudly and the worker is replaced) and CPU seconds
  `RLIMIT_CPU` per call (`sandbox.max_cpu_s`; the soft limit is re-armed to "used + max_cpu_s"
  before each call, the kernel's SIGXCPU kills a call that burns more, e.g. with many threads
  inside the wall timeout);
* is killed by the parent when one call runs past its wall timeout (`reward.timeout_s`);
* gets SIGKILL when the trainer dies (Linux `PR_SET_PDEATHSIG`);
* runs in a session (and process group) of its own: killing it kills its whole group, so
  processes the user code forks (a compiler, a shell, `multiprocessing` children) end with it
  instead of outliving the run and holding its stdout / stderr (a `... | tail` that never
  ends). Descendants that left the group (`setsid`) are found through /proc and killed too.

A dead or killed worker is replaced by the caller; `death_reason` turns its exit status into one
line that names the limit it hit.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from megatron_gspo.run.stop import popen_from_lasting_thread

__all__ = [
    "SAFE_ENV",
    "WorkerDied",
    "WorkerLimits",
    "WorkerProcess",
    "WorkerTimeout",
    "worker_env",
]

#: Variables a worker inherits from the trainer (besides PYTHONPATH and `sandbox.pass_env`).
SAFE_ENV = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ", "TERM")
STARTUP_TIMEOUT_S = 120.0  # a worker importing a heavy user module on a loaded machine


@dataclass(frozen=True, kw_only=True)
class WorkerLimits:
    """Limits of one worker process (`sandbox.max_memory_mb`, `sandbox.max_cpu_s`,
    `sandbox.pass_env`)."""

    max_memory_mb: int | None = 8192
    """Address-space limit (RLIMIT_AS) of the whole worker; None = unlimited."""
    max_cpu_s: float | None = None
    """CPU seconds one call may use (RLIMIT_CPU, re-armed per call); None = unlimited."""
    pass_env: tuple[str, ...] = ()
    """Names of trainer environment variables the worker may see besides `SAFE_ENV`."""

    def argv(self) -> list[str]:
        """Command-line flags for `megatron_gspo.sandbox.worker`."""
        out = []
        if self.max_memory_mb is not None:
            out += ["--max-memory-mb", str(self.max_memory_mb)]
        if self.max_cpu_s is not None:
            out += ["--max-cpu-s", str(self.max_cpu_s)]
        return out


def worker_env(pass_env: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a worker: `SAFE_ENV` + the trainer's import path + `pass_env`."""
    env = {k: os.environ[k] for k in (*SAFE_ENV, *pass_env) if k in os.environ}
    # The workers see the trainer's import path, so a user module found here is found there.
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")  # no thread pool per worker
    return env


class WorkerDied(RuntimeError):
    """The worker exited (crash, limit, os._exit) before answering."""


class WorkerTimeout(RuntimeError):
    """The worker did not answer within the call's wall timeout (it has been killed)."""


class WorkerProcess:
    """One `python -m megatron_gspo.sandbox.worker KIND SPEC` child."""

    def __init__(self, kind: str, spec: str, limits: WorkerLimits) -> None:
        self.kind, self.spec, self.limits = kind, spec, limits
        # the worker sets its own PR_SET_PDEATHSIG: forked from a thread that lasts
        self.proc = popen_from_lasting_thread(
            [sys.executable, "-m", "megatron_gspo.sandbox.worker", kind, spec, *limits.argv()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=worker_env(limits.pass_env),
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: `kill` reaches what it forks
        )
        self.task: int | None = None
        self.started = 0.0
        self.ready = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Block until the worker has imported the user code (not part of any call's timeout:
        importing e.g. sympy takes seconds). A spec that cannot be loaded raises ValueError
        with the worker's message."""
        line = self._readline(timeout_s)
        hello = json.loads(line) if line.strip() else {}
        if not hello.get("ready"):
            self.kill()
            if hello.get("error"):
                raise ValueError(hello["error"])
            raise RuntimeError(
                f"{self.kind} worker for {self.spec!r} did not start within {timeout_s} s "
                f"({self.death_reason() or 'its stderr above says why'})"
            )
        self.ready = True

    def send(self, msg: dict[str, Any]) -> None:
        """Write one request (raises OSError/BrokenPipeError if the worker is gone, TypeError
        if `msg` is not JSON-serialisable)."""
        line = json.dumps(msg) + "\n"  # before the clock starts: TypeError leaves no call open
        self.task, self.started = msg.get("id"), time.monotonic()
        assert self.proc.stdin is not None
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def read_reply(self) -> dict[str, Any]:
        """The reply to the call in flight (stdout is readable); WorkerDied if it exited."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerDied(self.death_reason() or f"{self.kind} worker exited during the call")
        self.task = None
        return json.loads(line)

    def call(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one request and wait for its reply; WorkerTimeout (worker killed) or
        WorkerDied. Blocking: async callers run it in a thread."""
        if not self.ready:
            self.wait_ready()
        self.send(msg)
        if not self._readable(timeout_s):
            self.kill()
            raise WorkerTimeout(f"{self.kind} call ran past its {timeout_s:g} s wall timeout")
        return self.read_reply()

    def death_reason(self) -> str:
        """One line on why the worker exited ('' while it runs)."""
        try:
            code = self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return ""
        if code == -signal.SIGXCPU:
            return (
                f"{self.kind} worker killed by SIGXCPU: the call used more than "
                f"sandbox.max_cpu_s={self.limits.max_cpu_s:g} s of CPU time"
            )
        if code == -signal.SIGKILL:
            return f"{self.kind} worker killed by SIGKILL (out of memory, or killed from outside)"
        if code is not None and code < 0:
            return f"{self.kind} worker killed by signal {signal.Signals(-code).name}"
        return f"{self.kind} worker exited with code {code} during the call"

    def _readable(self, timeout_s: float) -> bool:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            return bool(sel.select(timeout=max(0.0, timeout_s)))

    def _readline(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline() if self._readable(timeout_s) else ""

    def kill(self) -> None:
        """SIGKILL the worker, its process group and every descendant still attached to it."""
        kill_tree(self.proc)
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s descendants, its process group (it leads one: `start_new_session`) and
    `proc` itself. Descendants are listed first, while `proc` still links them (a child
    re-parented to init once its parent is gone cannot be found any more)."""
    try:
        import psutil

        family = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # psutil missing, or proc already gone: the group kill still runs
        family = []
    for p in family:
        try:
            p.kill()
        except Exception:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.kill()
