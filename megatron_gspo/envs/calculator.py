"""A calculator tool for the toy task (`megatron_gspo.data.toy`), the CPU multi-turn example.

    rollout.env: megatron_gspo.envs.calculator:Calculator      rollout.turn_stop: ["?"]

Protocol, with the character-level toy tokenizer (prompt "add 3+5=", answer "8"):

* The model's first turn is a **tool call** when it starts with "?" (`rollout.turn_stop: ["?"]`
  ends the turn right there). The calculator evaluates the prompt's task itself (it parses
  "add 3+5", it does not read the record's answer) and answers with the result as the
  observation, "8": environment tokens, in the context and masked from the loss. The result is
  the start of the answer; the model's next turn completes it, ideally with EOS at once.
  Episode reward: `toy_reward(result + second turn, answer)`.
* Any other first turn is the answer itself: reward `toy_reward(first turn, answer)`.

`toy_reward` gives partial credit, so a random tiny model already sees a gradient. Calling the
tool is one early token decision ("?" first, 1 of 128 ids at random initialisation) followed by
one more (EOS right after the observation), which is what a tiny model learns in minutes on CPU;
doing "add" in its head is out of its reach, so the reward rises only by using the tool.
"""

from __future__ import annotations

from typing import Any

from megatron_gspo.data.toy import TOY_OPS, toy_answer
from megatron_gspo.rewards.toy import tool_use_reward, toy_reward

__all__ = ["CALL", "Calculator", "ToolCalculator"]

CALL = "?"
_OP_NAMES = {short: op for op, short in TOY_OPS.items()}


class Calculator:
    """One episode of the calculator tool (see the module docstring)."""

    def reset(self, record: dict[str, Any]) -> None:
        self.answer = str(record["answer"])
        short, _, operand = str(record["prompt"]).rstrip("=").partition(" ")
        self.result = toy_answer(_OP_NAMES[short], operand)
        self.called = False
        return None

    def step(self, model_text: str) -> tuple[str | None, float | None, bool]:
        if not self.called and model_text.startswith(CALL):
            self.called = True
            return self.result, None, False
        final = self.result + model_text if self.called else model_text
        return None, toy_reward("", final, self.answer), True


class ToolCalculator(Calculator):
    """The agent example's task as an `Env` (`examples/tiny_moe_agent_env_cpu.yaml`), the same
    rules as the agent `megatron_gspo.agents.calculator:solve`: a first turn that **ends** with
    "?" is a call (what the model wrote before the marker is its own, ignored: 1 - (127/128)^3
    of random 3-token turns call, not 1/128), and the reward is `tool_use_reward`: calling is
    the only way to full reward (every call scores at least 0.5, no answer without one more
    than 0.5), and a call scores 1 only when the model then uses the result as its answer
    (ends its turn at once); a second reply that calls again answers nothing (0.5)."""

    def step(self, model_text: str) -> tuple[str | None, float | None, bool]:
        if not self.called and CALL in model_text:  # turn_stop "?": the marker ends the turn
            self.called = True
            return self.result, None, False
        if not self.called:
            return None, tool_use_reward(model_text, self.answer, called=False), True
        # a reply that calls again has not used the result: no answer (credit for the call only)
        final = "" if CALL in model_text else self.result + model_text
        return None, tool_use_reward(final, self.answer, called=True), True
