"""How a training job stops on a signal: every rank, within a bound, with a checkpoint when it can.

    stop = StopSignals(grace_s=cfg.train.stop_grace_s).install()   # each rank, main thread
    ...
    if stop.agreed():  # collective at the step boundary: any rank's signal stops all ranks
        save_checkpoint(...); return

* SIGTERM (a scheduler's preemption notice, torchrun forwarding one) or a first SIGINT (Ctrl-C;
  torchrun forwards it to its workers, which sit in sessions of their own) asks for a graceful
  stop: the current step finishes, every rank learns of it through one all-reduce (a signal
  that reached rank 1 only stops rank 0 too), a checkpoint is written and the job exits 0.
* A second Ctrl-C forces the exit at once, without a checkpoint (exit code 130): after a
  SIGINT, any further SIGINT or SIGTERM does (torchrun answers a second Ctrl-C with SIGTERM
  to its workers). SIGTERM after SIGTERM does not: a scheduler and torchrun may both deliver
  one for the same preemption.
* Either way the process is gone at most `grace_s` after the first signal, even when its main
  thread is stuck in a collective with a dead peer (a C call, where Python signal handlers do
  not run): the signal numbers reach a watchdog thread through `signal.set_wakeup_fd`, which
  the C-level handler writes at once.
* SIGHUP (the terminal or ssh session closed; torchrun forwards it to its workers) is a
  graceful stop like SIGTERM, never a forced one. When stdout / stderr are that terminal they
  are pointed at /dev/null first: writes to a hung-up terminal fail (EIO), and a failing
  print must not end the step that is about to be checkpointed.
* The launcher dying (torchrun SIGKILLed, or torchrun exiting on a second Ctrl-C while it
  waits for its workers) delivers `LAUNCHER_DIED`, a real-time signal nothing else sends, to
  each rank (`PR_SET_PDEATHSIG`): a graceful stop, unless a user's SIGINT came before it (then
  the second Ctrl-C it stands for forces the exit). It may arrive more than once for one death
  and the later ones change nothing: the kernel's "parent" is the launcher's thread that
  started the rank, and when a SIGKILLed torchrun's threads (main, `pt_elastic`,
  `pt_tcpstore_uv`) exit one by one, that thread's exit sends it while the rank is handed to a
  thread still alive, so `getppid()` still names the launcher, and the last thread's exit sends
  it again. (It used to be SIGINT told from a user's by the parent PID having changed: the
  first delivery looked like a user's Ctrl-C and the second forced the exit.)

A forced exit SIGKILLs this process's children (engines, reward workers) before `os._exit`;
they also die with their parent by their own `PR_SET_PDEATHSIG`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["FORCED_EXIT_CODE", "StopSignals", "popen_from_lasting_thread", "seen_sigint"]

FORCED_EXIT_CODE = 130  # the shell's code for "ended by SIGINT"
# PR_SET_PDEATHSIG's signal: one that no user, scheduler or launcher sends (None: no real-time
# signals on this platform, and no PR_SET_PDEATHSIG either).
LAUNCHER_DIED: int | None = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else None
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) + (
    (LAUNCHER_DIED,) if LAUNCHER_DIED is not None else ()
)


class StopSignals:
    """The stop state of one rank; see the module docstring."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.requested: str | None = None  # name of the first stop signal received
        self._first_at = 0.0
        self._sigints = 0
        self._parent = os.getppid()  # the launcher
        self._launcher_died = False
        self._lock = threading.Lock()

    def install(self) -> StopSignals:
        """Main thread only (CPython's rule for signal handlers and the wakeup fd)."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block
        for sig in _SIGNALS:
            # A Python handler replaces the default action (exit, KeyboardInterrupt); the
            # decision is the watchdog's, which sees the signal even when this thread cannot.
            signal.signal(sig, lambda *_: None)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), daemon=True, name="stop").start()
        if LAUNCHER_DIED is not None:
            die_with_parent(LAUNCHER_DIED)
            if os.getppid() != self._parent:  # it died before PR_SET_PDEATHSIG took effect
                os.kill(os.getpid(), LAUNCHER_DIED)
        global _INSTALLED
        _INSTALLED = self
        return self

    def _watch(self, read_fd: int) -> None:
        while True:
            timeout = None
            if self.requested is not None:
                timeout = max(0.0, self._first_at + self.grace_s - time.monotonic())
            ready = _wait_readable(read_fd, timeout)
            if not ready:  # the grace period ran out while the step did not finish
                self.force(
                    f"still running {self.grace_s:g} s after {self.requested} (train.stop_grace_s)"
                )
            for signum in os.read(read_fd, 64):
                self.on_signal(signum)

    def on_signal(self, signum: int) -> None:
        """What one delivered signal does (called by the watchdog thread)."""
        now = time.monotonic()
        if signum == signal.SIGHUP:
            _detach_from_terminal()
        with self._lock:
            if signum == LAUNCHER_DIED:
                if self._launcher_died:
                    return  # the same death, delivered again (another launcher thread exited)
                self._launcher_died = True
                name = "the launcher died"
                signum = signal.SIGTERM if self._sigints == 0 else signal.SIGINT
            else:
                name = signal.Signals(signum).name
            first = self.requested is None
            if first:
                self.requested, self._first_at = name, now
            if signum == signal.SIGINT:
                self._sigints += 1
            forced = self._sigints >= 2 or (self._sigints == 1 and signum == signal.SIGTERM)
        if forced:
            plain = signum == signal.SIGINT and name == "SIGINT"
            self.force("second SIGINT" if plain else f"{name} after SIGINT")
        if first:
            _say(
                f"[train] {name}: stopping after this step with a checkpoint (at most "
                f"{self.grace_s:g} s, train.stop_grace_s; Ctrl-C again to stop at once)"
            )

    def force(self, why: str) -> None:
        """Exit now: no checkpoint; children (engines, reward workers) are SIGKILLed first."""
        _say(f"[train] {why}: exiting now without a checkpoint")
        _kill_children()
        os._exit(FORCED_EXIT_CODE)

    def agreed(self) -> bool:
        """Collective (every rank, same point of the step): whether any rank was asked to stop."""
        import torch

        flag = torch.tensor([float(self.requested is not None)])
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            from megatron_gspo import dist

            flag = flag.to(dist.device())
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


_INSTALLED: StopSignals | None = None


def seen_sigint() -> bool:
    """Whether the installed `StopSignals` has received a SIGINT (the fault tests wait for it)."""
    return _INSTALLED is not None and _INSTALLED._sigints > 0


def _wait_readable(fd: int, timeout: float | None) -> bool:
    import select

    ready, _, _ = select.select([fd], [], [], timeout)
    return bool(ready)


def _say(text: str) -> None:
    rank = os.environ.get("RANK", "0")
    try:
        print(f"{text} (rank {rank})", file=sys.stderr, flush=True)
    except OSError:  # a console gone (EIO, EPIPE) must not stop the watchdog thread
        pass


def _detach_from_terminal() -> None:
    """Point stdout / stderr at /dev/null where they are a terminal (a hung-up one fails every
    write); files and pipes (a log, `| tee`) are kept."""
    null = None
    for fd in (1, 2):
        try:
            if not os.isatty(fd):
                continue
            if null is None:
                null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
        except OSError:
            pass
    if null is not None:
        os.close(null)


def _kill_children() -> None:
    try:
        import psutil
    except ImportError:  # the children still die with us (their own PR_SET_PDEATHSIG)
        return
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass


def die_with_parent(sig: int) -> None:
    """Linux: `sig` is delivered to this process when its parent (the launcher) dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


# PR_SET_PDEATHSIG fires when the THREAD that forked the child exits, not the process (what
# made torchrun's ranks see its death twice, issue 26 M5). Children that must die with this
# process are forked from one thread that lives as long as it: an engine or worker may be
# replaced on behalf of a short-lived rollout thread.
_SPAWNER: ThreadPoolExecutor | None = None


def popen_from_lasting_thread(cmd: list[str], **popen: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(cmd, **popen)`, forked from a thread that outlives every caller, so
    that the child's `PR_SET_PDEATHSIG` (set in `preexec_fn` or by the child itself) fires
    when this process dies, not when the calling thread ends."""
    global _SPAWNER
    if _SPAWNER is None:
        _SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="child-spawn")
    return _SPAWNER.submit(lambda: subprocess.Popen(cmd, **popen)).result()
