"""Fixtures shared across test packages: the real SGLang server's interpreter, tiny HF
checkpoints and in-process embedded engines (session-scoped: starting one costs the SGLang import
once, then ~1 s; every fixture stops what it started), the toy tokenizer."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Generator
from types import FrameType

import pytest
import torch

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.testing import sglang_server
from tests.ahead import Ahead

_AHEAD = pytest.StashKey[Ahead]()


@pytest.fixture(scope="session")
def engine_python() -> str:
    """The real SGLang server's interpreter (engine venv). Tests that need it skip only when the
    venv is absent AND the suite was not told to require it (scripts/test.sh requires it)."""
    python = sglang_server.engine_python()
    if python is None or not os.path.exists(python):
        if os.environ.get(sglang_server.REQUIRE_ENV):
            pytest.fail(
                f"{sglang_server.REQUIRE_ENV} is set but the engine venv is missing "
                f"({python or sglang_server.engine_venv_dir()}): run scripts/engine_env.sh"
            )
        pytest.skip(
            "real SGLang server tests: engine venv not built (bash scripts/engine_env.sh; "
            f"scripts/test.sh builds it and sets {sglang_server.REQUIRE_ENV}=1)"
        )
    return python


@pytest.fixture(scope="session")
def ckpt_a(tmp_path_factory) -> str:
    """Tiny Qwen3-MoE checkpoint, seed 0 (the engine's initial weights)."""
    return str(save_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt_a"), seed=0))


@pytest.fixture(scope="session")
def ckpt_b(tmp_path_factory) -> str:
    """Tiny Qwen3-MoE checkpoint, seed 1 (the "trained" weights pushed by updates)."""
    return str(save_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt_b"), seed=1))


@pytest.fixture(scope="session")
def weights_a(ckpt_a) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{ckpt_a}/model.safetensors")


@pytest.fixture(scope="session")
def weights_b(ckpt_b) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{ckpt_b}/model.safetensors")


def _start(path: str):
    from megatron_gspo.engines.embedded.server import EmbeddedServer

    return EmbeddedServer(path).start()


@pytest.fixture(scope="session")
def engine_a(ckpt_a):
    """An embedded engine on 127.0.0.1 serving `ckpt_a` (weights may be changed by tests
    that restore them afterwards)."""
    srv = _start(ckpt_a)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def engine_b(ckpt_a):
    """A second embedded engine with the same initial weights."""
    srv = _start(ckpt_a)
    yield srv
    srv.stop()


@pytest.fixture
def client_a(engine_a):
    from megatron_gspo.engines.client import ClientConfig, SGLangClient

    c = SGLangClient(ClientConfig(engine_urls=[engine_a.url], validate_requests=True))
    yield c
    c.close()


@pytest.fixture(scope="session")
def toy_tokenizer():
    """The character-level toy tokenizer (transformers import: a few seconds, paid once)."""
    from megatron_gspo.data.toy import build_toy_tokenizer

    return build_toy_tokenizer()


# The quick tier (`scripts/test.sh --quick`) leaves out tests marked slow. Whole kinds are slow
# by construction and marked here, so a new test of that kind cannot slip into the quick tier:
# end-to-end runs of the trainer (tests/train/), and anything that starts the real SGLang server
# (the `engine_python` fixture). Others carry `@pytest.mark.slow` themselves.
_SLOW_DIRS = ("train",)


def pytest_collection_modifyitems(config, items):
    root = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        rel = os.path.relpath(str(item.path), root).split(os.sep)
        if rel[0] in _SLOW_DIRS or "engine_python" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the selected files' launches ahead (tests/ahead.py), beside the first tests."""
    if session.config.option.collectonly:
        return
    # the session's own TempPathFactory (private name, public type): the launches' directories
    # sit in the run's basetemp with every other fixture's, and go with it
    launches = Ahead(session.config._tmp_path_factory)  # type: ignore[attr-defined]
    launches.start(item.path for item in session.items)
    session.config.stash[_AHEAD] = launches


def pytest_sessionfinish(session: pytest.Session) -> None:
    launches = session.config.stash.get(_AHEAD, None)
    if launches is not None:
        launches.close()


@pytest.fixture(scope="session")
def launches_ahead(request: pytest.FixtureRequest) -> Ahead:
    """The session's launches started ahead (tests/ahead.py): `.result(name)`."""
    return request.config.stash[_AHEAD]


# Threads a test body starts and leaves running into later tests. A leftover thread that still
# touches process state (os.environ, sys.modules, a fixture's dict) breaks whichever test runs
# beside it, far from its cause (once: "dictionary changed size during iteration" in the setup
# of a pure-math test). Threads started in a test's call phase that are still alive when a
# LATER test starts (not just finishing their shutdown) are listed at the end of the run, with
# the test that started them; threads of fixtures (started in setup) are the fixtures' own.
_STARTED_IN_CALL = pytest.StashKey[list[threading.Thread]]()
_suspects: list[tuple[str, threading.Thread]] = []
_left_running: dict[str, list[str]] = {}


def _describe(t: threading.Thread) -> str:
    target = getattr(t, "_target", None)
    name = getattr(target, "__qualname__", "") or type(t).__name__
    return f"{t.name} ({name}{', daemon' if t.daemon else ''})"


def _idle_pool_worker(frame: FrameType | None) -> bool:
    """A concurrent.futures worker waiting for work (an executor's idle thread: a session
    fixture's pool grows on its first use in a test, and idle it touches nothing)."""
    while frame is not None and frame.f_code.co_filename.endswith(("queue.py", "threading.py")):
        frame = frame.f_back
    return (
        frame is not None
        and frame.f_code.co_name == "_worker"
        and frame.f_code.co_filename.endswith(os.path.join("concurrent", "futures", "thread.py"))
    )


def _confirm_suspects() -> None:
    """Threads a finished test left that are still alive now, a later test on, and not idle
    pool workers: left running."""
    frames = sys._current_frames()
    for nodeid, t in _suspects:
        if type(t).__name__ == "TMonitor":  # tqdm's one monitor, for every bar of the process
            continue
        if t.is_alive() and not _idle_pool_worker(frames.get(t.ident or 0)):
            _left_running.setdefault(nodeid, []).append(_describe(t))
    _suspects.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    _confirm_suspects()
    before = set(threading.enumerate())
    try:
        return (yield)
    finally:
        item.stash[_STARTED_IN_CALL] = [t for t in threading.enumerate() if t not in before]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    try:
        return (yield)
    finally:
        started = item.stash.get(_STARTED_IN_CALL, [])
        _suspects.extend((item.nodeid, t) for t in started if t.is_alive())


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    _confirm_suspects()
    if _left_running:
        terminalreporter.section("threads left running by tests (see tests/conftest.py)")
        for nodeid, threads in _left_running.items():
            terminalreporter.line(f"{nodeid}: {', '.join(threads)}")
