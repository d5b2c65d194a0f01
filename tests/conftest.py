"""Fixtures shared across test packages: the real SGLang server's interpreter, tiny HF
checkpoints and in-process embedded engines (session-scoped: starting one costs the SGLang import
once, then ~1 s; every fixture stops what it started), the toy tokenizer."""

from __future__ import annotations

import os

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
