"""Issue 26 (2): a lost terminal (SIGHUP) or a killed launcher ends the run with a checkpoint.

(a) SIGHUP in a process whose console is a terminal that has gone away: a graceful stop, and the
    step goes on printing without failing (was: SIGHUP's default action ended the process).
(b) the launcher SIGKILLed: each rank gets `stop.LAUNCHER_DIED` from `PR_SET_PDEATHSIG`, once per
    launcher thread that exits while holding it; that is the launcher's death, a graceful stop
    (was SIGINT: the first delivery, sent while `getppid()` still named the dying launcher,
    was a user's Ctrl-C and the second "second SIGINT: exiting now without a checkpoint"),
    while a user's Ctrl-C twice still forces the exit."""

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

from megatron_gspo.run import stop as stop_mod
from megatron_gspo.run.stop import StopSignals

ROOT = Path(__file__).resolve().parents[2]
INT, TERM, HUP = signal.SIGINT, signal.SIGTERM, signal.SIGHUP
DIED = stop_mod.LAUNCHER_DIED

# A stand-in rank: steps that print to the console until a stop is requested, then the
# "checkpoint" (a file) and exit 0, as train._loop does at the step boundary.
RANK = textwrap.dedent("""
    import sys, time
    from megatron_gspo.run.console import survive_a_lost_console
    from megatron_gspo.run.stop import StopSignals
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
        # the launcher SIGKILLed: PR_SET_PDEATHSIG, delivered twice (two of its threads exited)
        ([DIED, DIED], None),
        # ... and a third time: still the same death
        ([DIED, DIED, DIED], None),
        # a user's Ctrl-C (forwarded by the live launcher), then the launcher exits on the
        # second Ctrl-C: the second Ctrl-C it stands for forces the exit, as before
        ([INT, DIED], 1),
        # a user's Ctrl-C twice through a live launcher: forced, as before
        ([INT, INT], 1),
        # a user's first Ctrl-C after the launcher's death: still graceful
        ([DIED, INT], None),
    ],
    ids=[
        "launcher-killed",
        "launcher-killed-thrice",
        "ctrl-c-then-launcher-exits",
        "ctrl-c-x2",
        "launcher-killed-then-ctrl-c",
    ],
)
def test_the_launchers_death_is_told_from_a_users_ctrl_c(events, forced_at, monkeypatch) -> None:
    stop = StopSignals(grace_s=600)
    forced: list[int] = []
    for i, sig in enumerate(events):
        monkeypatch.setattr(stop, "force", lambda why, at=i: forced.append(at))
        stop.on_signal(sig)
    assert forced == ([] if forced_at is None else [forced_at])
    assert stop.requested == ("SIGINT" if events[0] == INT else "the launcher died")


# A stand-in rank whose step goes on for a while after the stop request (the backward pass
# and the checkpoint), then writes its "checkpoint"; a forced exit writes nothing.
SLOW_RANK = textwrap.dedent("""
    import sys, time
    from megatron_gspo.run.stop import StopSignals
    stop = StopSignals(grace_s=60).install()
    print("ready", flush=True)
    for step in range(600):
        time.sleep(0.05)
        if stop.requested is not None:
            time.sleep(1.0)   # the rest of the step
            open(sys.argv[1], "w").write(f"{stop.requested} at step {step}")
            sys.exit(0)
""")

# A stand-in torchrun: several threads, the rank started by one of them. SIGKILL ends the
# threads one by one; the kernel sends PR_SET_PDEATHSIG when the rank's own thread exits,
# re-parenting the rank to a thread still alive (getppid() unchanged), and again when the last
# one exits. The order of those exits is a race under SIGKILL (measured on this machine: 2 of
# 20 SIGKILLed 5-thread parents delivered twice, the first with getppid() unchanged); here the
# starting thread ends first on purpose, then the launcher is SIGKILLed once the rank has
# taken the first delivery.
LAUNCHER = textwrap.dedent("""
    import os, signal, subprocess, sys, threading, time
    rank_code, ckpt, log = sys.argv[1:4]
    def start_rank():
        with open(log, "w") as out:
            subprocess.Popen([sys.executable, "-c", rank_code, ckpt], stdout=out, stderr=out,
                             start_new_session=True)
        while "ready" not in open(log).read():   # its PR_SET_PDEATHSIG is set
            time.sleep(0.02)
    t = threading.Thread(target=start_rank)
    t.start()
    t.join()   # first delivery: the rank is handed to this (main) thread
    deadline = time.monotonic() + 30
    while "stopping after this step" not in open(log).read() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGKILL)   # second delivery, getppid() changed
""")


def test_a_launcher_killed_thread_by_thread_ends_the_rank_with_a_checkpoint(
    tmp_path: Path,
) -> None:
    ckpt, log = tmp_path / "ckpt", tmp_path / "rank.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.run(
        [sys.executable, "-c", LAUNCHER, SLOW_RANK, str(ckpt), str(log)],
        env=env, timeout=60, start_new_session=True,
    )  # fmt: skip
    assert launcher.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while not ckpt.exists() and "exiting now" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    time.sleep(0.5)  # a forced exit would print its line now
    text = log.read_text()
    assert "without a checkpoint" not in text, text
    assert ckpt.read_text().startswith("the launcher died at step"), text
    assert text.count("stopping after this step") == 1, text
