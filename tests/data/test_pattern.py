"""The long-response repeat task: its dataset generator, config checks and graded reward."""

from __future__ import annotations

import json
import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_gspo.config import load_config
from megatron_gspo.config_io import ConfigError
from megatron_gspo.data.pattern import (
    PatternTaskConfig,
    pattern_answer,
    pattern_task_config,
    write_pattern_dataset,
)
from megatron_gspo.rewards import load_reward_fn
from megatron_gspo.rewards.pattern import W_DIGITS, W_LENGTH, W_MATCH, pattern_reward


def _reference(response: str, answer: str) -> Fraction:
    """A second implementation in exact rationals, position by position over the longer
    string (a missing character never matches)."""
    text = response.split("</s>")[0].strip()
    if not text or not answer:
        return Fraction(0)
    n = max(len(text), len(answer))
    right = 0
    for i in range(n):
        got = text[i] if i < len(text) else None
        want = answer[i] if i < len(answer) else None
        right += got is not None and got == want
    digits = Fraction(len([c for c in text if c.isascii() and c.isdigit()]), len(text))
    length = Fraction(min(len(text), len(answer)), n)
    w = [Fraction(x).limit_denominator(1000) for x in (W_MATCH, W_DIGITS, W_LENGTH)]
    return w[0] * Fraction(right, n) + w[1] * digits + w[2] * length


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("3838", "3838", 1.0),  # exact
        ("3838</s>junk", "3838", 1.0),  # cut at the first </s>
        ("  3838 ", "3838", 1.0),  # surrounding whitespace
        ("", "3838", 0.0),
        ("3833", "3838", 0.7 * 3 / 4 + 0.15 + 0.15),  # one wrong position
        ("38", "3838", 0.7 * 2 / 4 + 0.15 + 0.15 * 2 / 4),  # stopped at half the length
        ("383838", "3838", 0.7 * 4 / 6 + 0.15 + 0.15 * 4 / 6),  # ran on past L
        ("abcd", "3838", 0.15),  # right length, nothing else
        ("8383", "3838", 0.15 + 0.15),  # digits, out of phase
    ],
)
def test_hand_checked(response, answer, expected):
    assert pattern_reward("p", response, answer) == pytest.approx(expected, abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(
    response=st.text(alphabet="0123456789ab </s>", max_size=80),
    answer=st.text(alphabet="0123456789", min_size=1, max_size=64),
)
def test_against_the_exact_reference(response, answer):
    got = pattern_reward("p", response, answer)
    assert got == pytest.approx(float(_reference(response, answer)), abs=1e-12)
    assert 0.0 <= got <= 1.0
    assert (got == pytest.approx(1.0)) == (response.split("</s>")[0].strip() == answer)


def test_graded_on_long_answers():
    """Every extra right position raises the reward by W_MATCH / L: graded, not all-or-nothing."""
    answer = pattern_answer("47", 128)
    wrong = "".join("0" if c != "0" else "1" for c in answer)
    prev = pattern_reward("p", wrong, answer)
    for k in (1, 17, 64, 127):
        r = pattern_reward("p", answer[:k] + wrong[k:], answer)
        assert r > prev
        assert r == pytest.approx(W_MATCH * k / 128 + W_DIGITS + W_LENGTH, abs=1e-12)
        prev = r


def test_random_policy_scores_low_with_spread():
    """A uniform policy over the 128 toy ids (decoded as one character each) at L = 64 scores
    about 0.15 with spread inside a group: the signal GSPO starts from."""
    from megatron_gspo.data.toy import _vocab

    chars = [c for c in _vocab() if len(c) == 1]
    rng = random.Random(0)
    answer = pattern_answer("5", 64)
    rewards = [
        pattern_reward("p", "".join(rng.choice(chars) for _ in range(64)), answer)
        for _ in range(400)
    ]
    mean = sum(rewards) / len(rewards)
    assert 0.15 < mean < 0.2
    assert max(rewards) - min(rewards) > 0.02


def test_answer_and_dataset(tmp_path):
    assert pattern_answer("38", 5) == "38383"
    assert pattern_answer("7", 3) == "777"
    cfg = PatternTaskConfig(length=48, pattern_min=1, pattern_max=3, n=50, seed=3)
    p = write_pattern_dataset(tmp_path / "a.jsonl", cfg)
    rows = [json.loads(line) for line in p.read_text().splitlines()]
    assert len(rows) == 50
    for r in rows:
        pattern = r["prompt"].removeprefix("rep ").split(" ")[0]
        assert r["prompt"] == f"rep {pattern} x48="
        assert 1 <= len(pattern) <= 3 and pattern.isdigit()
        assert len(r["answer"]) == 48 and r["answer"] == pattern_answer(pattern, 48)
        assert pattern_reward(r["prompt"], r["answer"], r["answer"]) == 1.0
    assert write_pattern_dataset(tmp_path / "b.jsonl", cfg).read_text() == p.read_text()


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="task.length"):
        PatternTaskConfig(length=1, pattern_max=2)
    with pytest.raises(ConfigError, match="task.pattern_min"):
        PatternTaskConfig(pattern_min=3, pattern_max=2)
    with pytest.raises(ConfigError, match="task.length"):
        pattern_task_config({"lenght": 64})  # unknown key: suggests the right one
    assert pattern_task_config({"length": 256}).length == 256


def test_reward_kind_pattern_is_built_in(tmp_path):
    assert load_reward_fn("pattern") is pattern_reward
    cfg = load_config(
        None,
        ["model.hf_path=m", f"data.train_path={tmp_path}/d.jsonl", "reward.kind=pattern"]
        + ["reward.num_workers=0"],
    )
    assert cfg.reward.kind == "pattern"
