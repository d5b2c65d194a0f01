"""A training run survives a dead engine (issue 15), on 1 CPU rank with 2 launched embedded
engines and planted faults (tests/train/engine_fault_train.py): engine 0 SIGKILLed
mid-rollout at step 2 is dropped, restarted and re-admitted with the current weights; when
both die at step 5 (restarts used up), the job writes a checkpoint and stops saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.dist import free_port
from tests.ahead import Ahead, ahead, make_toy

pytestmark = pytest.mark.multirank
ROOT = Path(__file__).resolve().parents[2]
PROMPTS, GROUP = 4, 4


@ahead("engine_faults")
def _launch(tmp: Path) -> dict:
    """The run (started ahead: tests/ahead.py): its process, metrics, syncs and directory."""
    make_toy(tmp / "toy", "--n", "64")
    sets = {
        "model.hf_path": f"{tmp}/toy/model",
        "data.train_path": f"{tmp}/toy/toy.jsonl",
        "logging.dir": f"{tmp}/run",
        "checkpoint.dir": f"{tmp}/ckpt",
        "checkpoint.save_every": 0,
        "train.steps": 6,
        "parallel.ep": 1,
        "rl.prompts_per_rollout": PROMPTS,
        "rl.group_size": GROUP,
        "rl.mini_batches_per_rollout": 1,
        "logging.tensorboard": "false",
        "logging.progress": "false",
        "rollout.launch.num_engines": 2,
        "rollout.launch.max_restarts": 1,
        "rollout.client.max_batch_per_request": 2,
        "rollout.client.dead_after_failures": 1,
        "rollout.client.engine_cooldown_s": 0.2,
        "rollout.client.backoff_s": 0.05,
        "rollout.client.control_timeout_s": 30,
        "weights.verify_every": 1,  # every step's push is checked as verified below
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
        "--master_port", str(free_port()), "-m", "tests.train.engine_fault_train",
        "--config", str(ROOT / "examples/tiny_moe_cpu.yaml"),
    ]  # fmt: skip
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    versions = tmp / "versions.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTHONWARNINGS": "ignore",
        "MGSPO_TEST_VERSIONS": str(versions),
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    (tmp / "stderr.txt").write_text(proc.stderr)  # kept for a look after a failure
    assert versions.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    metrics = [json.loads(ln) for ln in (tmp / "run/metrics.jsonl").read_text().splitlines()]
    synced = [json.loads(ln) for ln in versions.read_text().splitlines()]
    return {"proc": proc, "metrics": metrics, "synced": synced, "tmp": tmp}


@pytest.fixture(scope="module")
def run(launches_ahead: Ahead) -> dict:
    return launches_ahead.result("engine_faults")


def test_run_survives_an_engine_killed_mid_rollout(run) -> None:
    m, proc = run["metrics"], run["proc"]
    assert [r["step"] for r in m] == [1, 2, 3, 4], proc.stderr[-4000:]
    for r in m:  # every step trains on full groups: nothing lost, nothing twice
        assert r["rollout/num_samples"] == PROMPTS * GROUP and r["rollout/num_rejected"] == 0
    assert m[1]["rollout/num_retries"] >= 1 and m[1]["rollout/num_resent_samples"] >= 1
    assert [r["rollout/engines_alive"] for r in m] == [2, 1, 1, 2]
    assert [r["rollout/engine_restarts"] for r in m] == [0, 1, 1, 1]
    assert all(r["weights/verified"] == 1.0 for r in m)
    err = proc.stderr
    assert "[rollout] engine http://127.0.0.1:" in err and " dropped: " in err
    assert "restarting (1 of rollout.launch.max_restarts=1)" in err


def test_restarted_engine_gets_the_current_weights(run) -> None:
    """Sync k (k=1: the initial push) reaches both engines, except syncs 3 (after step 2,
    engine 0 dead) and 4 (after step 3: the restarted engine joins it and reports it)."""
    synced = run["synced"]
    assert [s["version"] for s in synced] == [1, 2, 3, 4, 5]
    for s in synced:
        served = set(s["engines"].values())
        assert served == {str(s["version"])}, s
    assert [len(s["engines"]) for s in synced] == [2, 2, 1, 2, 2]


def test_no_engine_left_checkpoints_and_stops_with_a_clear_message(run) -> None:
    proc, tmp = run["proc"], run["tmp"]
    assert proc.returncode != 0
    assert "[train] stopped: no rollout engine left (2 dropped: " in proc.stderr  # one line
    assert "exitcode  : 4" in proc.stderr or proc.returncode == 4  # torchrun reports the rank's
    assert "checkpoint written at step 4" in proc.stderr
    assert (tmp / "ckpt/latest").read_text().strip() == "step_000004"
    assert "not restarted: rollout.launch.max_restarts=1 used up" in proc.stderr
