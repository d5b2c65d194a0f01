"""The real SGLang server on CPU for tests and the CPU main job: where its environment is,
and the `LaunchConfig` that starts it.

The engine runs in its own venv (scripts/engine_env.sh, pinned by constraints-engine.txt:
SGLang pins a torch the trainer does not use), so it is found by path, never imported.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any

from megatron_gspo.rollout.launch import LaunchConfig

ENGINE_PYTHON_ENV = "MGSPO_ENGINE_PYTHON"
"""Env var naming the engine venv's python (scripts/test.sh sets it after building the venv)."""
REQUIRE_ENV = "MGSPO_REQUIRE_SGLANG"
"""Env var: when set, tests that need the real server fail instead of skipping without it."""
GPU_TINY_ENGINE_ARGS = (
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--cuda-graph-backend-decode",
    "disabled",
    "--cuda-graph-backend-prefill",
    "disabled",
)
"""SGLang flags for a tiny model on a GPU (the GPU smoke test and tests/gpu/acceptance.py): no
CUDA-graph capture (startup time) and backends that take any head/vocab size."""

_ROOT = Path(__file__).resolve().parents[2]


def engine_venv_dir(root: Path = _ROOT) -> Path:
    """Where scripts/engine_env.sh builds (or built) the engine venv for this checkout."""
    digest = hashlib.sha256((root / "constraints-engine.txt").read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("MGSPO_CACHE") or Path.home() / ".cache/megatron-gspo")
    return cache / f"engine-venv-{digest}"


def engine_python() -> str | None:
    """The engine venv's interpreter: `$MGSPO_ENGINE_PYTHON`, else the cached venv if it was
    built completely, else None."""
    if path := os.environ.get(ENGINE_PYTHON_ENV):
        return path
    venv = engine_venv_dir()
    if (venv / ".complete").exists():
        return str(venv / "bin" / "python")
    return None


def engine_package_version(python: str, package: str = "sglang") -> str:
    """The installed version of `package` in the engine venv (read without importing it)."""
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    return subprocess.run(
        [python, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def cpu_launch_config(model_path: str, *, python: str, **overrides: Any) -> LaunchConfig:
    """A `LaunchConfig` for one real SGLang server on CPU serving `model_path` in bf16.

    `overrides` set any other `LaunchConfig` field (base_port, log_dir, num_engines, ...).
    """
    fields: dict[str, Any] = dict(
        model_path=model_path,
        backend="sglang",
        device="cpu",
        python=python,
        dtype="bfloat16",
        startup_timeout_s=300.0,
    )
    fields.update(overrides)
    return LaunchConfig(**fields)
