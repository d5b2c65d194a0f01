"""Reward of the built-in toy task (see `megatron_gspo.data.toy`): exact answer 1, partial credit
otherwise, so that even a random tiny model gets a small reward that varies inside a group.

    reward = 1                                      if the response equals the answer
           = 0.5 * position_match + 0.25 * digit_fraction + 0.25 * length_score   otherwise

    position_match = #{i : response[i] == answer[i]} / max(len(answer), len(response))
    digit_fraction = share of response characters that are ASCII digits
    length_score   = min(len(response), len(answer)) / max(len(response), len(answer))

A non-exact response scores strictly below 1: equal length and every position matching would
make it exact. The length term decays smoothly (not to 0 at twice the length), so a random
model, whose responses run to max_new_tokens, still sees a gradient towards stopping at the
right length. The response is cut at the first "</s>" (in case the engine decodes special
tokens) and stripped of surrounding whitespace.

A uniformly random policy over the 128 toy ids with max_new_tokens=8 scores about 0.12 on
average (group std about 0.03) on answers of 2-4 digits.
"""

from __future__ import annotations

__all__ = ["tool_use_reward", "toy_reward"]

_DIGITS = frozenset("0123456789")
W_MATCH, W_DIGITS, W_LENGTH = 0.5, 0.25, 0.25


def toy_reward(prompt: str, response: str, answer: object) -> float:
    """Score one toy-task response against its answer (a digit string)."""
    target = str(answer)
    text = str(response).split("</s>", 1)[0].strip()
    if text == target:
        return 1.0
    if not text or not target:
        return 0.0
    match = sum(a == b for a, b in zip(text, target)) / max(len(target), len(text))
    digits = sum(c in _DIGITS for c in text) / len(text)
    length = min(len(text), len(target)) / max(len(text), len(target))
    return W_MATCH * match + W_DIGITS * digits + W_LENGTH * length


def tool_use_reward(answer_text: str, answer: object, *, called: bool) -> float:
    """The calculator examples' reward, where calling the tool is the only way to full reward
    (`agents/calculator.py`, `envs/calculator.py:ToolCalculator`):

        called:      0.5 + 0.5 * toy_reward(answer_text)   (1 only when the answer is exact)
        not called:  0.5 * toy_reward(answer_text)         (at most 0.5, exact or not)

    so every episode that calls scores at least as much as any that does not (credit for calling
    the tool), and among those that call, only one that uses the result as its answer scores 1.
    An episode that calls but gives no answer (the callers pass "" for a reply that calls again
    instead of answering) scores 0.5.
    """
    score = toy_reward("", answer_text, answer)
    return 0.5 + 0.5 * score if called else 0.5 * score
