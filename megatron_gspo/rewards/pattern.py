"""Reward of the repeat-a-pattern task (`megatron_gspo.data.pattern`): graded per position.

    reward = W_MATCH * match + W_DIGITS * digits + W_LENGTH * length       (in [0, 1])

    match  = #{i < min(|y|, L) : y[i] == answer[i]} / max(|y|, L)
    digits = share of the response's characters that are ASCII digits (0 for an empty one)
    length = min(|y|, L) / max(|y|, L)

with `y` the response cut at the first "</s>" (in case the engine decodes special tokens) and
stripped of surrounding whitespace, and L = len(answer). Only the exact answer scores 1 (match
= 1 needs |y| = L and every position right); every wrong or missing position costs
W_MATCH / L, so the reward is graded finely on long responses. The digit and length terms give a
random policy a signal before it gets any position right: a uniformly random policy over the
128 toy ids scores about 0.15 at L = 64.
"""

from __future__ import annotations

__all__ = ["W_DIGITS", "W_LENGTH", "W_MATCH", "pattern_reward"]

_DIGITS = frozenset("0123456789")
W_MATCH, W_DIGITS, W_LENGTH = 0.7, 0.15, 0.15


def pattern_reward(prompt: str, response: str, answer: object) -> float:
    """Score one response against its answer (the repeated pattern, L characters)."""
    target = str(answer)
    text = str(response).split("</s>", 1)[0].strip()
    if not target:
        return 0.0
    if not text:
        return 0.0
    denom = max(len(text), len(target))
    match = sum(a == b for a, b in zip(text, target)) / denom
    digits = sum(c in _DIGITS for c in text) / len(text)
    length = min(len(text), len(target)) / denom
    return W_MATCH * match + W_DIGITS * digits + W_LENGTH * length
