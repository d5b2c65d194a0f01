"""Math answer verification on `math-verify` (boxed / final answers), never raising.

    math_reward(prompt, response, answer) = 1.0 if the response's extracted answer is
                                            mathematically equal to `answer`, else 0.0

`math-verify` bounds its own parse / compare time with SIGALRM, which only works in a process's
main thread; elsewhere its timeouts are switched off (the reward pool's per-call timeout, which
kills the worker process, is the outer bound in every case).
"""

from __future__ import annotations

import threading

__all__ = ["math_reward", "parse_gold"]

# Seconds for one parse and one comparison inside math-verify (it wants integers).
_MV_TIMEOUT_S = 5


def _mv_timeout() -> int | None:
    return _MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parse_gold(answer: object) -> list:
    """Parse a ground-truth answer: bare ("0.5", "x^2", "\\frac{1}{2}") or already delimited
    ("$...$", "\\boxed{...}"). A bare answer is tried as inline LaTeX first, then as plain text."""
    from math_verify import parse

    text = str(answer).strip()
    if not text:
        return []
    delimited = "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text
    for candidate in [text] if delimited else [f"${text}$", text]:
        parsed = parse(candidate, parsing_timeout=_mv_timeout())
        if parsed:
            return parsed
    return []


def math_reward(prompt: str, response: str, answer: object) -> float:
    """1.0 when `response` states an answer equal to `answer` (boxed answers first), else 0.0.
    Garbage, unparsable text and any internal error score 0.0."""
    try:
        from math_verify import parse, verify

        gold = parse_gold(answer)
        if not gold:
            return 0.0
        pred = parse(str(response), parsing_timeout=_mv_timeout())
        if not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=_mv_timeout()) else 0.0
    except Exception:  # a verifier must not take the trainer down; a bad sample scores 0
        return 0.0
