"""The Slurm scripts as documented, with no environment but CONFIG (issue 35, items 1-3, 8).

Each recipe's header command (`CONFIG=... [ROLLOUT_NODES=R] sbatch --nodes N <script>`) and each
script's own header example is run as a user runs it: from a checkout whose model directories
hold the downloaded weights, the trainer's venv active (`python3`), the engine venv built by
`scripts/engine_env.sh` (`slurm_kit.engine_venv`), no GPU_MEM_GB / GPUS_PER_NODE /
ENGINE_PYTHON / PLAN_FORCE. srun / scontrol / sbatch / curl are the stand-ins of test_slurm.py;
the planner is the real one. Checked: every documented job passes the planner (FITS, topology
OK, exit 0) on the sbatch header's GPUs, and starts its engines in the engine venv and the
router in an interpreter that has it. Then the defaults' other branches: GPU memory and the
driver read from a `nvidia-smi` on PATH, no engine venv, the trainer's interpreter as
ENGINE_PYTHON, weights missing: each refused in one line before anything starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.engines.sglang_loader import LOADER
from tests.plan.slurm_kit import ROOT, STANDINS, engine_venv, fake_nvidia_smi, workdir

SCRIPTS = sorted((ROOT / "examples/slurm").glob("*.sbatch"))
_CMD = re.compile(
    r"CONFIG=(?P<config>\S+)\s+(?:ROLLOUT_NODES=(?P<rollout>\d+)\s+)?sbatch\s+--nodes\s+"
    r"(?P<nodes>\d+)\s+(?P<script>\S+\.sbatch)"
)


def documented() -> list[tuple[str, int, int, str]]:
    """(config, nodes, rollout nodes, script) of every command the headers document."""
    found = set()
    for f in [*(ROOT / "examples/recipes").glob("*.yaml"), *SCRIPTS]:
        head = "".join(
            line.lstrip("#").strip() + " " for line in f.read_text().splitlines()
            if line.startswith("#")
        ).replace("\\ ", "")  # fmt: skip
        for m in _CMD.finditer(head):
            found.add((m["config"], int(m["nodes"]), int(m["rollout"] or 0), m["script"]))
    return sorted(found)


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The planner's parameter-count cache for the recipes (one megatron import)."""
    cache = tmp_path_factory.mktemp("counts") / "param_counts.json"
    code = "from megatron_gspo.plan.planner import cached_count_params, load_config\n"
    for recipe in sorted((ROOT / "examples/recipes").glob("*.yaml")):
        code += (
            f"c = load_config({str(recipe)!r})\n"
            f"w = {{'qwen3-30b-a3b': 8, 'qwen3-235b-a22b': 64}}[c.model.hf_path.split('/')[-1]]\n"
            f"cached_count_params({str(ROOT)!r} + '/' + c.model.hf_path, c.parallel, w, "
            f"{str(cache)!r})\n"
        )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600, cwd=ROOT)
    return cache


def user_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a user with the trainer's venv active and the engine venv built."""
    drop = {"GPU_MEM_GB", "GPUS_PER_NODE", "ENGINE_PYTHON", "PYTHON", "PLAN_FORCE", "LOG_DIR",
            "PLAN_CACHE", "MGSPO_ENGINE_PYTHON", "MGSPO_CACHE"}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    (tmp / "d").mkdir(parents=True, exist_ok=True)
    venv_bin = Path(sys.executable).parent  # the active venv: its `python3` is this one
    env |= {
        "PATH": f"{STANDINS}:{venv_bin}:{env['PATH']}",
        "PYTHONPATH": str(ROOT),  # the package, as `pip install -e .` would put it
        "PYTHONWARNINGS": "ignore",
        "MGSPO_CACHE": str(tmp / "cache"),  # where scripts/engine_env.sh built the engine venv
        "STANDIN_DIR": str(tmp / "d"),
        "STANDIN_TRAIN_S": "1",
    }
    return env | extra


def sbatch(wd: Path, env: dict[str, str], config: str, nodes: int, rollout: int, script: str):
    if rollout:
        env = env | {"ROLLOUT_NODES": str(rollout)}
    env = env | {"CONFIG": config}
    cmd = ["sbatch", "--nodes", str(nodes), script]
    return subprocess.run(
        cmd, env=env, cwd=wd, capture_output=True, text=True, timeout=300,
        executable=str(STANDINS / "sbatch"),
    )  # fmt: skip


def steps(tmp: Path) -> list[list[str]]:
    return [
        [a.decode() for a in p.read_bytes().split(b"\0")[:-1]]
        for p in sorted((tmp / "d").glob("srun.*"))
    ]


def _has_router(python: str) -> bool:
    find = "import importlib.util as u, sys; sys.exit(not u.find_spec('sglang_router'))"
    return subprocess.run([python, "-c", find], timeout=120).returncode == 0


def test_headers_document_every_recipe() -> None:
    got = documented()
    recipes = {f"examples/recipes/{f.name}" for f in (ROOT / "examples/recipes").glob("*.yaml")}
    assert {c for c, *_ in got} == recipes, got
    for s in SCRIPTS:  # the job is given GPUs: else the srun steps on many clusters see none
        assert re.search(r"^#SBATCH --gpus-per-node=8$", s.read_text(), re.M), s.name


@pytest.mark.slow  # the 235B recipes' parameter counts: one megatron meta build (~1 min)
@pytest.mark.parametrize("job", documented(), ids=lambda j: f"{Path(j[0]).stem}-{j[1]}n")
def test_documented_job_passes_the_planner(
    job: tuple[str, int, int, str], tmp_path: Path, counts: Path
) -> None:
    config, nodes, rollout, script = job
    wd = workdir(tmp_path)
    (wd / "logs").mkdir()
    shutil.copy(counts, wd / "logs/param_counts.json")  # lib.sh's default PLAN_CACHE
    engine = engine_venv(tmp_path / "cache")
    p = sbatch(wd, user_env(tmp_path), config, nodes, rollout, script)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    plan = json.loads((wd / "logs/slurm-4242/plan.json").read_text())
    assert plan["fits"] and not plan["topology"], out[-3000:]
    assert plan["gpus_per_node"] == 8 and plan["gpu_mem_gb"] == 140  # the H200 default
    run = steps(tmp_path)
    engines = [s for s in run if "sglang.launch_server" in s]
    assert engines and all(engine in s for s in engines)  # the engine venv's interpreter
    # it finds the package (PYTHONPATH): the engines get our expert-slice loader
    assert all(s[s.index("--custom-weight-loader") + 1] == LOADER for s in engines)
    routers = [s for s in run if "sglang_router.launch_router" in s]
    assert len(routers) == (1 if rollout else 0)
    for r in routers:  # from an interpreter that has it: not the engine venv
        python = r[r.index("sglang_router.launch_router") - 2]
        assert python != engine and _has_router(python), r


@pytest.mark.slow
def test_gpu_memory_and_driver_from_nvidia_smi(tmp_path: Path, counts: Path) -> None:
    """GPU memory is nvidia-smi's (an 80 GB GPU: the 30B recipe does not fit), and a driver
    too old for the CUDA 13 build is named in one line before anything starts."""
    wd = workdir(tmp_path)
    (wd / "logs").mkdir()
    shutil.copy(counts, wd / "logs/param_counts.json")
    engine_venv(tmp_path / "cache")
    smi = fake_nvidia_smi(tmp_path / "smi", driver="570.124.06", cuda="12.8", mem_mib=81559)
    env = user_env(tmp_path)
    env["PATH"] = f"{smi}:{env['PATH']}"
    config = "examples/recipes/qwen3_30b_a3b_bf16.yaml"
    p = sbatch(wd, env, config, 1, 0, "examples/slurm/colocated.sbatch")
    out = p.stdout + p.stderr
    plan = json.loads((wd / "logs/slurm-4242/plan.json").read_text())
    assert plan["gpu_mem_gb"] == pytest.approx(79.6) and not plan["fits"], out[-2000:]
    refused = [x for x in out.splitlines() if x.startswith("plan: refused: ")]
    assert p.returncode == 2 and len(refused) == 1, out[-2000:]
    assert "NVIDIA driver 570.124.06 supports CUDA up to 12.8" in refused[0]
    assert "CUDA 13.0 build" in refused[0] and "R580" in refused[0]
    assert steps(tmp_path) == []


@pytest.mark.slow
def test_refused_before_anything_starts(tmp_path: Path, counts: Path) -> None:
    """No engine venv and no ENGINE_PYTHON; the trainer's interpreter as ENGINE_PYTHON; a
    model directory without weights: each ends the job in one line, nothing started."""
    wd = workdir(tmp_path)
    (wd / "logs").mkdir()
    shutil.copy(counts, wd / "logs/param_counts.json")
    config, script = "examples/recipes/qwen3_30b_a3b_bf16.yaml", "examples/slurm/colocated.sbatch"
    p = sbatch(wd, user_env(tmp_path), config, 1, 0, script)  # no engine venv built
    assert p.returncode == 2 and "scripts/engine_env.sh" in p.stderr, p.stdout + p.stderr
    assert steps(tmp_path) == []
    env = user_env(tmp_path, ENGINE_PYTHON=sys.executable)
    p = sbatch(wd, env, config, 1, 0, script)
    refused = [x for x in p.stdout.splitlines() if x.startswith("plan: refused: ")]
    assert p.returncode == 2 and len(refused) == 1, p.stdout + p.stderr
    assert "no sgl_kernel" in refused[0] and "ENGINE_PYTHON" in refused[0]
    engine_venv(tmp_path / "cache")
    (wd / "examples/recipes/qwen3-30b-a3b/model.safetensors").unlink()
    p = sbatch(wd, user_env(tmp_path), config, 1, 0, script)
    refused = [x for x in p.stdout.splitlines() if x.startswith("plan: refused: ")]
    assert p.returncode == 2 and len(refused) == 1, p.stdout + p.stderr
    assert "model.hf_path=examples/recipes/qwen3-30b-a3b: no *.safetensors" in refused[0]
    assert steps(tmp_path) == []
