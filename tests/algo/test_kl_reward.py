"""loss.kl_in_reward: the KL penalty r_i - beta * sum_t k_t(pi_old || pi_ref) over the loss
tokens, then the group advantages again (`algo/kl_reward.py`), against a float64 computation
written out by hand."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from megatron_gspo.algo.kl_reward import kl_reward_advantages
from megatron_gspo.algo.sequences import TrainSequence


def _seq(
    i: int, reward: float, group: int, old: Any, ref: Any, mask: Any
) -> TrainSequence:
    return TrainSequence(
        seq_id=i,
        prompt_ids=[1],
        response_ids=[2] * len(old),
        old_logp=old,
        advantage=0.0,
        loss_mask=mask,
        ref_logp=ref,
        reward=reward,
        group=group,
    )


def test_kl_penalty_then_group_advantages() -> None:
    seqs = [
        _seq(0, 1.0, 7, [-1.0, -2.0], [-1.2, -1.5], [1, 1]),
        _seq(1, 0.0, 7, [-0.3, -0.4, -0.5], [-0.3, -2.4, -0.1], [1, 0, 1]),
        _seq(2, 1.0, 7, [-3.0], [-1.0], [1]),
        _seq(3, 0.5, 2, [-0.7, -0.1], [-0.2, -0.1], None),
        _seq(4, 0.5, 2, [-0.5], [-0.5], None),
    ]
    beta = 0.2
    want_r = []
    for s in seqs:
        mask = s.loss_mask or [1] * len(s.old_logp)
        kl = 0.0
        for lp, ref, m in zip(s.old_logp, s.ref_logp, mask, strict=True):
            if m:  # k3 with log r = log pi_ref - log pi_old
                kl += math.exp(ref - lp) - 1 - (ref - lp)
        want_r.append(s.reward - beta * kl)
    want_a = []
    for s, r in zip(seqs, want_r, strict=True):
        grp = [x for q, x in zip(seqs, want_r, strict=True) if q.group == s.group]
        mean = sum(grp) / len(grp)
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / len(grp))
        want_a.append((r - mean) / (std + 1e-6))
    got = kl_reward_advantages(seqs, kl_coef=beta, estimator="k3", eps=1e-6, normalize_std=True)
    assert got.advantages.dtype == got.penalties.dtype == torch.float64
    assert got.advantages.tolist() == pytest.approx(want_a, rel=1e-9, abs=1e-12)
    want_pen = [s.reward - r for s, r in zip(seqs, want_r, strict=True)]
    assert got.penalties.tolist() == pytest.approx(want_pen, rel=1e-12, abs=1e-15)
    # group 2 had equal rewards: only the KL penalty separates its members now
    assert got.advantages[3] < 0 < got.advantages[4]
    assert all(s.advantage == 0.0 for s in seqs)  # pure: the sequences are not changed
    # the ranks that receive a rollout hold tensor views (megatron/transfer.py): same numbers
    views = [
        _seq(
            s.seq_id,
            s.reward,
            s.group,
            torch.tensor(s.old_logp, dtype=torch.float64),
            torch.tensor(s.ref_logp, dtype=torch.float64),
            None if s.loss_mask is None else torch.tensor(s.loss_mask),
        )
        for s in seqs
    ]
    again = kl_reward_advantages(views, kl_coef=beta, estimator="k3", eps=1e-6, normalize_std=True)
    assert torch.equal(again.advantages, got.advantages)


def test_missing_reward_or_reference_is_refused() -> None:
    s = _seq(0, 1.0, 0, [-1.0], [-1.0], None)
    s.reward = None
    with pytest.raises(ValueError, match="kl_in_reward"):
        kl_reward_advantages([s], kl_coef=0.1, estimator="k1", eps=1e-6, normalize_std=True)
