"""Where the real SGLang server's interpreter is.

The engine runs in its own venv (scripts/engine_env.sh, pinned by constraints-engine.txt:
SGLang pins a torch the trainer does not use), so it is found by path, never imported.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from megatron_gspo.config_io import require

__all__ = ["ENGINE_PYTHON_ENV", "engine_python", "engine_venv_dir", "sglang_python"]

ENGINE_PYTHON_ENV = "MGSPO_ENGINE_PYTHON"
"""Env var naming the engine venv's python (scripts/test.sh sets it after building the venv)."""
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


def sglang_python(fallback: str | None = None) -> str:
    """The interpreter for a real SGLang server when rollout.launch.python is unset: the engine
    venv of scripts/engine_env.sh if built (SGLang pins its own torch, so it rarely lives in the
    trainer's venv), else `fallback` (default: this interpreter) if it can import SGLang's
    server, else a ConfigError naming the fix, rather than a server that dies at startup with
    an ImportError buried in its log."""
    found = engine_python()
    if found is not None:
        require(
            Path(found).exists(),
            f"{ENGINE_PYTHON_ENV}={found}: no such file; run bash scripts/engine_env.sh and set "
            "rollout.launch.python=<its output>/bin/python",
        )
        return found
    python = fallback or sys.executable
    # In a subprocess: importing the server here would load SGLang's CUDA stack into the
    # trainer (~5 s, once per rank, and only when no engine venv is built).
    probe = subprocess.run(
        [python, "-c", "import sglang.launch_server"], capture_output=True, timeout=300
    )
    require(
        probe.returncode == 0,
        "rollout.launch.backend=sglang but rollout.launch.python is unset and sglang's server "
        f"cannot be imported by {python}: run bash scripts/engine_env.sh and set "
        "rollout.launch.python=<its output>/bin/python",
    )
    return python
