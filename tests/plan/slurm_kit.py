"""What the Slurm-script tests set up around the real scripts: a working directory as a user's
(the recipes' relative paths, with weight files in the model directories), an engine venv as
`scripts/engine_env.sh` leaves it, and a `nvidia-smi` for a chosen driver.

* `workdir`: `examples/recipes/` copied (YAMLs and the model directories' config.json) plus a
  small valid safetensors file per model directory, standing for the downloaded weights;
  `examples/slurm/` linked.
* `engine_venv`: `<cache>/engine-venv-<hash>/bin/python` with `.complete`, where
  `engines.interpreter.engine_venv_dir` looks (`MGSPO_CACHE=<cache>`). It is this interpreter
  seen as the engine venv looks from outside: SGLang with `sgl_kernel` (our CPU stand-in), and
  no `sglang_router` (hidden, as the real engine venv lacks it).
* `fake_nvidia_smi`: answers the queries lib.sh and `gpu_stack` make.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

from megatron_gspo.engines.interpreter import engine_venv_dir
from megatron_gspo.engines.sgl_kernel_cpu import STUB_DIR

ROOT = Path(__file__).resolve().parents[2]
STANDINS = Path(__file__).resolve().parent / "standins"


def write_weights(model_dir: Path) -> None:
    """A valid (empty-tensor) safetensors file: what `model_files_problem` reads."""
    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    (model_dir / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)


def workdir(tmp: Path) -> Path:
    """A user's checkout as the recipes' relative paths see it, weights downloaded."""
    wd = tmp / "work"
    for src in (ROOT / "examples/recipes").iterdir():
        dst = wd / "examples/recipes" / src.name
        if src.is_dir():
            dst.mkdir(parents=True)
            shutil.copy(src / "config.json", dst / "config.json")
            write_weights(dst)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    (wd / "examples/slurm").symlink_to(ROOT / "examples/slurm")
    return wd


_HIDE_ROUTER = """\
import importlib.machinery, sys
class _Hidden(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] == "sglang_router":
            return None
        return super().find_spec(name, path, target)
sys.meta_path[:] = [_Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def engine_venv(cache: Path) -> str:
    """The engine venv's interpreter under `cache` (see the module doc); returns its path."""
    venv = engine_venv_dir(ROOT).name
    bin_dir = cache / venv / "bin"
    site = cache / venv / "site"
    bin_dir.mkdir(parents=True, exist_ok=True)
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_HIDE_ROUTER)
    python = bin_dir / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        f'PYTHONPATH="{site}:{STUB_DIR}:$PYTHONPATH" exec "{sys.executable}" "$@"\n'
    )
    python.chmod(0o755)
    (cache / venv / ".complete").write_text("")
    return str(python)


def fake_nvidia_smi(bin_dir: Path, *, driver: str, cuda: str, mem_mib: int) -> Path:
    """A `nvidia-smi` reporting 8 GPUs of `mem_mib` MiB and `driver` (CUDA `cuda`)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in\n'
        f'  *memory.total*) for i in 0 1 2 3 4 5 6 7; do echo {mem_mib}; done ;;\n'
        f'  *driver_version*) for i in 0 1 2 3 4 5 6 7; do echo {driver}; done ;;\n'
        f'  *) echo "| Driver Version: {driver}   CUDA Version: {cuda} |" ;;\n'
        "esac\n"
    )
    smi.chmod(0o755)
    return bin_dir
