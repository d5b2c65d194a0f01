"""Fixtures shared across test packages."""

from __future__ import annotations

import os

import pytest

from megatron_gspo.testing import sglang_server


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
