"""The suite's launches started ahead (tests/ahead.py): started for selected files only, run on
one background thread, taken over by the asking fixture when not started yet, held behind the
end of a given process, their errors raised to the asking test."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.ahead import Ahead, Launch, ahead

HERE = Path(__file__).resolve()


def _registry(events: list[str], gate: threading.Event | None = None) -> dict[str, Launch]:
    reg: dict[str, Launch] = {}

    @ahead("first", registry=reg)
    def first(tmp: Path) -> tuple[str, Path]:
        events.append(f"first on {threading.current_thread().name}")
        if gate is not None:
            assert gate.wait(10)
        return "first", tmp

    @ahead("second", registry=reg)
    def second(tmp: Path) -> str:
        events.append(f"second on {threading.current_thread().name}")
        return "second"

    @ahead("never", registry=reg, when=lambda: False)
    def never(tmp: Path) -> str:
        events.append("never")
        return "never"

    @ahead("broken", registry=reg)
    def broken(tmp: Path) -> None:
        raise AssertionError("the launch's own message")

    return reg


def test_selected_launches_run_ahead_on_one_thread(tmp_path_factory) -> None:
    events: list[str] = []
    launches = Ahead(tmp_path_factory, _registry(events))
    try:
        assert launches.start([HERE]) == ["first", "second", "broken"]  # `when` is False
        name, tmp = launches.result("first")
        assert name == "first" and tmp.is_dir() and tmp.name.startswith("first")
        assert launches.result("second") == "second"
        with pytest.raises(AssertionError, match="the launch's own message"):
            launches.result("broken")
        assert launches.result("never") == "never"  # not started ahead: run when asked
    finally:
        launches.close()
    assert events[:2] == ["first on ahead_0", "second on ahead_0"], events
    assert events[2] == "never"


def test_files_not_selected_start_nothing(tmp_path_factory) -> None:
    events: list[str] = []
    launches = Ahead(tmp_path_factory, _registry(events))
    assert launches.start([HERE.with_name("test_config.py")]) == []
    launches.close()
    assert events == []


def test_a_queued_launch_is_run_by_the_fixture_that_asks(tmp_path_factory) -> None:
    """`first` holds the one thread: `second`, still queued, runs on the asking thread now
    rather than after `first`."""
    events: list[str] = []
    gate = threading.Event()
    launches = Ahead(tmp_path_factory, _registry(events, gate))
    try:
        launches.start([HERE])
        assert launches.result("second") == "second"
        assert f"second on {threading.current_thread().name}" in events
        gate.set()
        assert launches.result("first")[0] == "first"
    finally:
        gate.set()
        launches.close()


def test_launches_wait_for_the_end_of_the_given_process(tmp_path_factory) -> None:
    events: list[str] = []
    sleeper = subprocess.Popen(["sleep", "2"])
    launches = Ahead(tmp_path_factory, _registry(events))
    try:
        t0 = time.monotonic()
        launches.start([HERE], after_pid=sleeper.pid)
        time.sleep(1.0)
        assert events == []  # held: the process still runs
        sleeper.wait()  # reaped here; a zombie would count as ended too
        launches.result("second")
        assert events[0].startswith("first on ahead") and time.monotonic() - t0 >= 2.0
    finally:
        sleeper.kill()
        launches.close()


def test_close_does_not_wait_for_a_process_that_runs_on(tmp_path_factory) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    launches = Ahead(tmp_path_factory, _registry([]))
    try:
        launches.start([HERE], after_pid=sleeper.pid)
        t0 = time.monotonic()
        launches.close()
        assert time.monotonic() - t0 < 5
    finally:
        sleeper.kill()
        sleeper.wait()
