"""A two-"node" job on one machine equals the single-node job.

Two torchrun agents (`--nnodes 2 --nproc-per-node 1`, c10d rendezvous on 127.0.0.1, gloo), the
command line of examples/torchrun/two_node.sh, train the tiny MoE (EP=2 across the "nodes")
for a few GSPO steps; one torchrun with 2 ranks trains the same config. Every logged metric
except wall-clock times must be identical: losses, rewards, gradient norms, clip fractions,
routing flips, weight versions.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.dist import free_port
from megatron_gspo.run.metrics_log import read_metrics
from tools import make_tiny_toy

pytestmark = pytest.mark.multirank
ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
# Wall-clock measurements: the only metrics allowed to differ between the two runs.
TIMING = ("time", "time/", "perf/", "rollout/wall_s", "reward/time_s", "weights/gb_per_s")


def _train_args(tmp: Path, name: str) -> list[str]:
    sets = {
        "model.hf_path": f"{tmp}/toy/model",
        "data.train_path": f"{tmp}/toy/toy.jsonl",
        "logging.dir": f"{tmp}/{name}",
        "train.steps": STEPS,
        "rl.prompts_per_rollout": 4,
        "rl.group_size": 4,
        "logging.tensorboard": "false",
        "logging.progress": "false",
        "checkpoint.dir": "null",
        "checkpoint.save_every": 0,
        "weights.verify_every": 1,  # every push is checked below
    }
    args = ["-m", "megatron_gspo.train", "--config", str(ROOT / "examples/tiny_moe_cpu.yaml")]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    return args


def _env(tmp: Path) -> dict[str, str]:
    # LOGLEVEL=INFO: torchrun's agents log their rendezvous (group rank / world size).
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "LOGLEVEL": "INFO",
    }


def differences(a: dict[int, dict], b: dict[int, dict]) -> list[str]:
    """Every (step, metric) on which two runs differ, timings excepted; [] when equal."""
    out = []
    if sorted(a) != sorted(b):
        return [f"steps {sorted(a)} != {sorted(b)}"]
    for step in a:
        keys = {k for k in a[step].keys() | b[step].keys() if not k.startswith(TIMING)}
        for k in sorted(keys):
            x, y = a[step].get(k), b[step].get(k)
            same = x == y or (x is not None and y is not None and math.isnan(x) and math.isnan(y))
            if not same:
                out.append(f"step {step} {k}: {x} != {y}")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("nodes")
    make_tiny_toy.main(["--out", str(tmp / "toy"), "--n", "64"])
    env = _env(tmp)
    run = [sys.executable, "-m", "torch.distributed.run"]
    # The single-node run goes at the same time as the two agents: in turn, the two runs left
    # a quarter of the 2 cores idle (the agents' rendezvous and start-up).
    one_log = open(tmp / "one.log", "w")  # noqa: SIM115 (closed below)
    one = subprocess.Popen(
        [
            *run,
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            *_train_args(tmp, "one"),
        ],
        cwd=ROOT,
        env=env,
        stdout=one_log,
        stderr=subprocess.STDOUT,
    )
    port = free_port()
    agents = [
        subprocess.Popen(
            [
                *run,
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "two-node-test",
                "--local-addr",
                "127.0.0.1",
                *_train_args(tmp, "two"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    logs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=600)
            logs.append(out)
            assert agent.returncode == 0, out[-4000:]
        one.wait(timeout=600)
    finally:
        for p in (*agents, one):
            if p.poll() is None:
                p.kill()
                p.wait()
        one_log.close()
    assert one.returncode == 0, (tmp / "one.log").read_text()[-4000:]
    return {
        "one": read_metrics(tmp / "one/metrics.jsonl"),
        "two": read_metrics(tmp / "two/metrics.jsonl"),
        "logs": logs,
    }


def test_two_agents_formed_one_job(runs: dict) -> None:
    """Each agent joined the same c10d rendezvous as one of two groups of one rank."""
    ranks = []
    for log in runs["logs"]:
        assert "group_world_size=2" in log, log[-3000:]
        ranks.append(log.split("group_rank=")[1][0])
    assert sorted(ranks) == ["0", "1"]


def test_two_node_run_equals_single_node_run(runs: dict) -> None:
    one, two = runs["one"], runs["two"]
    assert sorted(one) == list(range(1, STEPS + 1))
    for m in one.values():  # the runs trained (finite, non-trivial) before being compared
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["weights/verified"] == 1
    assert differences(one, two) == []


def test_the_comparison_catches_a_difference(runs: dict) -> None:
    """The equality above can fail: a one-ulp change of one loss, or a missing step, shows."""
    one = runs["one"]
    changed = {s: dict(m) for s, m in one.items()}
    changed[STEPS]["loss"] = math.nextafter(changed[STEPS]["loss"], math.inf)
    assert differences(one, changed) == [
        f"step {STEPS} loss: {one[STEPS]['loss']} != {changed[STEPS]['loss']}"
    ]
    assert differences(one, {1: one[1]}) != []
    timing_only = {s: dict(m, **{"time/step_s": -1.0}) for s, m in one.items()}
    assert differences(one, timing_only) == []
