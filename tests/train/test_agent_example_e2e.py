"""The agent example learns to use its tool: `examples/tiny_moe_agent_cpu.yaml` (the calculator
agent of `megatron_gspo/agents/calculator.py` on the real `openai` client, through the job's
token-exact endpoint, 2 CPU ranks, embedded engine) trains STEPS steps; the mean reward of its
last WINDOW steps must exceed that of its first WINDOW steps (same run) by MARGIN, and in its
last WINDOW steps at least CALLS of the episodes must call the calculator (`env/tool_call_rate`).

Both bounds are well inside what the example reaches: in the two `bash scripts/main.sh
--example agent` runs of docs/agents.md the agent's reward went from 0.147 and 0.143 (steps 1-5)
to 0.736 and 0.770 (steps 26-30) and its tool-call rate from 0.04 and 0.03 to 1.00 and 0.99 (an
earlier run on the same task, without the rule for a second call, reached a call rate of 1.0 by
step 16 as well).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ahead import Ahead, ahead, make_toy
from tests.train.example_run import train_example

pytestmark = [pytest.mark.slow, pytest.mark.multirank]
STEPS, WINDOW, MARGIN, CALLS = 30, 5, 0.05, 0.5


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
    calls = [r["env/tool_call_rate"] for r in rows]
    assert sum(calls[-WINDOW:]) / WINDOW >= CALLS, calls
