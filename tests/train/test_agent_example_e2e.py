"""The agent example learns: `examples/tiny_moe_agent_cpu.yaml` (the calculator agent of
`megatron_gspo/agents/calculator.py` on the real `openai` client, through the job's token-exact
endpoint, 2 CPU ranks, embedded engine) trains STEPS steps; the mean reward of its last
WINDOW steps must exceed that of its first WINDOW steps (same run) by MARGIN.

The margin is well inside what the example reaches: `bash scripts/main.sh --example agent`
(docs/agents.md) rose from 0.233 (steps 1-5) to 0.488 (steps 26-30) in the run measured there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ahead import Ahead, ahead, make_toy
from tests.train.example_run import train_example

pytestmark = [pytest.mark.slow, pytest.mark.multirank]
STEPS, WINDOW, MARGIN = 30, 5, 0.05


@ahead("agent_example")
def _launch(tmp_path: Path) -> list[dict]:
    """The run (started ahead: tests/ahead.py); its metrics rows."""
    make_toy(tmp_path / "toy", "--ops", "add", "--max-len", "3", "--chat")
    return train_example(tmp_path, "tiny_moe_agent_cpu", steps=STEPS, timeout=1800)


def test_agent_example_reward_rises(launches_ahead: Ahead) -> None:
    rows = launches_ahead.result("agent_example")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:  # every episode ran through the endpoint and none failed
        assert r["agent/episodes"] == 64 and r["agent/failed"] == 0
        assert r["agent/unmatched"] == 0 and r["agent/refused"] == 0
    rewards = [r["reward/mean"] for r in rows]
    first = sum(rewards[:WINDOW]) / WINDOW
    last = sum(rewards[-WINDOW:]) / WINDOW
    assert last > first + MARGIN, rewards
