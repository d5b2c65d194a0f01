"""The GSPO trainer end to end on 2 CPU ranks (EP=2) with the embedded engine.

Run A trains 4 steps straight. Run B trains 2 steps and stops (checkpoint at step 2); run C
resumes it to step 4. Checks: every step trains on prompts x group_size sequences with finite
metrics, the engines serve the pushed weights (per-tensor checksums of sent vs engine-held
tensors) at the right version, and the resumed run reproduces the uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import make_tiny_toy

pytestmark = pytest.mark.multirank
ROOT = Path(__file__).resolve().parents[2]
PROMPTS, GROUP = 4, 4


def _train(tmp: Path, name: str, ckpt: str, steps: int, *extra: str) -> list[dict]:
    run = tmp / name
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(29400 + hash(name) % 500),
        "-m",
        "megatron_gspo.train",
        "--config",
        str(ROOT / "examples/tiny_moe_cpu.yaml"),
        "--set",
        f"model.hf_path={tmp}/toy/model",
        "--set",
        f"data.train_path={tmp}/toy/toy.jsonl",
        "--set",
        f"logging.dir={run}",
        "--set",
        f"checkpoint.dir={tmp}/{ckpt}",
        "--set",
        f"train.steps={steps}",
        "--set",
        "checkpoint.save_every=0",
        "--set",
        f"gspo.prompts_per_rollout={PROMPTS}",
        "--set",
        f"gspo.group_size={GROUP}",
        "--set",
        "logging.tensorboard=false",
        "--set",
        "logging.progress=false",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("e2e")
    make_tiny_toy.main(["--out", str(tmp / "toy"), "--n", "64"])
    return {
        "a": _train(tmp, "a", "ckpt_a", 4),
        "b": _train(tmp, "b", "ckpt_b", 2),
        "c": _train(tmp, "c", "ckpt_b", 4, "--resume"),
    }


def test_every_step_trains_full_groups_with_finite_metrics(runs) -> None:
    a = runs["a"]
    assert [m["step"] for m in a] == [1, 2, 3, 4]
    for m in a:
        assert m["rollout/num_samples"] == PROMPTS * GROUP
        assert m["rollout/num_rejected"] == 0
        for k in (
            "loss",
            "grad_norm",
            "reward/mean",
            "policy/clip_frac",
            "policy/entropy",
            "mismatch/abs_logp_diff",
            "time/rollout_s",
            "time/train_s",
            "time/sync_s",
        ):
            assert math.isfinite(m[k]), (m["step"], k)
        # before its first update the trainer IS the engine's policy: only numerical mismatch
        assert m["first_mb/mismatch/abs_logp_diff"] < 1e-4


def test_engines_serve_the_pushed_weights(runs) -> None:
    for m in runs["a"]:
        assert m["weights/verified"] == 1.0  # per-tensor checksums: sent == engine-held
        assert m["weights/version"] == m["step"] + 1  # version 1 is the initial push


def test_resume_continues_exactly(runs) -> None:
    a, b, c = runs["a"], runs["b"], runs["c"]
    assert [m["step"] for m in b] == [1, 2] and [m["step"] for m in c] == [3, 4]
    for got, want in zip(b + c, a, strict=True):
        for k in ("loss", "reward/mean", "grad_norm", "policy/clip_frac"):
            assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), (got["step"], k)
