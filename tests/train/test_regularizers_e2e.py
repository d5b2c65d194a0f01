"""The KL loss term (reference model offloaded between uses), the entropy bonus, token-mean
aggregation, DAPO overlong shaping and the engine/trainer mismatch masks end to end through
`megatron_gspo.train` (1 CPU rank, embedded engine, 2 steps of the tiny toy).

Checks: the new metrics appear every step and are finite; the KL against the reference model is
0 on the first mini-batch of step 1 (the reference is a copy of the initial policy) and grows
once the policy has moved; the overlong penalty is applied (the toy's 4-token cap with a
3-token buffer penalises most responses); the mismatch masks' fractions are logged every step,
and with pi_old from the engine and 4 mini-batches the extra trainer forward ran and was timed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.dist import free_port
from tests.ahead import Ahead, ahead, make_toy

pytestmark = [pytest.mark.multirank, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}

SETS = {
    "train.steps": 2,
    "parallel.ep": 1,
    "rl.prompts_per_rollout": 4,
    "rl.group_size": 4,
    "logging.tensorboard": "false",
    "logging.progress": "false",
    "checkpoint.save_every": 0,
    "loss.kl_coef": 0.1,
    "loss.kl_estimator": "k3",
    "loss.ref_offload": "true",
    "loss.entropy_coef": 0.01,
    "loss.aggregation": "token_mean",
    "reward.overlong_buffer": 3,
    # NeMo-RL's MoE band for the sequence mask; a token band far tighter than the policy's
    # movement between mini-batches (~0.1 per token here) but far wider than the fp32 embedded
    # engine's mismatch (< 1e-6 per token).
    "loss.seq_mismatch_mask": "[0.999,1.002]",
    "loss.token_mismatch_mask": "[0.9999,1.0001]",
}


@ahead("regularizers")
def _launch(tmp: Path) -> list[dict]:
    """The run (started ahead: tests/ahead.py); its metrics rows."""
    make_toy(tmp / "toy", "--n", "32")
    sets = {
        **SETS,
        "model.hf_path": f"{tmp}/toy/model",
        "data.train_path": f"{tmp}/toy/toy.jsonl",
        "logging.dir": f"{tmp}/run",
        "checkpoint.dir": f"{tmp}/ckpt",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1"]
    cmd += ["--master_port", str(free_port()), "-m", "megatron_gspo.train"]
    cmd += ["--config", str(ROOT / "examples/tiny_moe_cpu.yaml")]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = (tmp / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def metrics(launches_ahead: Ahead) -> list[dict]:
    return launches_ahead.result("regularizers")


def test_new_metrics_are_logged_and_finite(metrics) -> None:
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        for k in (
            "kl/mean",
            "kl/loss",
            "first_mb/kl/mean",
            "entropy/loss",
            "policy/entropy",
            "reward/overlong_penalty",
            "reward/overlong_frac",
            "loss/seq_mismatch_masked",
            "loss/token_mismatch_masked",
            "time/mismatch_logp_s",
            "loss",
            "grad_norm",
        ):
            assert math.isfinite(m[k]), (m["step"], k)
        assert m["train/skipped_updates"] == 0
        assert m["entropy/loss"] == pytest.approx(m["policy/entropy"], rel=1e-4)  # token mean
        assert m["reward/overlong_penalty"] <= 0 and 0 <= m["reward/overlong_frac"] <= 1
        # The fp32 embedded engine agrees with the trainer to < 1e-6 per token, so the trainer's
        # log-probs at the rollout weights leave nothing out of these bands; the current
        # policy's on mini-batches 2..4 (no extra forward) or misaligned ones would leave most
        # tokens out (checked once: 0.75 of the sequences).
        assert m["loss/seq_mismatch_masked"] == 0 and m["loss/token_mismatch_masked"] == 0
        assert m["time/mismatch_logp_s"] > 0


def test_kl_is_zero_before_the_first_update_and_grows_after(metrics) -> None:
    first, second = metrics
    assert first["first_mb/kl/mean"] < 1e-9  # k3 >= 0: policy == reference up to rounding
    assert first["kl/mean"] > first["first_mb/kl/mean"]  # later mini-batches: it moved
    assert second["first_mb/kl/mean"] > 1e-6  # the reference stays the initial policy


def test_overlong_shaping_is_applied(metrics) -> None:
    # max_new_tokens 4, buffer 3: every response longer than 1 token is penalised
    assert any(m["reward/overlong_frac"] > 0 for m in metrics)
    assert any(m["reward/overlong_penalty"] < 0 for m in metrics)
