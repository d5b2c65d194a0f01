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

__all__ = [
    "ENGINE_MODULES",
    "ENGINE_PYTHON_ENV",
    "ROUTER_MODULE",
    "engine_interpreter_problem",
    "engine_python",
    "engine_venv_dir",
    "router_problem",
    "router_python",
    "sglang_python",
]

ENGINE_PYTHON_ENV = "MGSPO_ENGINE_PYTHON"
"""Env var naming the engine venv's python (scripts/test.sh sets it after building the venv)."""
_ROOT = Path(__file__).resolve().parents[2]


ROUTER_MODULE = "sglang_router"
"""The router's package: in the trainer's lock (constraints.txt), not in SGLang's own."""
ENGINE_MODULES = ("sglang", "sgl_kernel")
"""What a server's interpreter must hold: SGLang and its compiled kernels. The trainer's venv
has sglang's Python modules only (no `sgl_kernel`): a server started there dies at import."""


def engine_venv_dir(root: Path = _ROOT) -> Path:
    """Where scripts/engine_env.sh builds (or built) the engine venv for this checkout."""
    lock = root / "constraints-engine.txt"
    # an installed wheel has no lock: a venv name no build ever makes
    digest = hashlib.sha256(lock.read_bytes() if lock.exists() else b"").hexdigest()[:16]
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


def engine_interpreter_problem(python: str, modules: dict[str, bool]) -> str | None:
    """One line when `python` (found `modules`: `gpu_stack.probe(python, ENGINE_MODULES)`'s
    answer) cannot run an SGLang server, else None."""
    missing = [m for m in ENGINE_MODULES if not modules.get(m)]
    if not missing:
        return None
    return (
        f"the engines' interpreter {python} has no {' or '.join(missing)} (an SGLang server "
        "needs SGLang with its GPU kernels; the trainer's venv holds sglang's Python modules "
        "only): run bash scripts/engine_env.sh and set ENGINE_PYTHON (--engine-python, "
        "rollout.launch.python) to <its output>/bin/python"
    )


def router_python(found: dict[str, bool]) -> str | None:
    """The first interpreter of `found` ({python: has sglang_router}, in order of preference:
    the engines', then the trainer's) that has the router, or None."""
    return next((py for py, has in found.items() if has), None)


def router_problem(checked: list[str]) -> str:
    """The line for no interpreter having the router."""
    return (
        f"no interpreter has {ROUTER_MODULE} (checked {', '.join(checked)}); the disaggregated "
        "job starts sglang-router in front of the engines: install sglang-router (pinned in "
        "constraints.txt) into one of them"
    )


def main() -> int:
    """`python -m megatron_gspo.engines.interpreter`: print the engine venv's interpreter
    (the Slurm scripts' default ENGINE_PYTHON), or one line and exit 2 if none is built."""
    found = engine_python()
    if found is None or not Path(found).exists():
        print(
            f"no engine interpreter: {ENGINE_PYTHON_ENV} is unset and the engine venv "
            f"({engine_venv_dir()}) is not built; run bash scripts/engine_env.sh and set "
            "ENGINE_PYTHON=<its output>/bin/python",
            file=sys.stderr,
        )
        return 2
    print(found)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
