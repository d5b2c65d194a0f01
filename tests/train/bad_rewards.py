"""A user reward function that never returns a usable reward (tests/train/test_new_user_e2e.py):
NaN, None, a non-numeric string or a list, by the response's length."""

from __future__ import annotations

from typing import Any


def invalid(prompt: str, response: str, answer: Any) -> Any:
    return [float("nan"), None, "high", [1.0]][len(response) % 4]
