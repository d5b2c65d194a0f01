"""Fixtures shared by the trainer end-to-end files."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import pytest

from tests.train.reference import run_reference, write_toy


@pytest.fixture(scope="session")
def reference_started(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Any, concurrent.futures.Future]]:
    """(tmp, future of the reference run): the toy is written, the run goes on in the
    background, so that a caller can launch jobs of its own on the same toy meanwhile (the
    fault chain does: one launch leaves part of the 2 cores idle)."""
    tmp = tmp_path_factory.mktemp("reference")
    write_toy(tmp)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        yield tmp, pool.submit(run_reference, tmp)


@pytest.fixture(scope="session")
def reference_run(reference_started: tuple[Any, concurrent.futures.Future]) -> dict[str, Any]:
    """The uninterrupted reference run (tests/train/reference.py), trained once per session:
    {"tmp", "dir" (its logging dir, checkpoints in dir/ckpt), "toy", "seconds"}."""
    return reference_started[1].result()
