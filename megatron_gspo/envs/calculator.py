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
from megatron_gspo.rewards.toy import toy_reward

__all__ = ["CALL", "Calculator"]

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
