"""The Slurm scripts (examples/slurm/) run with stand-ins for srun / scontrol / sbatch / curl on
PATH (tests/plan/standins/), from a working directory whose model directories hold weights, with
the engine venv's interpreter as `slurm_kit.engine_venv` makes it: the real planner runs first,
then the scripts' srun steps are recorded and played (engines serve until SIGTERM, the trainer
runs a moment). Checked: the torchrun, engine and router command lines (engines in the engine
venv, the router in the interpreter that has it) for 1 node colocated and 2 and 4 nodes
disaggregated, that nothing starts when the planner refuses (a layout, a memory fit, or the
topology: colocated on 2 nodes), and that a failing engine, a failing trainer or a
SIGTERM (preemption: the trainer checkpoints first) tears everything down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.plan.slurm_kit import engine_venv, workdir

ROOT = Path(__file__).resolve().parents[2]
STANDINS = Path(__file__).resolve().parent / "standins"
RECIPE = ROOT / "examples/recipes/qwen3_30b_a3b_bf16.yaml"
HF = ROOT / "examples/recipes/qwen3-30b-a3b"
GPUS = 8
ENGINE_TP = 2  # the recipe's rollout.launch.tp_size


@pytest.fixture(scope="module")
def counts_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The planner's parameter counts for every trainer world used below, computed in one
    process (one megatron import), so each script run re-reads them."""
    cache = tmp_path_factory.mktemp("plan") / "counts.json"
    code = (
        "from megatron_gspo.plan.planner import cached_count_params; "
        "from megatron_gspo.layout import Layout\n"
        f"for w in (8, 16, 32): cached_count_params({str(HF)!r}, Layout(ep=8), w, {str(cache)!r})"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300, cwd=ROOT)
    return cache


class Job:
    """One sbatch run: its exit status, recorded srun steps and stand-in events."""

    def __init__(self, tmp: Path, proc: subprocess.CompletedProcess | subprocess.Popen) -> None:
        self.tmp = tmp
        self.proc = proc
        self.steps = [p.read_bytes().split(b"\0")[:-1] for p in sorted((tmp / "d").glob("srun.*"))]
        self.steps = [[a.decode() for a in s] for s in self.steps]
        events = (tmp / "d/events").read_text() if (tmp / "d/events").exists() else ""
        self.events = [e.split() for e in events.splitlines()]

    def of(self, marker: str) -> list[tuple[list[str], list[str]]]:
        """(srun options, command) of every step whose command contains `marker`."""
        out = []
        for argv in self.steps:
            if marker in argv:
                i = next(i for i, a in enumerate(argv) if not a.startswith("--"))
                out.append((argv[:i], argv[i:]))
        return out

    def pids(self, kind: str = "") -> set[int]:
        return {int(e[2]) for e in self.events if e[0] == "start" and e[1].startswith(kind)}


def _env(tmp: Path, cache: Path, **extra: str) -> dict[str, str]:
    (tmp / "d").mkdir(parents=True, exist_ok=True)
    if not (tmp / "work").exists():  # the recipes' relative model paths, weights in them
        workdir(tmp)
    env = {
        **os.environ,
        "PATH": f"{STANDINS}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "PYTHONWARNINGS": "ignore",
        "STANDIN_DIR": str(tmp / "d"),
        "CONFIG": str(RECIPE),
        "PYTHON": sys.executable,
        "ENGINE_PYTHON": engine_venv(tmp / "cache"),
        "GPUS_PER_NODE": str(GPUS),
        "GPU_MEM_GB": "141",
        "LOG_DIR": str(tmp / "logs"),
        "PLAN_CACHE": str(cache),
        "PLAN_FORCE": "1",  # one node of the colocated recipe does not fit; the lines still do
        "POLL_S": "0.2",
        "KILL_AFTER_S": "5",
        "STANDIN_TRAIN_S": "1",
    }
    return env | extra


def _sbatch(tmp: Path, cache: Path, script: str, nodes: int, **extra: str) -> Job:
    cmd = ["sbatch", "--nodes", str(nodes), str(ROOT / "examples/slurm" / script)]
    env = _env(tmp, cache, **extra)
    proc = subprocess.run(
        cmd,
        env=env,
        cwd=tmp / "work",
        capture_output=True,
        text=True,
        timeout=120,
        executable=str(STANDINS / "sbatch"),
    )
    return Job(tmp, proc)


def _sbatch_sets(tmp: Path, cache: Path, script: str, nodes: int, *sets: str) -> Job:
    cmd = ["sbatch", "--nodes", str(nodes), str(ROOT / "examples/slurm" / script)]
    cmd += [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(
        cmd,
        env=_env(tmp, cache),
        cwd=tmp / "work",
        capture_output=True,
        text=True,
        timeout=120,
        executable=str(STANDINS / "sbatch"),
    )
    return Job(tmp, proc)


def _all_gone(job: Job) -> None:
    pids = job.pids()
    assert pids, job.events
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    for pid in alive:  # a failing test must not leave its stand-ins spinning
        if str(STANDINS / "srun") in " ".join(psutil.Process(pid).cmdline()):
            os.kill(pid, signal.SIGKILL)
    assert not alive, f"left running: {alive}"


def _value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def _sets(cmd: list[str]) -> dict[str, str]:
    pairs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
    return dict(p.split("=", 1) for p in pairs)


def _check_engines(job: Job, hosts: list[str], *, colocated: bool) -> list[str]:
    engines = job.of("sglang.launch_server")
    per_node = GPUS // ENGINE_TP
    assert len(engines) == per_node * len(hosts)
    urls = []
    seen = set()
    for opts, cmd in engines:
        host = _value(cmd, "--host")
        assert f"--nodelist={host}" in opts and "--nodes=1" in opts and "--overlap" in opts
        # the engine venv's interpreter (ENGINE_PYTHON), not the trainer's
        assert cmd[:3] == [engine_venv(job.tmp / "cache"), "-m", "sglang.launch_server"]
        port, gpu = int(_value(cmd, "--port")), int(_value(cmd, "--base-gpu-id"))
        j = port - 30000
        assert gpu == j * ENGINE_TP and _value(cmd, "--tp-size") == str(ENGINE_TP)
        assert ("--enable-memory-saver" in cmd) == colocated
        assert _value(cmd, "--mem-fraction-static") == "0.35"
        assert _value(cmd, "--model-path") == "examples/recipes/qwen3-30b-a3b"
        seen.add((host, j))
        urls.append(f"http://{host}:{port}")
    assert seen == {(h, j) for h in hosts for j in range(per_node)}
    return urls


def _check_trainer(job: Job, hosts: list[str], urls: list[str]) -> dict[str, str]:
    ((opts, cmd),) = job.of("megatron_gspo.train")
    assert f"--nodes={len(hosts)}" in opts and "--ntasks-per-node=1" in opts
    assert f"--nodelist={','.join(hosts)}" in opts and "--kill-on-bad-exit=1" in opts
    assert cmd[:3] == [sys.executable, "-m", "megatron_gspo.torchrun"]  # torchrun + checks
    assert _value(cmd, "--nnodes") == str(len(hosts))
    assert _value(cmd, "--nproc-per-node") == str(GPUS)
    assert _value(cmd, "--rdzv-backend") == "c10d"
    assert _value(cmd, "--rdzv-endpoint") == f"{hosts[0]}:29500"
    assert _value(cmd, "--rdzv-id") == "4242"
    assert _value(cmd, "--shutdown-timeout") == "170"  # GRACE_S: time to checkpoint on SIGTERM
    assert cmd[cmd.index("megatron_gspo.train") - 1] == "-m"
    assert _value(cmd, "--config") == str(RECIPE)
    sets = _sets(cmd)
    assert sets["rollout.launch"] == "null"
    assert sorted(sets["rollout.client.engine_urls"].strip("[]").split(",")) == sorted(urls)
    assert sets["rollout.client.engine_tp_sizes"] == "[" + ",".join(["2"] * len(urls)) + "]"
    # rank 0 resolves the weight-update rendezvous address itself: c10d may put it on any node
    assert "weights.master_address" not in sets
    return sets


def _planned_first(job: Job) -> None:
    plan = job.tmp / "logs/plan.json"
    assert plan.exists()
    first = min(p.stat().st_mtime_ns for p in (job.tmp / "d").glob("srun.*"))
    assert plan.stat().st_mtime_ns <= first


@pytest.mark.parametrize("nodes", [1])
def test_colocated_command_lines(nodes: int, tmp_path: Path, counts_cache: Path) -> None:
    job = _sbatch(tmp_path, counts_cache, "colocated.sbatch", nodes)
    assert job.proc.returncode == 0, job.proc.stdout + job.proc.stderr
    hosts = [f"node{i}" for i in range(1, nodes + 1)]
    urls = _check_engines(job, hosts, colocated=True)
    sets = _check_trainer(job, hosts, urls)
    # Each engine rank's GPU (engine i from GPU 2i, TP 2): the trainer feeds it from there.
    assert sets["rollout.client.engine_gpu_ids"] == "[[0,1],[2,3],[4,5],[6,7]]"
    assert not job.of("sglang_router.launch_router")
    _planned_first(job)
    assert "verdict:" in (tmp_path / "logs/plan.txt").read_text()
    _all_gone(job)


@pytest.mark.parametrize("nodes", [2, 4])
def test_disaggregated_command_lines(nodes: int, tmp_path: Path, counts_cache: Path) -> None:
    rollout = nodes // 2
    job = _sbatch(tmp_path, counts_cache, "disaggregated.sbatch", nodes, ROLLOUT_NODES=str(rollout))
    assert job.proc.returncode == 0, job.proc.stdout + job.proc.stderr
    hosts = [f"node{i}" for i in range(1, nodes + 1)]
    trainers, engines = hosts[: nodes - rollout], hosts[nodes - rollout :]
    urls = _check_engines(job, engines, colocated=False)
    sets = _check_trainer(job, trainers, urls)
    assert sets["weights.transport"] == "distributed"
    assert "rollout.client.engine_gpu_ids" not in sets  # engines on GPUs of their own
    ((opts, router),) = job.of("sglang_router.launch_router")
    assert f"--nodelist={engines[0]}" in opts
    # the engine venv has no sglang_router: the trainer's interpreter (the planner checked)
    assert router[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    workers = router[router.index("--worker-urls") + 1 :]
    assert sorted(workers) == sorted(urls)
    assert sets["rollout.client.router_url"] == f"http://{engines[0]}:29999"
    # engines are health-checked, then the router, before the trainer starts
    checked = (tmp_path / "d/curl").read_text().split()
    assert set(checked) == {f"{u}/health_generate" for u in urls} | {
        f"http://{engines[0]}:29999/health"
    }
    _planned_first(job)
    _all_gone(job)


def test_nothing_starts_when_the_planner_refuses(tmp_path: Path, counts_cache: Path) -> None:
    # one node cannot be split into trainer and rollout nodes; an invalid layout: exit 2
    job = _sbatch(tmp_path, counts_cache, "disaggregated.sbatch", 1, ROLLOUT_NODES="1")
    assert job.proc.returncode == 2 and "--rollout-nodes" in job.proc.stdout + job.proc.stderr
    assert job.steps == []
    job = _sbatch(tmp_path, counts_cache, "colocated.sbatch", 1, PLAN_FORCE="0", GPU_MEM_GB="40")
    assert job.proc.returncode == 1 and "DOES NOT FIT" in job.proc.stdout
    assert job.steps == []


def test_nothing_starts_when_the_topology_is_refused(tmp_path: Path, counts_cache: Path) -> None:
    """Colocated on 2 nodes with one sender: CUDA IPC cannot reach the second node's engines,
    and NCCL refuses trainer rank 0 and an engine rank on one GPU; PLAN_FORCE does not
    override either."""
    for transport, key in (("tensor", "CUDA IPC"), ("distributed", "NCCL refuses")):
        job = _sbatch_sets(
            tmp_path / transport,
            counts_cache,
            "colocated.sbatch",
            2,
            f"weights.transport={transport}",
            "weights.senders=one",  # the recipe's owners would feed each node's engines
        )
        out = job.proc.stdout + job.proc.stderr
        assert job.proc.returncode == 2 and key in out, out
        assert "topology: REFUSED" in out and job.steps == []


def test_failing_engine_tears_everything_down(tmp_path: Path, counts_cache: Path) -> None:
    t0 = time.monotonic()
    job = _sbatch(
        tmp_path, counts_cache, "colocated.sbatch", 1, STANDIN_FAIL="engine", STANDIN_TRAIN_S="600"
    )
    assert job.proc.returncode != 0
    assert "exited during training" in job.proc.stderr or "before it was healthy" in (
        job.proc.stderr
    ), job.proc.stderr
    kinds = [(e[0], e[1]) for e in job.events]
    assert ("fail", "engine") in kinds
    terminated = {int(e[2]) for e in job.events if e[0] == "term"}
    failed = {int(e[2]) for e in job.events if e[0] == "fail"}
    assert terminated | failed == job.pids()  # every other step got SIGTERM
    assert time.monotonic() - t0 < 100
    _all_gone(job)


def test_failing_trainer_tears_everything_down(tmp_path: Path, counts_cache: Path) -> None:
    job = _sbatch(tmp_path, counts_cache, "colocated.sbatch", 1, STANDIN_FAIL="trainer")
    assert job.proc.returncode == 1, job.proc.stdout + job.proc.stderr
    terminated = {int(e[2]) for e in job.events if e[0] == "term"}
    assert terminated == job.pids("engine") and len(terminated) == GPUS // ENGINE_TP
    _all_gone(job)


def test_sigterm_checkpoints_then_tears_down(tmp_path: Path, counts_cache: Path) -> None:
    env = _env(tmp_path, counts_cache, STANDIN_TRAIN_S="600")
    cmd = ["sbatch", "--nodes", "1", str(ROOT / "examples/slurm/colocated.sbatch")]
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=tmp_path / "work",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        executable=str(STANDINS / "sbatch"),
    )
    events = tmp_path / "d/events"
    deadline = time.monotonic() + 120
    while "start trainer" not in (events.read_text() if events.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # what Slurm sends the batch shell on preemption
    out, err = proc.communicate(timeout=60)
    job = Job(tmp_path, proc)
    assert proc.returncode == 0, out + err  # the trainer checkpointed and exited cleanly
    order = [(e[0], e[1]) for e in job.events]
    # the trainer is asked first and checkpoints before any engine is stopped
    kinds = [k for k, _ in order]
    assert order.index(("term", "trainer")) < kinds.index("checkpoint")
    assert kinds.index("checkpoint") < order.index(("term", "engine"))
    assert {int(e[2]) for e in job.events if e[0] == "term"} == job.pids()
    _all_gone(job)
