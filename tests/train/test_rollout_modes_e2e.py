"""The rollout modes end to end through `megatron_gspo.train` (1 CPU rank, embedded engine):
over-sampling + dynamic sampling + partial rollouts (synchronous), and asynchronous mode with a
checkpoint taken while the next batch is being generated, then resumed.

Checks: every step trains exactly prompts x group_size sequences; the fill counters add up
(launched + continued = kept + dropped + aborted + carried); trained tokens are never staler
than rollout.max_staleness; asynchronous mode trains on 1-version-old tokens (the overlap);
its checkpoint holds the prompts of the batch generated ahead, and the resume completes.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_gspo.testing.jobs import torchrun_command
from tools import make_tiny_toy

pytestmark = pytest.mark.multirank
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
PROMPTS, GROUP = 4, 4


def _train(tmp: Path, name: str, ckpt: str, steps: int, *sets: str) -> list[dict]:
    base = {
        "model.hf_path": f"{tmp}/toy/model",
        "data.train_path": f"{tmp}/toy/toy.jsonl",
        "logging.dir": f"{tmp}/{name}",
        "checkpoint.dir": f"{tmp}/{ckpt}",
        "train.steps": steps,
        "parallel.ep": 1,
        "rl.prompts_per_rollout": PROMPTS,
        "rl.group_size": GROUP,
        "logging.tensorboard": "false",
        "logging.progress": "false",
    }
    cmd = torchrun_command(ROOT / "examples/tiny_moe_cpu.yaml", nproc=1)
    for key, value in base.items():
        cmd += ["--set", f"{key}={value}"]
    for s in sets:
        cmd += ["--set", s] if "=" in s else [s]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = (tmp / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("modes")
    make_tiny_toy.main(["--out", str(tmp / "toy"), "--n", "64"])
    out: dict = {"tmp": tmp}
    async_sets = ("rollout.async_rollout=true", "rollout.partial_tokens=2")

    def asynchronous() -> None:
        out["async"] = _train(tmp, "async", "ckpt_async", 3, *async_sets, "checkpoint.save_every=2")
        out["state"] = torch.load(tmp / "ckpt_async/step_000002/rollout.pt", weights_only=True)
        out["resumed"] = _train(tmp, "async", "ckpt_async", 4, *async_sets, "--resume")

    over = (
        "rollout.oversample=2.0",
        "rollout.drop_equal_reward_groups=true",
        "rollout.partial_tokens=2",
        "checkpoint.save_every=0",
    )
    # Two lanes at once: one 1-rank launch leaves ~40% of the 2 cores idle (measured).
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        lanes = [pool.submit(asynchronous), pool.submit(_train, tmp, "over", "ckpt_over", 3, *over)]
        out["over"] = lanes[1].result()
        lanes[0].result()
    return out


def _common(metrics: list[dict], max_staleness: int) -> None:
    for m in metrics:
        assert m["rollout/num_samples"] == PROMPTS * GROUP
        assert m["rollout/groups_kept"] == PROMPTS
        c = {k: m[f"rollout/groups_{k}"] for k in ("launched", "continued", "kept")}
        out = sum(m[f"rollout/groups_{k}"] for k in ("kept", "dropped", "aborted", "carried"))
        assert c["launched"] + c["continued"] == out
        assert m["rollout/staleness_max"] <= max_staleness
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])


def test_oversampled_dynamic_partial_run(runs):
    metrics = runs["over"]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    _common(metrics, 1)
    # twice the groups ran: the surplus was aborted, carried or dropped every step
    for m in metrics:
        assert m["rollout/groups_launched"] + m["rollout/groups_continued"] >= 2 * PROMPTS
        assert m["reward/zero_variance_groups"] == 0.0  # equal-reward groups never trained


def test_async_run_trains_one_version_behind_and_resumes(runs):
    metrics, resumed = runs["async"], runs["resumed"]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    _common(metrics + resumed, 1)
    assert metrics[0]["rollout/staleness_max"] == 0  # the first batch waits for the weights
    assert all(m["rollout/staleness_max"] == 1 for m in metrics[1:])  # generated ahead
    assert all("time/rollout_wait_s" in m and "rollout/overlap_frac" in m for m in metrics)
    # the checkpoint at step 2 holds the prompts of step 3's batch, generated ahead: they are
    # trained after the resume (not lost), and the resumed run continues at step 3
    front = runs["state"]["scheduler"]["queue"]["front"]
    assert len(front) >= PROMPTS
    assert resumed[-1]["step"] == 4
