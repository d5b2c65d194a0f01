"""Issue 26 (2): a lost terminal (SIGHUP) or a killed launcher ends the run with a checkpoint.

(a) SIGHUP in a process whose console is a terminal that has gone away: a graceful stop, and the
    step goes on printing without failing (was: SIGHUP's default action ended the process).
(b) the launcher SIGKILLed: each rank gets SIGINT from `PR_SET_PDEATHSIG`, possibly more than
    once; that is the launcher's death, a graceful stop (was: "second SIGINT: exiting now
    without a checkpoint"), while a user's Ctrl-C twice still forces the exit."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_gspo import stop as stop_mod
from megatron_gspo.stop import StopSignals

ROOT = Path(__file__).resolve().parents[1]
INT, TERM, HUP = signal.SIGINT, signal.SIGTERM, signal.SIGHUP

# A stand-in rank: steps that print to the console until a stop is requested, then the
# "checkpoint" (a file) and exit 0, as train._loop does at the step boundary.
RANK = textwrap.dedent("""
    import sys, time
    from megatron_gspo.console import survive_a_lost_console
    from megatron_gspo.stop import StopSignals
    stop = StopSignals(grace_s=60).install()   # what train.main does
    survive_a_lost_console()
    print("ready", flush=True)
    for step in range(600):
        print(f"step {step}", flush=True)   # the progress line, to the (lost) terminal
        time.sleep(0.05)
        if stop.requested is not None:
            open(sys.argv[1], "w").write(f"{stop.requested} at step {step}")
            sys.exit(0)
    sys.exit(5)
""")


def test_sighup_with_a_lost_terminal_ends_with_a_checkpoint(tmp_path: Path) -> None:
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK, str(tmp_path / "ckpt")],
        stdout=slave, stderr=slave, env=env, start_new_session=True,
    )  # fmt: skip
    os.close(slave)
    buf = b""
    deadline = time.monotonic() + 60
    while b"ready" not in buf and time.monotonic() < deadline:
        buf += os.read(master, 1024)
    os.close(master)  # the terminal goes away: writes to it now fail with EIO
    time.sleep(0.3)
    proc.send_signal(HUP)  # what the closed terminal (or torchrun forwarding it) sends
    rc = proc.wait(timeout=60)
    assert rc == 0, f"exit {rc}"
    assert (tmp_path / "ckpt").read_text().startswith("SIGHUP at step")


@pytest.mark.parametrize(
    "signals, forced_at",
    [
        ([HUP], None),  # a lost terminal: graceful
        ([HUP, HUP], None),  # torchrun forwarding the one it got: still graceful
        ([INT, HUP], None),  # Ctrl-C, then the terminal closed: graceful
        ([HUP, INT, INT], 2),  # a user's Ctrl-C twice after it still forces
    ],
)
def test_sighup_is_a_graceful_stop(signals, forced_at, monkeypatch) -> None:
    monkeypatch.setattr(stop_mod, "_detach_from_terminal", lambda: None)
    stop = StopSignals(grace_s=600)
    forced: list[int] = []
    for i, sig in enumerate(signals):
        monkeypatch.setattr(stop, "force", lambda why, at=i: forced.append(at))
        stop.on_signal(sig)
    assert stop.requested == signal.Signals(signals[0]).name
    assert forced == ([] if forced_at is None else [forced_at])


@pytest.mark.parametrize(
    "events, forced_at",
    [
        # the launcher SIGKILLed: PR_SET_PDEATHSIG's SIGINT, delivered twice
        ([("dead", INT), ("dead", INT)], None),
        # ... and a third time a little later: still the same death
        ([("dead", INT), ("dead", INT), ("dead", INT)], None),
        # a user's Ctrl-C (forwarded by the live launcher), then the launcher exits on the
        # second Ctrl-C: the second Ctrl-C it stands for forces the exit, as before
        ([("alive", INT), ("dead", INT)], 1),
        # a user's Ctrl-C twice through a live launcher: forced, as before
        ([("alive", INT), ("alive", INT)], 1),
    ],
    ids=["launcher-killed", "launcher-killed-thrice", "ctrl-c-then-launcher-exits", "ctrl-c-x2"],
)
def test_the_launchers_death_is_told_from_a_users_ctrl_c(events, forced_at, monkeypatch) -> None:
    parent = os.getppid()
    stop = StopSignals(grace_s=600)
    forced: list[int] = []
    for i, (launcher, sig) in enumerate(events):
        ppid = parent if launcher == "alive" else 1  # re-parented once the launcher died
        monkeypatch.setattr(stop_mod.os, "getppid", lambda p=ppid: p)
        monkeypatch.setattr(stop, "force", lambda why, at=i: forced.append(at))
        stop.on_signal(sig)
    assert forced == ([] if forced_at is None else [forced_at])
    assert stop.requested is not None
