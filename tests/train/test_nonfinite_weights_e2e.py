"""Non-finite weights never reach the engines or a checkpoint (issue 40, first defect).

Two launches of the tiny toy under `python -m megatron_gspo.torchrun` (embedded engine, a
checkpoint every step), run side by side:

* A (2 ranks, EP=2): after step 2's update one element of rank 1's first parameter becomes inf
  (`MGSPO_FAULT=inf-weight@update:2:1`, as an overflowing update makes it). The job stops with
  exit 3 and one line naming the parameter, its rank and the cause, before the push and the
  save of step 2: `latest` stays step 1, no step 2 checkpoint, no step 2 metrics (was: pushed,
  the engine answered HTTP 500 and the job stopped with exit 4 blaming the engine, the step's
  non-finite checkpoint written).
* B (1 rank): `optim.lr=1e38`, a finite learning rate whose Adam step size does not fit in
  float32: exit 3 and one line naming optim.lr (was: a torch `RuntimeError` traceback, exit 1).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_gspo.dist import free_port
from tools import make_tiny_toy

pytestmark = [pytest.mark.multirank, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _launch(tmp: Path, name: str, ranks: int, *sets: str, fault: str = "") -> dict[str, Any]:
    base = {
        "model.hf_path": f"{tmp}/toy/model",
        "data.train_path": f"{tmp}/toy/toy.jsonl",
        "logging.dir": f"{tmp}/{name}/run",
        "checkpoint.dir": f"{tmp}/{name}/ckpt",
        "checkpoint.save_every": 1,
        "parallel.ep": ranks,
        "rl.prompts_per_rollout": 4,
        "rl.group_size": 4,
        "train.steps": 3,
        "logging.tensorboard": "false",
        "logging.progress": "false",
    }
    cmd = [sys.executable, "-m", "megatron_gspo.torchrun", "--nproc_per_node", str(ranks)]
    cmd += ["--master_port", str(free_port()), "-m", "megatron_gspo.train"]
    cmd += ["--config", str(ROOT / "examples/tiny_moe_cpu.yaml")]
    for key, value in base.items():
        cmd += ["--set", f"{key}={value}"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    env["MGSPO_FAULT"] = fault
    log = tmp / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=out, timeout=600)
    return {"rc": proc.returncode, "out": log.read_text(), "dir": tmp / name}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("nonfinite")
    make_tiny_toy.main(["--out", str(tmp / "toy"), "--n", "64"])
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        lane_b = pool.submit(_launch, tmp, "b", 1, "optim.lr=1e38")
        a = _launch(tmp, "a", 2, fault="inf-weight@update:2:1")
        b = lane_b.result()
    return {"a": a, "b": b}


def _lines(out: str, prefix: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(prefix)]


def test_non_finite_weights_stop_before_the_push_and_the_save(runs) -> None:
    a = runs["a"]
    out = a["out"]
    assert a["rc"] == 3, out[-3000:]
    stopped = _lines(out, "[train] stopped: ")
    assert len(stopped) == 1, out[-3000:]
    assert "the weights are not finite after the update of step 2 (" in stopped[0]
    assert "(rank 1)" in stopped[0] and "Nothing of it was pushed" in stopped[0], stopped
    assert "no rollout engine left" not in out and "HTTP 500" not in out
    assert "Traceback" not in out
    ckpt = a["dir"] / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "step_000001"
    assert not (ckpt / "step_000002").exists() and not (ckpt / "step_000002.tmp").exists()
    lines = (a["dir"] / "run/metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x)["step"] for x in lines]
    assert steps == [1], steps


def test_an_update_past_float32_is_one_line(runs) -> None:
    b = runs["b"]
    out = b["out"]
    assert b["rc"] == 3, out[-3000:]
    errors = _lines(out, "error: UpdateOverflow: ")
    assert len(errors) == 1 and "lower optim.lr" in errors[0], out[-3000:]
    assert "Traceback" not in out
    assert not (b["dir"] / "ckpt" / "latest").exists()
