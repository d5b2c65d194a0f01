"""Launches that run ahead of the tests that read them, beside the rest of the suite.

A trainer launch leaves 25-40% of the 2 cores idle (start-up, health waits, gloo ranks waiting
for each other), and so do most in-process tests (one Python thread). So the single-launch
end-to-end files register their launch here (`@ahead("name")` at import, i.e. at collection),
and `tests/conftest.py` starts every registered launch whose file has a selected test, one at a
time on one background thread, as soon as collection ends. The file's fixture then takes the
result (`Ahead.result`): it waits if the launch is running, or runs it itself if it has not
started yet, so that a file run on its own costs what it did before.

Measured (whole suite, scripts/test.sh, 2 cores): started at once, 1519 s; held until the
in-process stream had ended, 1606 s: they then ran beside the rehearsals and the fault chain,
which keep the 2 cores busier than the early tests do.

A registered function runs on a thread beside other tests: it must touch no process state
(environment, cwd, stdout, torch settings, and no imports: an import creates loggers, and pytest
walks logging's logger dict without its lock at the start of every test phase, so a logger made
here meanwhile fails that test with "dictionary changed size during iteration"; seen twice with
`import sglang` in tests/gpu/test_device_check.py) and start subprocesses only, capturing their
output (tests/test_ahead.py checks that no registered function imports).
Its failure is raised in the fixture that asks for its result, so the test that needs it fails
with the launch's own message.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@dataclass(frozen=True)
class Launch:
    name: str
    path: Path
    """The test file that registered it: started ahead only if one of its tests is selected."""
    fn: Callable[[Path], Any]
    """fn(tmp): the launch in the fresh directory `tmp`; returns what the file's tests read."""
    when: Callable[[], bool]
    """Whether to start it ahead at all (e.g. only with the engine venv present)."""


ROOT = Path(__file__).resolve().parents[1]
_REGISTERED: dict[str, Launch] = {}


def ahead(
    name: str,
    *,
    when: Callable[[], bool] = lambda: True,
    registry: dict[str, Launch] = _REGISTERED,
) -> Callable[[Callable[[Path], Any]], Callable[[Path], Any]]:
    """Register fn(tmp) as the launch `name` of the calling test file (in the session's
    registry, or `registry`)."""

    def register(fn: Callable[[Path], Any]) -> Callable[[Path], Any]:
        path = Path(inspect.getfile(fn)).resolve()
        old = registry.get(name)
        assert old is None or old.path == path, f"launch {name!r} registered twice"
        registry[name] = Launch(name, path, fn, when)
        return fn

    return register


class Ahead:
    """The session's launches: started ahead on one thread, or run by the asking fixture."""

    def __init__(
        self, tmp_factory: pytest.TempPathFactory, registry: dict[str, Launch] = _REGISTERED
    ) -> None:
        self._tmp_factory = tmp_factory
        self._registry = registry
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ahead")
        self._futures: dict[str, tuple[concurrent.futures.Future, Path]] = {}
        self._lock = threading.Lock()

    def start(self, selected_paths: Iterable[Path]) -> list[str]:
        """Queue every registered launch of the selected files; returns their names."""
        paths = {Path(p).resolve() for p in selected_paths}
        names = [n for n, job in self._registry.items() if job.path in paths and job.when()]
        with self._lock:
            for name in names:
                tmp = self._tmp_factory.mktemp(name)  # here: mktemp is not made for threads
                self._futures[name] = (self._pool.submit(self._registry[name].fn, tmp), tmp)
        return names

    def result(self, name: str) -> Any:
        """The launch's result: waited for if it started, else run here (raises its error)."""
        with self._lock:
            future, tmp = self._futures.pop(name, (None, None))
            if tmp is None:
                tmp = self._tmp_factory.mktemp(name)
        if future is None or future.cancel():  # not queued, or queued and not started
            return self._registry[name].fn(tmp)
        return future.result()

    def close(self) -> None:
        """Drop what has not started; wait for what has (its subprocesses end with it)."""
        with self._lock:
            for future, _ in self._futures.values():
                future.cancel()
        self._pool.shutdown(wait=True)


def make_toy(out: Path, *args: str) -> None:
    """`tools/make_tiny_toy.py --out out *args` in a subprocess: in process it would print and
    seed torch's global generator, under the feet of the test running meanwhile."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "tools.make_tiny_toy", "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
