"""loss.kl_in_reward: the KL penalty r_i - beta * sum_t k_t(pi_old || pi_ref) over the loss
tokens, then the group advantages again, against a float64 computation written out by hand."""

from __future__ import annotations

import math

import pytest

from megatron_gspo.algo.sequences import TrainSequence
from megatron_gspo.megatron.policy import apply_kl_reward


def _seq(
    i: int, reward: float, group: int, old: list[float], ref: list[float], mask
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
    metrics = apply_kl_reward(seqs, kl_coef=beta, estimator="k3", eps=1e-6, normalize_std=True)
    assert [s.advantage for s in seqs] == pytest.approx(want_a, rel=1e-9, abs=1e-12)
    penalty = sum(s.reward - r for s, r in zip(seqs, want_r, strict=True)) / len(seqs)
    assert metrics["kl/reward_penalty"] == pytest.approx(penalty, rel=1e-12)
    # group 2 had equal rewards: only the KL penalty separates its members now
    assert seqs[3].advantage < 0 < seqs[4].advantage


def test_missing_reward_or_reference_is_refused() -> None:
    s = _seq(0, 1.0, 0, [-1.0], [-1.0], None)
    s.reward = None
    with pytest.raises(ValueError, match="kl_in_reward"):
        apply_kl_reward([s], kl_coef=0.1, estimator="k1", eps=1e-6, normalize_std=True)
