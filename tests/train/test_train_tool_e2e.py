"""The multi-turn tool example end to end: `examples/tiny_moe_tool_cpu.yaml` (calculator env,
2 CPU ranks, embedded engine) trains 3 steps, with a calculator that answers every first turn.

Checks: the run completes; the multi-turn metrics are logged; the env tokens are out of the loss
(the trainer's per-sequence loss-token count equals the model tokens, and its log-probs on the
loss tokens match the engine's, which they could not on env tokens whose pi_old is 0.0).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.ahead import Ahead, ahead, make_toy
from tests.train.example_run import train_example

pytestmark = pytest.mark.multirank


@ahead("tool_example")
def _launch(tmp_path: Path) -> list[dict]:
    """The run (started ahead: tests/ahead.py); its metrics rows."""
    make_toy(tmp_path / "toy", "--n", "64", "--ops", "add")
    sets = {
        "rl.prompts_per_rollout": 4,
        "rl.group_size": 4,
        # every episode gets env tokens (the random model calls "?" once in 128 first turns)
        "rollout.env": "tests.train.tool_env_fixture:AlwaysCalculator",
    }
    return train_example(tmp_path, "tiny_moe_tool_cpu", steps=3, timeout=600, sets=sets)


def test_tool_example_trains(launches_ahead: Ahead) -> None:
    rows = launches_ahead.result("tool_example")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("env/turns_mean", "env/tool_call_rate", "env/env_token_frac", "env/failures"):
            assert math.isfinite(r[key]), key
        assert r["env/tool_call_rate"] == 1.0 and r["env/env_token_frac"] > 0
        assert 1.0 <= r["env/turns_mean"] <= 2.0 and r["env/failures"] == 0.0
        assert r["env/reward_from_env_frac"] == 1.0  # the calculator scores every episode
        # loss tokens per sequence = model tokens only (env tokens masked)
        model_tokens = r["response/length_mean"] * (1.0 - r["env/env_token_frac"])
        assert r["policy/response_length"] == pytest.approx(model_tokens, rel=1e-6)
    # first step, before any update: trainer and engine log-probs agree on every loss token
    assert rows[0]["mismatch/abs_logp_diff"] < 1e-3
