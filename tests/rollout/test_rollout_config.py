"""The rollout-mode keys (`rollout.oversample`, `drop_equal_reward_groups`, `partial_tokens`,
`async_rollout`, `max_staleness`, `fill_attempts`): refused values name the key, and every key
reaches the scheduler / driver the trainer builds (its effect: tests/rollout/test_scheduler.py)."""

from __future__ import annotations

import types

import pytest

from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.rollout.experience import Rollout
from tests.engines.fake_engine import FakeEngine

BASE = ["model.hf_path=/m", "data.train_path=/d.jsonl"]


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["rollout.oversample=0.5"], "rollout.oversample"),
        (["rollout.partial_tokens=0"], "rollout.partial_tokens"),
        (["rollout.fill_attempts=0"], "rollout.fill_attempts"),
        (["rollout.max_staleness=-1"], "rollout.max_staleness"),
        (["rollout.async_rollout=true", "rollout.max_staleness=0"], "rollout.max_staleness"),
        (["rollout.partial_tokens=4", "rollout.max_staleness=0"], "rollout.max_staleness"),
        (["rollout.env=m:Env", "rollout.partial_tokens=4"], "rollout.partial_tokens"),
        (
            ["rollout.async_rollout=true", "rollout.launch.colocated=true"],
            "rollout.launch.colocated",
        ),
    ],
)
def test_refused(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_config(None, [*BASE, *overrides])


def _rollout(overrides: list[str]) -> Rollout:
    cfg = load_config(None, [*BASE, *overrides])
    loader = types.SimpleNamespace(dataset=types.SimpleNamespace(encode=lambda r: [1, 2, 3]))
    tokenizer = types.SimpleNamespace(eos_token_id=0, decode=lambda ids, **kw: "")
    rewards = types.SimpleNamespace(close=lambda: None)
    return Rollout(cfg.rollout_spec(), FakeEngine(), tokenizer, loader, rewards)


def test_every_key_reaches_the_scheduler():
    default = _rollout([])
    on = _rollout(
        [
            "rollout.oversample=1.5",
            "rollout.drop_equal_reward_groups=true",
            "rollout.partial_tokens=7",
            "rollout.async_rollout=true",
            "rollout.max_staleness=3",
            "rollout.fill_attempts=9",
        ]
    )
    try:
        d, o = default.driver.scheduler.cfg, on.driver.scheduler.cfg
        assert (d.oversample, o.oversample) == (1.0, 1.5)
        assert (d.drop_equal_reward_groups, o.drop_equal_reward_groups) == (False, True)
        assert (d.partial_tokens, o.partial_tokens) == (None, 7)
        # asynchronous mode generates max_staleness batches ahead
        assert (default.driver.lookahead, on.driver.lookahead) == (0, 3)
        assert (d.max_staleness, o.max_staleness) == (1, 3)
        assert (d.fill_attempts, o.fill_attempts) == (4, 9)
    finally:
        default.driver.close()
        on.driver.close()
