"""Fixtures shared by the trainer end-to-end files."""

from __future__ import annotations

from typing import Any

import pytest

from tests.train.reference import run_reference


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted reference run (tests/train/reference.py), trained once per session:
    {"tmp", "dir" (its logging dir, checkpoints in dir/ckpt), "toy", "seconds"}."""
    return run_reference(tmp_path_factory.mktemp("reference"))
