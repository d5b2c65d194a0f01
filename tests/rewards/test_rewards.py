"""Rewards: the math-verify verifier, spec loading, and the worker pool's timeouts / failures."""

from __future__ import annotations

import time

import pytest

from megatron_gspo.config import load_config
from megatron_gspo.rewards import (
    RewardPool,
    build_reward_pool,
    load_reward_fn,
    math_reward,
    toy_reward,
)

# Importable by the workers under whatever package name pytest gave this directory.
FIX = __name__.rpartition(".")[0] + ".reward_fixtures"


@pytest.mark.parametrize(
    "response, answer",
    [
        (r"so the answer is \boxed{1/2}", "0.5"),
        (r"\boxed{\frac{1}{2}}", "0.5"),
        ("The final answer is 0.5", r"\frac{1}{2}"),
        (r"We get $x^2 + 1$, i.e. \boxed{1 + x^2}", "x^2+1"),
        (r"\boxed{42}", "$42$"),
        (r"\boxed{3}", 3),  # a numeric answer from JSON
    ],
)
def test_math_correct(response, answer):
    assert math_reward("q", response, answer) == 1.0


@pytest.mark.parametrize(
    "response, answer",
    [
        (r"\boxed{0.6}", "0.5"),
        (r"\boxed{x^2 - 1}", "x^2+1"),
        ("no number here", "7"),
    ],
)
def test_math_wrong(response, answer):
    assert math_reward("q", response, answer) == 0.0


@pytest.mark.parametrize(
    "response, answer",
    [
        ("\\boxed{", "3"),
        ("}}}{{{\\frac{\\frac{", "1"),
        ("\x00\xff\ud7ff" * 50, "2"),
        ("\\boxed{1}", ""),
        ("\\boxed{1}", None),
        (None, "1"),
        ("$" * 1000, "1"),
        ("\\boxed{1/0}", "zoo"),
    ],
)
def test_math_garbage_scores_zero_without_raising(response, answer):
    assert math_reward("q", response, answer) == 0.0


def test_load_reward_fn():
    assert load_reward_fn("toy") is toy_reward and load_reward_fn("math") is math_reward
    assert load_reward_fn(f"{FIX}:broken")("", "x", "") == 0.5
    with pytest.raises(ValueError, match="cannot import"):
        load_reward_fn("no_such_pkg_xyz:f")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_reward_fn(f"{FIX}:nope")
    with pytest.raises(ValueError, match="module:function"):
        load_reward_fn("just_a_name")
    with pytest.raises(ValueError, match="has no attribute"):
        RewardPool(f"{FIX}:nope", num_workers=1)  # fails at start-up, not per sample


def test_in_process_pool_matches_direct_calls():
    responses = ["2183", "2184", "", "abc"]
    with RewardPool("toy", num_workers=0) as pool:
        batch = pool.score(["p"] * 4, responses, ["2183"] * 4)
    assert batch.rewards == [toy_reward("p", r, "2183") for r in responses]
    assert batch.metrics()["reward/failures"] == 0.0
    with pytest.raises(ValueError, match="lengths differ"):
        RewardPool("toy", num_workers=0).score(["p"], [], [])


def test_worker_pool_order_and_stdout_noise():
    responses = [str(i) * (i % 7) for i in range(23)]
    answers = ["ab"] * 23
    with RewardPool(f"{FIX}:length_ratio", num_workers=2, timeout_s=30) as pool:
        first = pool.score(["p"] * 23, responses, answers)
        second = pool.score(["p"] * 23, responses, answers)  # workers are reused
    expected = [len(r) / 2 for r in responses]
    assert first.rewards == expected and second.rewards == expected
    assert first.failures == first.timeouts == 0


def test_timeouts_are_counted_and_return_within_the_timeout():
    timeout = 1.5  # generous: an "ok" call on a loaded 2-core machine must not time out
    responses = ["ok", "hang", "spin", "ok", "ok", "ok"]
    with RewardPool(f"{FIX}:sleepy", num_workers=2, timeout_s=timeout) as pool:
        pool.score(["p"], ["ok"], ["a"])  # workers started (start-up is not a call)
        t0 = time.monotonic()
        batch = pool.score(["p"] * 6, responses, ["a"] * 6)
        elapsed = time.monotonic() - t0
        after = pool.score(["p"] * 2, ["ok", "ok"], ["a"] * 2)  # replacements work
    assert batch.rewards == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert batch.timeouts == 2 and batch.failures == 0
    assert batch.metrics()["reward/timeouts"] == 2.0
    # Both hung calls run side by side on the two workers, then the replacements start.
    assert elapsed < 2 * timeout + 4.0, elapsed
    assert after.rewards == [1.0, 1.0] and after.timeouts == 0


def test_failures_are_counted_and_score_zero():
    responses = ["raise", "nan", "none", "exit", "fine", "fine"]
    with RewardPool(f"{FIX}:broken", num_workers=2, timeout_s=30) as pool:
        batch = pool.score(["p"] * 6, responses, ["a"] * 6)
        unserialisable = pool.score(["p"], ["fine"], [object()])
    assert batch.rewards == [0.0, 0.0, 0.0, 0.0, 0.5, 0.5]
    assert batch.failures == 4 and batch.timeouts == 0
    text = " ".join(batch.errors)
    assert "RuntimeError: user bug" in text and "non-finite" in text and "exited" in text
    assert unserialisable.rewards == [0.0] and unserialisable.failures == 1


def test_math_in_workers_and_from_config():
    cfg = load_config(
        None,
        ["model.hf_path=/m", "data.train_path=/d", "reward.kind=math", "reward.num_workers=1"],
    )
    with build_reward_pool(cfg.reward, cfg.sandbox) as pool:
        batch = pool.score(["q"] * 3, [r"\boxed{1/2}", "\\boxed{", r"\boxed{0.7}"], ["0.5"] * 3)
    assert batch.rewards == [1.0, 0.0, 0.0] and batch.timeouts == 0 and batch.failures == 0


def test_tool_use_reward_only_a_call_reaches_full_reward():
    """The calculator examples' reward: every call >= 0.5 >= every answer without one (exact
    included), and 1 only for a call whose answer is exact (float64 arithmetic written out)."""
    from megatron_gspo.rewards.toy import tool_use_reward

    texts = ["82", "8", "28", "820", "x", "", "82?", "99", "1234"]
    for t in texts:
        plain, called = (
            tool_use_reward(t, "82", called=False),
            tool_use_reward(t, "82", called=True),
        )
        assert plain <= 0.5 <= called
        assert called == pytest.approx(0.5 + 0.5 * toy_reward("", t, "82"), abs=1e-15)
        assert (called == 1.0) == (t == "82") and plain < 1.0


def test_tool_calculator_env_follows_the_agents_rules():
    """`ToolCalculator` (the Env side of the agent example): a turn ending in "?" calls; the
    result + the next turn is the answer; a second call answers nothing."""
    from megatron_gspo.envs.calculator import ToolCalculator

    def episode(*turns: str) -> list:
        env = ToolCalculator()
        env.reset({"prompt": "add 37+45=", "answer": "82"})
        return [env.step(t) for t in turns]

    assert episode("7?", "") == [("82", None, False), (None, 1.0, True)]
    assert episode("?", "?") == [("82", None, False), (None, 0.5, True)]
    assert episode("82") == [(None, 0.5, True)]  # exact, but without the tool
    (_, (_, r, done)) = episode("?", "1")
    assert done and r == pytest.approx(0.5 + 0.5 * toy_reward("", "821", "82"))
