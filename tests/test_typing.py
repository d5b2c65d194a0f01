"""The package's `Any` under a ratchet (`tools/count_any.py` says how it counts).

Issue 39 asks for at most 132, held by the bare count (`tools/count_any.py` says why); the bounds
below are this tree's counts. Lower them when you type something precisely; raising one needs a
reason in the commit message.
"""

from __future__ import annotations

from tools.count_any import ROOT, any_tokens, bare_any, count

MAX_ANY_TOKENS = 434
MAX_BARE_ANY = 59
ISSUE_39_TARGET = 132  # half of the issue's 264, on the bare count


def test_any_does_not_grow() -> None:
    tokens, bare = count([ROOT / "megatron_gspo"])
    worst = ", ".join(f"{n} {f}" for f, n in tokens.most_common(3))
    assert sum(tokens.values()) <= MAX_ANY_TOKENS, f"more `Any` than before (most: {worst})"
    assert sum(bare.values()) <= MAX_BARE_ANY, "more annotations typed `Any` as a whole"


def test_the_ratchet_meets_issue_39() -> None:
    assert MAX_BARE_ANY <= ISSUE_39_TARGET


def test_the_counts_can_fail() -> None:
    src = (
        "from typing import Any\n"
        "# Any in a comment\n"
        "def f(a: Any, b: dict[str, Any], *c: Any | None) -> 'Any':\n"
        "    x: Any = 'Any'\n"
        "    return x\n"
    )
    assert any_tokens(src) == 5  # import, a, b, c, x: not the comment nor the strings
    assert bare_any(src) == 4  # a, c, the return, x: not dict[str, Any]
