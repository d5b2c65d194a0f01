"""The `sgl_kernel` stand-in for running the real SGLang server on CPU (tests, CPU main job).

`STUB_DIR` holds a package named `sgl_kernel` (see its docstring); `engines/launch.py` puts it
first on the engine's PYTHONPATH when `LaunchConfig.device == "cpu"`. This module itself is
plain Python: it never imports the stand-in, so the trainer's torch registers no ops.
"""

from __future__ import annotations

import os
from pathlib import Path

STUB_DIR = Path(__file__).resolve().parent
"""The directory to put on PYTHONPATH (it contains `sgl_kernel/`)."""
STUB_FOR_SGLANG = "0.5.23"
"""The SGLang version whose CPU path the stand-in was checked against."""
LOG_ENV = "MGSPO_SGL_KERNEL_STUB_LOG"
"""Env var naming a file where the stand-in appends one line per op call / placeholder use."""


class StubInsufficientError(RuntimeError):
    """SGLang called something the stand-in does not implement, or is not the version it
    was written for."""


def read_log(path: str | os.PathLike[str]) -> list[str]:
    """The stand-in's events: `op <name> ...`, `imported <name>`, `called <name>`."""
    p = Path(path)
    if not p.exists():
        return []
    return [line.split(" ", 1)[1] for line in p.read_text().splitlines() if " " in line]


def check_stub_log(path: str | os.PathLike[str]) -> list[str]:
    """Raise `StubInsufficientError` if any placeholder was called; return the events."""
    events = read_log(path)
    called = sorted({e.split()[1] for e in events if e.startswith("called ")})
    if called:
        raise StubInsufficientError(
            f"SGLang called sgl_kernel functions the CPU stand-in does not implement: {called}"
        )
    return events


def check_sglang_version(version: str) -> None:
    """Raise `StubInsufficientError` unless `version` is the one the stand-in was written for."""
    if version != STUB_FOR_SGLANG:
        raise StubInsufficientError(
            f"the sgl_kernel stand-in was checked against sglang {STUB_FOR_SGLANG}, the engine "
            f"runs {version}: re-check which sgl_kernel names it needs on CPU "
            "(megatron_gspo/engines/sgl_kernel_cpu/sgl_kernel/__init__.py), then update "
            "STUB_FOR_SGLANG"
        )
