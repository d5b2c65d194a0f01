"""DAPO overlong shaping (reward.overlong_buffer) and truncated-response filtering
(loss.mask_truncated) on the rollout side: the penalty reaches the group's rewards (what dynamic
sampling and the advantages see), truncated responses leave the training batch after their
group's advantages were computed with them, and both are counted in the step's metrics."""

from __future__ import annotations

import collections
import types

import pytest
import torch

from megatron_gspo.algo import group_advantages
from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.engines.types import RolloutStats, Sample
from megatron_gspo.rollout.experience import Rollout
from megatron_gspo.rollout.scheduler import Batch, Group
from tests.engines.fake_engine import FakeEngine

BASE = ["model.hf_path=/m", "data.train_path=/d.jsonl", "rollout.max_new_tokens=8"]


def _sample(n: int, truncated: bool, k: int) -> Sample:
    return Sample(
        prompt_ids=[1, 2, 3],
        response_ids=list(range(5, 5 + n)),
        logprobs=[-0.5] * n,
        finish_reason="length" if truncated else "stop",
        truncated=truncated,
        weight_version="1",
        engine_id="e",
        prompt_index=0,
        sample_index=k,
        logprob_mask=[True] * n,
    )


def _rollout(overrides: list[str], task_rewards: list[float]) -> Rollout:
    cfg = load_config(None, [*BASE, *overrides])
    loader = types.SimpleNamespace(dataset=types.SimpleNamespace(encode=lambda r: [1, 2, 3]))
    tokenizer = types.SimpleNamespace(eos_token_id=0, decode=lambda ids, **kw: "")
    scored = types.SimpleNamespace(
        rewards=task_rewards, metrics=dict, timeouts=0, failures=0, errors=[], report=lambda: None
    )
    rewards = types.SimpleNamespace(close=lambda: None, score=lambda *a: scored)
    return Rollout(cfg.rollout_spec(), FakeEngine(), tokenizer, loader, rewards)


# lengths against rollout.max_new_tokens=8, buffer 4: <= 4 no penalty, 8 the full one
LENGTHS = [2, 4, 5, 6, 8, 8]
TRUNC = [False, False, False, False, True, True]
TASK = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def _batch(r: Rollout, lengths: list[int], trunc: list[bool]) -> tuple[list, dict]:
    """`next_batch` on one group scored by the real `_score` (the fill replaced by a stub)."""
    samples = [_sample(n, t, k) for k, (n, t) in enumerate(zip(lengths, trunc, strict=True))]
    record = types.SimpleNamespace(prompt="p", answer="a")
    values, _ = r._score(record, samples)
    group = Group(uid=0, record=record, prompt_ids=[1, 2, 3], samples=samples, rewards=values)
    batch = Batch(
        groups=[group],
        target_version=1,
        counts=collections.Counter(),
        stats=RolloutStats(),
        reward_metrics={},
        wall_s=0.1,
    )
    r.driver.close()
    r.driver = types.SimpleNamespace(next_batch=lambda: (batch, {}), close=lambda: None)
    return r.next_batch()


def test_off_by_default_changes_nothing() -> None:
    seqs, metrics = _batch(_rollout([], TASK), LENGTHS, TRUNC)
    assert len(seqs) == len(LENGTHS)
    assert metrics["reward/mean"] == pytest.approx(sum(TASK) / len(TASK))
    assert not any(k.startswith(("reward/overlong", "loss/truncated")) for k in metrics)


def test_overlong_penalty_reaches_rewards_and_advantages() -> None:
    r = _rollout(["reward.overlong_buffer=4", "reward.overlong_penalty=0.5"], TASK)
    seqs, metrics = _batch(r, LENGTHS, TRUNC)
    # DAPO eq. 13 by hand: (L - buf - |y|) / buf for 4 < |y| <= 8, times 0.5
    pen = [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    shaped = [t + p for t, p in zip(TASK, pen, strict=True)]
    assert [s.reward for s in seqs] == pytest.approx(shaped)
    want = group_advantages(torch.tensor(shaped, dtype=torch.float64), len(shaped))
    assert [s.advantage for s in seqs] == pytest.approx(want.tolist())
    assert metrics["reward/mean"] == pytest.approx(sum(shaped) / len(shaped))
    assert metrics["reward/overlong_penalty"] == pytest.approx(sum(pen) / len(pen))
    assert metrics["reward/overlong_frac"] == pytest.approx(4 / 6)


def test_truncated_responses_leave_the_loss_after_the_advantages() -> None:
    seqs, metrics = _batch(_rollout(["loss.mask_truncated=true"], TASK), LENGTHS, TRUNC)
    full = group_advantages(torch.tensor(TASK, dtype=torch.float64), len(TASK)).tolist()
    assert [len(s.response_ids) for s in seqs] == LENGTHS[:4]  # the two truncated are gone
    assert [s.advantage for s in seqs] == pytest.approx(full[:4])  # computed with them
    assert metrics["loss/truncated_masked"] == 2.0
    assert metrics["response/truncated_frac"] == pytest.approx(2 / 6)  # still reported


def test_overlong_buffer_is_checked_against_the_length_cap() -> None:
    with pytest.raises(ConfigError, match=r"reward\.overlong_buffer"):
        load_config(None, [*BASE, "reward.overlong_buffer=9"])
    with pytest.raises(ConfigError, match=r"reward\.overlong_buffer"):
        load_config(None, [*BASE, "reward.overlong_buffer=-1"])


def test_all_truncated_leaves_an_empty_batch_that_is_not_a_skipped_update() -> None:
    from megatron_gspo.megatron.policy import summarise

    seqs, metrics = _batch(_rollout(["loss.mask_truncated=true"], TASK), LENGTHS, [True] * 6)
    assert seqs == [] and metrics["loss/truncated_masked"] == 6.0
    # the policy's update over no mini-batch: no step, and not counted as a non-finite one
    assert summarise([]) == {"train/skipped_updates": 0.0, "train/empty_updates": 1.0}
