"""Recipe rehearsals: every shipped recipe in its Slurm mode, as a user would run it, on CPU.

For each recipe (examples/recipes/*.yaml) and the Slurm script its header names: the recipe's
own YAML with only the model size (`testing/rehearsal.shrink`: a tiny model of the same family
and layout shape) and the device (`device_sets`: CPU ranks over gloo, in the recipe's
bf16) changed; FP8 recipes'
engine checkpoint written by tools/fp8_checkpoint.py from the tiny BF16 one. Then what the
Slurm script does, in its order: the real planner (`python -m megatron_gspo.plan ...
--emit-launch`, refusing a bad topology), the emitted engine command lines (served by
`rehearsal_engine`, which shards, loads and reports checksums per TP rank as SGLang, with
`sglang.launch_server` swapped for it but run by the emitted interpreter: the engine venv of
scripts/engine_env.sh, with the CPU stand-in of `sgl_kernel` as a CPU server has it), the
emitted router command line as is (the real sglang-router from the interpreter the planner
found it in: the engine venv has none), and the real trainer in this (the trainer's) venv
(`torchrun` running `megatron_gspo.train --config RECIPE` with the emitted `--set`s) for 2 steps
with the recipe's transport, FP8 and verification. Before issue 35 the router's command line
named the engine venv, which has no sglang_router, and this test swapped in its own interpreter;
run as emitted, the 235B rehearsals' router died before it was healthy.
Checked: the run exits 0 after 2 steps with every verified push (the recipe's `verify_every`)
verified on every engine TP rank. Only for time: the trainer's ranks import while the engines
start and run the trainer once the health probes pass (tests/plan/rehearsal_rank.py).

Defects 2-4 of issue 20 planted back into a recipe (`PLANTED`) end the rehearsal at the planner
(exit 2, one refusal line), before anything starts.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from megatron_gspo.config import load_config
from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.data.toy import save_toy_tokenizer, write_toy_dataset
from megatron_gspo.dist import free_port
from megatron_gspo.engines.launch import cpu_engine_env
from megatron_gspo.run.metrics_log import read_metrics
from megatron_gspo.testing.rehearsal import device_sets, shrink
from megatron_gspo.weights.fp8_checkpoint import write_fp8_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.multirank,
    pytest.mark.rehearsal,
    pytest.mark.timeout(900),
]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
# recipe -> (Slurm script, nodes, rollout nodes, GPUs per node) from its header
RECIPES = {
    "qwen3_30b_a3b_bf16": ("colocated.sbatch", 1, 0, 8),
    "qwen3_30b_a3b_fp8": ("colocated.sbatch", 1, 0, 8),
    "qwen3_235b_a22b_bf16": ("disaggregated.sbatch", 12, 4, 8),
    "qwen3_235b_a22b_fp8": ("disaggregated.sbatch", 12, 4, 8),
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}


def _wait(urls: list[str], procs: list[subprocess.Popen], timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        for p in procs:
            assert p.poll() is None, f"{p.args[:4]} exited {p.returncode} before it was healthy"
        assert time.monotonic() < deadline, f"not healthy: {pending}"
        try:
            urllib.request.urlopen(pending[0], timeout=5).read()
            pending.pop(0)
        except OSError:
            time.sleep(0.5)


def _nul(path: Path) -> list[str]:
    return [a.decode() for a in path.read_bytes().split(b"\0")[:-1]]


def rehearse(
    recipe: str,
    tmp: Path,
    engine_python: str,
    extra: tuple[str, ...] = (),
    counts_cache: Path | None = None,
) -> dict:
    """Run one rehearsal; returns {"stage", "rc", "out", "metrics", "times"}. `counts_cache`:
    the planner's parameter-count cache (the Slurm script passes one too), shared by the tests
    of one session so that a planted defect's planner run skips the megatron import."""
    times: dict[str, float] = {}
    t0 = time.monotonic()
    script, nodes, rollout_nodes, gpus = RECIPES[recipe]
    config = str(ROOT / "examples/recipes" / f"{recipe}.yaml")
    cfg = load_config(config, list(extra))
    hf = json.loads((Path(cfg.model.hf_path) / "config.json").read_text())
    r = shrink(cfg, hf, nodes=nodes, rollout_nodes=rollout_nodes, gpus_per_node=gpus)
    model = tmp / "toy/model"
    save_tiny_hf_checkpoint(model, seed=0, perturb_norms=False, **r.hf_overrides)
    save_toy_tokenizer(model)
    write_toy_dataset(tmp / "toy/toy.jsonl", 64, seed=0, ops=("copy",))
    sets = (
        device_sets(cfg)
        + r.sets
        + [
            f"model.hf_path={model}",
            f"data.train_path={tmp}/toy/toy.jsonl",
            f"logging.dir={tmp}/run",
            f"checkpoint.dir={tmp}/ckpt",
            f"train.steps={STEPS}",
            f"rollout.launch.base_port={free_port()}",
            f"rollout.launch.router_port={free_port()}",
            f"rollout.launch.router_metrics_port={free_port()}",
        ]
    )
    launch = cfg.rollout.launch
    if launch is not None and launch.model_path and launch.model_path != cfg.model.hf_path:
        # the recipe's engines start from a checkpoint of their own (block FP8): the tool's
        write_fp8_checkpoint(model, tmp / "toy/model_fp8")
        sets.append(f"rollout.launch.model_path={tmp}/toy/model_fp8")
    sets += list(extra)
    trainer_nodes = r.nodes - r.rollout_nodes
    hosts = (
        ["127.0.0.1"]
        if trainer_nodes == 1 and not r.rollout_nodes
        else [f"rehearsal-trainer-{i}" for i in range(trainer_nodes)] + ["127.0.0.1"]
    )
    launch_dir = tmp / "launch"
    plan = [sys.executable, "-m", "megatron_gspo.plan", "--config", config]
    plan += [a for s in sets for a in ("--set", s)]
    plan += ["--nodes", str(r.nodes), "--gpus-per-node", str(r.gpus_per_node)]
    plan += ["--gpu-mem-gb", "141", "--rollout-nodes", str(r.rollout_nodes)]
    plan += ["--hosts", ",".join(hosts), "--emit-launch", str(launch_dir)]
    plan += ["--engine-python", engine_python, "--quiet"]
    if counts_cache is not None:
        plan += ["--counts-cache", str(counts_cache)]
    if script == "colocated.sbatch":
        plan.append("--engines-external")  # as the script plans it
    times["setup"] = time.monotonic() - t0
    p = subprocess.run(plan, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    times["plan"] = time.monotonic() - t0
    if p.returncode not in (0,):
        return {"stage": "plan", "rc": p.returncode, "out": p.stdout + p.stderr}
    procs: list[subprocess.Popen] = []
    logs = tmp / "logs"
    logs.mkdir()
    try:
        urls = (launch_dir / "engine_urls").read_text().split()
        for i, f in enumerate(sorted(launch_dir.glob("engine*.argv"))):
            argv = _nul(f)
            assert argv[:3] == [engine_python, "-m", "sglang.launch_server"], argv
            # the emitted interpreter (the engine venv), the stand-in for SGLang's server module
            cmd = [argv[0], "-m", "tests.plan.rehearsal_engine", *argv[3:]]
            with open(logs / f"engine{i}.log", "w") as log:
                procs.append(
                    subprocess.Popen(
                        cmd, cwd=ROOT, env=cpu_engine_env(_env()), stdout=log, stderr=log,
                        start_new_session=True,
                    )  # fmt: skip
                )
        # The trainer (torchrun, one rank per CPU "GPU") with the emitted `--set`s starts now
        # and pays its imports while the engines start; it runs `megatron_gspo.train` once the
        # health probes pass (tests/plan/rehearsal_rank.py), as the Slurm script starts it then.
        emitted = _nul(launch_dir / "trainer.sets")
        go = tmp / "engines_healthy"
        train = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node"]
        train += [str(r.trainer_world), "--master_port", str(free_port())]
        train += ["-m", "tests.plan.rehearsal_rank", str(go), "--config", config]
        train += [a for s in sets + emitted for a in ("--set", s)]
        # output to a file: torch's shm manager (CPU tensor IPC) outlives the ranks holding
        # inherited pipes until the engines are gone
        with open(logs / "trainer.log", "w") as log:
            trainer = subprocess.Popen(
                train,
                cwd=ROOT,
                env=_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        procs.append(trainer)
        _wait([f"{u}/health_generate" for u in urls], procs)
        times["engines"] = time.monotonic() - t0
        if (launch_dir / "router.argv").exists():
            # the emitted command line as is: its interpreter is the planner's choice
            router_argv = _nul(launch_dir / "router.argv")
            with open(logs / "router.log", "w") as log:
                procs.append(
                    subprocess.Popen(
                        router_argv,
                        cwd=ROOT,
                        stdout=log,
                        stderr=log,
                        start_new_session=True,
                    )  # fmt: skip
                )
            router = (launch_dir / "router_url").read_text().strip()
            _wait([f"{router}/health"], procs)
            times["router"] = time.monotonic() - t0
        go.write_text("")  # the engines (and router) are healthy: the trainer starts now
        rc = trainer.wait(timeout=600)
        times["trainer"] = time.monotonic() - t0
        out = (logs / "trainer.log").read_text()[-4000:]
        if rc != 0:
            out += "".join(
                f"\n--- {f.name}\n" + f.read_text()[-1500:]
                for f in logs.iterdir()
                if f.name != "trainer.log"
            )
            return {"stage": "train", "rc": rc, "out": out}
        rows = read_metrics(tmp / "run/metrics.jsonl")
        resolved = json.loads((tmp / "run/config.json").read_text())
        return {"stage": "done", "rc": 0, "out": out, "metrics": rows, "emitted": emitted,
                "times": times, "config": resolved}  # fmt: skip
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        times["teardown"] = time.monotonic() - t0


@pytest.fixture(scope="module")
def counts_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("plan") / "param_counts.json"


# Resume in the recipes' precision (issue 35, defect 6: a resume let the bf16 model params
# overwrite the fp32 main params just loaded; fp32 runs cannot show it, the main params are the
# model's there). The 30B recipe's rehearsal also saves after every step; a second rehearsal of
# it resumes the step-1 checkpoint (engines and trainer started afresh, as a requeued Slurm job)
# and must train step 2 exactly as the first did: the same metrics and a bit-identical step-2
# checkpoint, fp32 main params and Adam moments included. At the recipe's lr (1e-6) two steps
# move few bf16 weights (an update is far below a bf16 ulp): the main params hold the rest.
RESUMED = "qwen3_30b_a3b_bf16"
RESUME_SETS = ("checkpoint.save_every=1",)


def _resume(first_tmp: Path, tmp: Path, engine_python: str, counts_cache: Path) -> dict:
    """The resumed rehearsal of `RESUMED` from the step-1 checkpoint under `first_tmp`."""
    ckpt = tmp / "resumed_ckpt"  # step 1 of the first run, as `latest` of a directory of its own
    shutil.copytree(first_tmp / "ckpt/step_000001", ckpt / "step_000001")
    (ckpt / "latest").write_text("step_000001\n")
    # a requeued job reads the same prompt file: a resume may not change data.train_path (the
    # saved prompt-loader position indexes that file; preflight.check_resume refuses it)
    sets = (
        *RESUME_SETS,
        f"checkpoint.dir={ckpt}",
        "checkpoint.resume=true",
        f"data.train_path={first_tmp}/toy/toy.jsonl",
    )
    again = rehearse(RESUMED, tmp, engine_python, sets, counts_cache=counts_cache)
    return {**again, "ckpt": ckpt, "tmp": tmp}


@pytest.fixture(scope="module")
def rehearsals(
    tmp_path_factory: pytest.TempPathFactory, engine_python: str, counts_cache: Path
) -> dict[str, tuple[dict, float]]:
    """Every recipe's rehearsal, two at a time: one rehearsal keeps about 1.5 of 2 cores busy
    (engine start-up and health waits leave the rest idle), so a pair takes ~0.75x the time of
    the two in turn. Each has its own directory and ports. `RESUMED` goes first, its resumed
    rehearsal right after it in the same lane (under `"resumed"`), while the other lane runs
    the 12-node recipes."""

    def one(recipe: str) -> tuple[dict, float]:
        t0 = time.monotonic()
        tmp = tmp_path_factory.mktemp(recipe)
        extra = RESUME_SETS if recipe == RESUMED else ()
        got = rehearse(recipe, tmp, engine_python, extra, counts_cache=counts_cache)
        if recipe == RESUMED and got["stage"] == "done":
            again = tmp_path_factory.mktemp("resumed")
            got["resumed"] = _resume(tmp, again, engine_python, counts_cache)
        return {**got, "tmp": tmp}, time.monotonic() - t0

    # transformers resolves its lazy names without a lock: resolve the ones rehearse() uses
    # here, before two threads ask for them at once (else: ImportError in one of them)
    from transformers import (  # noqa: F401
        PreTrainedTokenizerFast,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    rest = sorted((r for r in RECIPES if r != RESUMED), key=lambda r: -RECIPES[r][1])
    order = [RESUMED, *rest]  # then the 12-node recipes
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(order, pool.map(one, order), strict=True))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_rehearsal(recipe: str, rehearsals: dict[str, tuple[dict, float]]) -> None:
    got, seconds = rehearsals[recipe]
    assert got["stage"] == "done", f"{got['stage']} exited {got['rc']}:\n{got['out']}"
    rows = got["metrics"]
    assert sorted(rows) == list(range(1, STEPS + 1))
    # the recipe's verification schedule: the first push (version 1, before step 1) always,
    # then every `verify_every`-th version; a verified push checks every TP rank of every engine
    recipe_cfg = load_config(str(ROOT / "examples/recipes" / f"{recipe}.yaml"))
    every = recipe_cfg.weights.verify_every
    assert every > 0, "the recipe turned verification off"
    # the recipe's precision (issue 35): bf16 parameters, fp32 main params in its optimizer
    ran = got["config"]
    assert ran["model"]["dtype"] == recipe_cfg.model.dtype == "bf16", ran["model"]
    assert ran["optim"]["use_distributed_optimizer"] == recipe_cfg.optim.use_distributed_optimizer
    for step, m in rows.items():
        assert m["weights/version"] == step + 1
        if (step + 1) % every == 0:
            assert m["weights/verified"] == 1.0, (step, m)
    ends = " ".join(f"{k}@{v:.0f}" for k, v in got["times"].items())
    print(f"{recipe}: {seconds:.0f} s ({ends})")


def _checkpoint_state(step_dir: Path, out: Path) -> dict:
    """Every entry of a megatron-core torch_dist checkpoint (a torch DCP directory), read on one
    process: model tensors, optimizer shards (fp32 main params, exp_avg, exp_avg_sq), objects."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=False)


def test_rehearsal_resumes_bit_for_bit_in_bf16(rehearsals: dict[str, tuple[dict, float]]) -> None:
    first, _ = rehearsals[RESUMED]
    assert first["stage"] == "done", f"{first['stage']} exited {first['rc']}:\n{first['out']}"
    again = first["resumed"]
    assert again["stage"] == "done", f"{again['stage']} exited {again['rc']}:\n{again['out']}"
    assert again["config"]["model"]["dtype"] == "bf16"
    assert sorted(again["metrics"]) == [2]
    want, got = first["metrics"][2], again["metrics"][2]
    for k in ("loss", "grad_norm", "reward/mean", "policy/clip_frac", "mismatch/abs_logp_diff"):
        assert got[k] == want[k], (k, got[k], want[k])
    a = _checkpoint_state(first["tmp"] / "ckpt/step_000002", again["tmp"] / "a.pt")
    b = _checkpoint_state(again["ckpt"] / "step_000002", again["tmp"] / "b.pt")
    assert a.keys() == b.keys()
    main = [k for k in a if "optimizer" in k and k.endswith(".param")]
    assert main and all(a[k].dtype == torch.float32 for k in main), main  # fp32 main params
    # Compared: every model tensor and the expert optimizer's state (chained_1). The dense
    # optimizer's flattened buffers (chained_0) hold the grad buffer's alignment gaps between
    # parameters, which megatron-core's dp_reshardable save leaves uninitialised (measured: 80
    # of 66624 elements differ between the two runs, holding values such as 1e28 and 1e38;
    # with the old load 59188 differed, and 24574 of 24576 expert main params).
    compared = [
        k for k in a if torch.is_tensor(a[k]) and ("optimizer" not in k or "chained_1" in k)
    ]
    assert any("chained_1" in k and k.endswith(".param") for k in compared), list(a)
    differ = [k for k in compared if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} entries of the step-2 checkpoints differ: {differ[:4]}"


# Defects 2-4 of the issue planted back into a recipe: the rehearsal must stop at the planner's
# topology check (exit 2, one refusal line naming the key), before any engine or trainer starts.
# (On CPU over gloo each of them would run: only the check stands between them and a GPU job
# that fails.)
PLANTED = {
    # 2: colocated engines in the trainer's NCCL weight-update group (one GPU, two ranks)
    "nccl_same_gpu": (
        "qwen3_30b_a3b_bf16",
        ("weights.transport=distributed",),
        "weights.transport=distributed with engines on the trainer's GPUs",
    ),
    # 3: FP8 pushes into engines started from the BF16 checkpoint (online FP8, no scales)
    "fp8_engine_from_bf16": (
        "qwen3_30b_a3b_fp8",
        ('rollout.launch.model_path=""',),  # model.hf_path: the BF16 one
        "weights.fp8=true pushes block-FP8 weights with weight_scale_inv, but the engines start",
    ),
    # 4: the weight-update master pinned to the first Slurm host of a multi-node trainer
    "master_address_pinned": (
        "qwen3_235b_a22b_bf16",
        ("weights.master_address=rehearsal-trainer-0",),
        "weights.master_address=rehearsal-trainer-0 is pinned",
    ),
}


@pytest.mark.parametrize("defect", PLANTED)
def test_planted_defect_refused_before_launch(
    defect: str, tmp_path: Path, engine_python: str, counts_cache: Path
) -> None:
    recipe, sets, line = PLANTED[defect]
    got = rehearse(recipe, tmp_path, engine_python, extra=sets, counts_cache=counts_cache)
    assert (got["stage"], got["rc"]) == ("plan", 2), got["out"][-2000:]
    refusals = [x for x in got["out"].splitlines() if x.startswith("plan: refused: ")]
    assert len(refusals) == 1 and line in refusals[0], got["out"][-2000:]
    assert not (tmp_path / "logs").exists()  # nothing was started
    print(f"[{defect}] {refusals[0]}")
