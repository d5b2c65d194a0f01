"""What an interpreter's torch would load on a GPU node: CUDA build against the driver, NCCL.

The trainer and the engines run in two venvs (constraints.txt, constraints-engine.txt), each
with its own torch. Two GPU-only failures follow from that, and both are visible before
anything starts:

* Both locks are CUDA 13 builds. On a driver older than R580 (CUDA 13.0) torch sees no GPU
  and falls back to CPU; the job would then stop much later with a message about
  `model.dtype`. `driver_problem` names the driver and the fix in one line.
* NCCL refuses a communicator whose ranks run different NCCL versions; the weight-update group
  (`weights.transport=distributed`) joins trainer and engine ranks. `nccl_problem` compares
  the versions the two interpreters load.

`probe(python)` asks an interpreter in a subprocess (its own sys.path, its own torch): the
`nvidia-nccl-*` distributions it would import first, its torch's CUDA build, and, only where
`nvidia-smi` exists, whether torch sees a GPU and the NCCL it loads (importing torch costs
seconds, so CPU machines never pay it). Plain Python here: the planner loads without torch.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Driver",
    "driver_problem",
    "nccl_problem",
    "nvidia_driver",
    "probe",
    "torch_here",
]

# Runs in the probed interpreter: argv[1:] are top-level module names to locate (find_spec of
# a top-level name imports nothing).
_PROBE = r"""
import importlib.metadata as md, importlib.util as u, json, re, shutil, sys
out = {"python": sys.executable, "nccl": {}, "modules": {}}
for d in md.distributions():  # sys.path order: the first one found is the one imported
    name = (d.metadata.get("Name") or "").lower().replace("_", "-")
    if name.startswith("nvidia-nccl") and name not in out["nccl"]:
        out["nccl"][name] = d.version
for m in sys.argv[1:]:
    out["modules"][m] = u.find_spec(m) is not None
spec = u.find_spec("torch")
out["torch"] = out["cuda_build"] = None
if spec is not None and spec.origin:
    try:
        out["torch"] = md.version("torch")
    except md.PackageNotFoundError:
        pass
    try:  # torch/version.py names the CUDA build; reading it imports nothing
        text = open(spec.origin.rsplit("/", 1)[0] + "/version.py").read()
        m = re.search(r"^cuda(?::\s*\S+)?\s*=\s*'([^']*)'", text, re.M)
        out["cuda_build"] = m.group(1) if m else None
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        import torch
        out["cuda_available"] = torch.cuda.is_available()
        if out["cuda_available"]:
            out["nccl_loaded"] = ".".join(map(str, torch.cuda.nccl.version()))
print(json.dumps(out))
"""


def probe(python: str, modules: tuple[str, ...] = (), timeout_s: float = 300.0) -> dict[str, Any]:
    """What `python` would load (see the module doc); `modules`: top-level names to locate.
    Raises OSError when `python` cannot run (missing, not executable, or failing)."""
    try:
        p = subprocess.run(
            [python, "-c", _PROBE, *modules], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise OSError(f"{python}: cannot run it ({e})") from None
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise OSError(f"{python}: exited {p.returncode} ({last})")
    info: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    info["python"] = python  # as the user named it (a venv's bin/python may be a link)
    return info


def torch_here() -> dict[str, Any]:
    """What `probe` reports about torch, for this process's torch (imported here: the trainer's
    preflight imports it anyway)."""
    import torch

    return {
        "python": sys.executable,
        "torch": torch.__version__.split("+")[0],
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }


@dataclass(frozen=True)
class Driver:
    """The NVIDIA driver as `nvidia-smi` reports it."""

    version: str
    """e.g. 570.133.20"""
    cuda: str | None
    """The newest CUDA runtime the driver supports (the "CUDA Version" of nvidia-smi)."""


def nvidia_driver() -> Driver | None:
    """The driver on this machine, or None where there is no `nvidia-smi` (or it fails)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        q = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        full = subprocess.run([smi], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = q.stdout.split()
    if q.returncode != 0 or not lines:
        return None
    m = re.search(r"CUDA Version:\s*([0-9.]+)", full.stdout)
    return Driver(version=lines[0], cuda=m.group(1) if m else None)


def _ver(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def driver_problem(info: dict[str, Any], driver: Driver | None, who: str) -> str | None:
    """One line when `who`'s torch (`info` from `probe`) cannot use this machine's GPUs,
    naming the driver version and what to do; None without a driver or when torch sees it."""
    if driver is None:
        return None
    torch_v = info.get("torch")
    if torch_v is None:
        return None  # no torch in this interpreter: nothing of ours runs CUDA in it
    build = info.get("cuda_build")
    where = f"{who} ({info.get('python')})"
    if not build:
        return (
            f"NVIDIA driver {driver.version} is here but {where} has torch {torch_v}, a CPU-only "
            "build; install the locked CUDA build (bash scripts/env.sh / scripts/engine_env.sh)"
        )
    need = "R580 or newer" if _ver(build)[:1] == (13,) else f"one that supports CUDA {build}"
    if driver.cuda and _ver(driver.cuda)[:2] < _ver(build)[:2]:
        return (
            f"NVIDIA driver {driver.version} supports CUDA up to {driver.cuda}, but {where} has "
            f"torch {torch_v}, a CUDA {build} build: it cannot use the GPUs (torch falls back "
            f"to CPU); install an NVIDIA driver {need}"
        )
    if info.get("cuda_available") is False:
        return (
            f"NVIDIA driver {driver.version} (CUDA {driver.cuda or '?'}) is here but {where}'s "
            f"torch {torch_v} (CUDA {build} build) sees no GPU: check the job's GPU allocation "
            "(#SBATCH --gpus-per-node, CUDA_VISIBLE_DEVICES) and that nvidia-smi lists the GPUs"
            f"; the CUDA {build} build needs a driver {need}"
        )
    return None


def _nccl(info: dict[str, Any]) -> dict[str, str]:
    """{package: version} of the NCCL `info`'s interpreter loads; torch's own answer where a
    GPU let the probe ask it."""
    if info.get("nccl_loaded"):
        return {"loaded": str(info["nccl_loaded"])}
    return dict(info.get("nccl") or {})


def nccl_problem(trainer: dict[str, Any], engine: dict[str, Any]) -> str | None:
    """One line when the trainer's and the engines' interpreters load different NCCL
    versions (compared per `nvidia-nccl-*` package both have, or as torch reports it)."""
    a, b = _nccl(trainer), _nccl(engine)
    if ("loaded" in a) != ("loaded" in b):  # one side probed on a GPU: compare dist-infos
        a, b = dict(trainer.get("nccl") or {}), dict(engine.get("nccl") or {})
    for k in sorted(set(a) & set(b)):
        if _ver(a[k]) != _ver(b[k]):
            pkg = k if k != "loaded" else "nvidia-nccl-cu13"
            return (
                f"weights.transport=distributed joins trainer and engine ranks in one NCCL "
                f"group, but the trainer's interpreter ({trainer.get('python')}) loads NCCL "
                f"{a[k]} and the engines' ({engine.get('python')}) {b[k]}, and NCCL refuses "
                f"ranks of different versions; install {pkg}=={b[k]} in the trainer's venv "
                "(constraints.txt and constraints-engine.txt pin one version)"
            )
    return None
