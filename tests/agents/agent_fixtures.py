"""Agents for the runner tests, imported only in sandbox workers (`rollout.agent`)."""

from __future__ import annotations

import json
import os

from tests.agents.fixtures import TOOLS


def tool_agent(record: dict, client) -> float:
    """An ordinary OpenAI tool-calling loop; reward 1 for the right final answer."""
    messages: list[dict] = [{"role": "user", "content": record["prompt"]}]
    for _ in range(3):
        resp = client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, temperature=0.0, max_tokens=128
        )
        msg = resp.choices[0].message
        messages.append(msg.model_dump())
        if not msg.tool_calls:
            return 1.0 if (msg.content or "").strip() == record["answer"] else 0.0
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}
            )
    return 0.0


def pid_agent(record: dict, client) -> None:
    """One call, reward left to reward.kind; writes its pid where the test can read it."""
    client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    with open(record["meta"]["pid_file"], "w") as f:
        f.write(str(os.getpid()))


def failing_agent(record: dict, client) -> float:
    raise RuntimeError("the agent broke")


def idle_agent(record: dict, client) -> float:
    return 1.0
