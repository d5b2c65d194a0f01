"""Reward functions: math-verify answers, the toy task, and user functions in a worker pool.

Every reward function has the signature `fn(prompt, response, answer) -> float`.
"""

from megatron_gspo.rewards.math_answer import math_reward, parse_gold
from megatron_gspo.rewards.pool import (
    RewardBatch,
    RewardFn,
    RewardPool,
    build_reward_pool,
    load_reward_fn,
)
from megatron_gspo.rewards.toy import toy_reward

__all__ = [
    "RewardBatch",
    "RewardFn",
    "RewardPool",
    "build_reward_pool",
    "load_reward_fn",
    "math_reward",
    "parse_gold",
    "toy_reward",
]
