"""The suite's launches started ahead (tests/ahead.py): started for selected files only, run on
one background thread, taken over by the asking fixture when not started yet, their errors
raised to the asking test."""

from __future__ import annotations

import ast
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
        events.append(f"broken on {threading.current_thread().name}")
        raise AssertionError("the launch's own message")

    return reg


def _wait_for(events: list[str], n: int) -> None:
    deadline = time.monotonic() + 30
    while len(events) < n:
        assert time.monotonic() < deadline, events
        time.sleep(0.05)


def test_selected_launches_run_ahead_on_one_thread(tmp_path_factory) -> None:
    events: list[str] = []
    launches = Ahead(tmp_path_factory, _registry(events))
    try:
        assert launches.start([HERE]) == ["first", "second", "broken"]  # `when` is False
        _wait_for(events, 3)  # nobody asked yet
        assert events == ["first on ahead_0", "second on ahead_0", "broken on ahead_0"]
        name, tmp = launches.result("first")
        assert name == "first" and tmp.is_dir() and tmp.name.startswith("first")
        assert launches.result("second") == "second"
        with pytest.raises(AssertionError, match="the launch's own message"):
            launches.result("broken")
        assert launches.result("never") == "never"  # not started ahead: run when asked
    finally:
        launches.close()
    assert events[3:] == ["never"]


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


def _is_ahead(decorator: ast.expr) -> bool:
    return isinstance(decorator, ast.Call) and getattr(decorator.func, "id", "") == "ahead"


def test_no_launch_ahead_imports_on_its_thread() -> None:
    """tests/ahead.py's rule, checked where it can be by reading: a function registered with
    `@ahead` runs beside the tests, so it imports nothing (an import makes loggers while pytest
    walks logging's logger dict: "dictionary changed size during iteration" in the tests then
    running). Imports belong at the file's top, done at collection on the main thread."""
    found, offending = [], []
    for f in sorted(HERE.parent.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if not isinstance(node, ast.FunctionDef) or not any(
                _is_ahead(d) for d in node.decorator_list
            ):
                continue
            found.append(f"{f.relative_to(HERE.parent)}:{node.name}")
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import | ast.ImportFrom):
                    offending.append(f"{found[-1]}: line {inner.lineno} imports")
    assert len(found) >= 7, found  # the end-to-end files and the device check are read
    assert not offending, offending
