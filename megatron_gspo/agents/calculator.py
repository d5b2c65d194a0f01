"""The agent example: a calculator task written as an ordinary agent on the OpenAI API
(`rollout.agent: megatron_gspo.agents.calculator:solve`), where calling the tool is the only way
to full reward.

    python tools/make_tiny_toy.py --out runs/tiny_toy_agent --ops add --max-len 3 --chat
    bash scripts/main.sh --example agent

The task is the toy "add" task with operands 0-99 (prompt "add 37+45=", answer "82": too many
sums for the tiny model to memorise, so only the tool gets them right). The agent asks the policy
through the `openai` client it is given; a reply that ends with "?" is a **tool call** (an
in-text marker, ReAct style: what the model wrote before it is its own and ignored; the tiny
model cannot write a JSON tool call, and the agent, not the endpoint, decides what its model's
text means). The agent then runs its tool, a calculator that evaluates the prompt, sends the
result back as a `tool` message, and asks again; the model's second reply completes the answer
(best: nothing, the result already is the answer). Reward: `rewards.toy.tool_use_reward` on the
answer, result + second reply after a call, the first reply without one: every call scores at
least 0.5, no answer without a call more than 0.5, only a call whose result the model keeps
as its answer scores 1, and a second reply that calls again answers nothing (0.5: without that
rule the policy that learnt to call also "calls" in its second reply, "82?" earns partial
credit, every group ties and learning stops at ~0.85).

Everything the policy sees is what the endpoint renders with the model's chat template, and
what it trains on is what the engine sampled (token-in, token-out: `docs/agents.md`). The same
task through the `Env` interface is `envs/calculator.py:ToolCalculator`
(`examples/tiny_moe_agent_env_cpu.yaml` on the same model and template): `bash scripts/main.sh
--example agent` runs both and prints both reward curves.
"""

from __future__ import annotations

from typing import Any

from megatron_gspo.rewards.toy import tool_use_reward

__all__ = ["CALL", "calculator", "solve"]

CALL = "?"
"""A reply that ends with this is a call of the calculator (one token: the turn stops there)."""


def calculator(prompt: str) -> str:
    """The tool: "add 37+45=" -> "82" (the agent's own code; it does not read the answer)."""
    a, _, b = prompt.removeprefix("add ").rstrip("=").partition("+")
    return str(int(a) + int(b))


def _reply(client: Any, messages: list[dict[str, Any]]) -> str:
    # stop=[CALL]: the model's turn ends at the marker, as a tool-call tag ends a real one
    resp = client.chat.completions.create(
        model="policy", messages=messages, max_tokens=4, stop=[CALL]
    )
    return resp.choices[0].message.content or ""


def solve(record: dict[str, Any], client: Any) -> float:
    """One episode: ask, run the tool when called, ask again; the reward of the answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": record["prompt"]}]
    first = _reply(client, messages)
    if CALL not in first:
        return tool_use_reward(first, record["answer"], called=False)
    result = calculator(record["prompt"])
    messages += [
        {"role": "assistant", "content": first},
        {"role": "tool", "tool_call_id": "calc", "content": result},
    ]
    reply = _reply(client, messages)
    # a reply that calls again has not used the result: no answer (credit for the call only)
    final = "" if CALL in reply else result + reply
    return tool_use_reward(final, record["answer"], called=True)
