"""The real SGLang server on CPU for tests and the CPU main job: where its environment is,
and the `LaunchConfig` that starts it.

The engine runs in its own venv (scripts/engine_env.sh, pinned by constraints-engine.txt:
SGLang pins a torch the trainer does not use), so it is found by path, never imported.
"""

from __future__ import annotations

import subprocess
from typing import Any

from megatron_gspo.engines.interpreter import (  # noqa: F401  (re-exported for tests)
    ENGINE_PYTHON_ENV,
    engine_python,
    engine_venv_dir,
)
from megatron_gspo.engines.launch import LaunchConfig

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


def engine_package_version(python: str, package: str = "sglang") -> str:
    """The installed version of `package` in the engine venv (read without importing it)."""
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    return subprocess.run(
        [python, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def cpu_launch_config(model_path: str, *, python: str, **overrides: object) -> LaunchConfig:
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
