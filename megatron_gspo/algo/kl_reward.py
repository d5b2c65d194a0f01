"""The KL penalty in the reward (`loss.kl_in_reward`) and the group advantages it changes.

Shape legend:
    S  sequences of the rollout batch
    T  their loss tokens, concatenated

    r'_i = r_i - kl_coef * sum_{t in y_i, mask_t} k_t(pi_old || pi_ref)
    A_i  = group_advantages(r')     (the same groups, eps and std normalisation as the rollout)

The penalty is a token-level reward summed over the response (`algo.regularizers.sequence_kl`),
so a group whose raw rewards were all equal is separated by the KL alone. Float64 throughout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_gspo.algo.advantages import group_advantages
from megatron_gspo.algo.regularizers import sequence_kl
from megatron_gspo.algo.sequences import TrainSequence

__all__ = ["KLRewardAdvantages", "kl_reward_advantages"]


@dataclass(frozen=True, slots=True)
class KLRewardAdvantages:
    """What `kl_reward_advantages` computes (float64, one entry per sequence, input order)."""

    advantages: Tensor
    """`[S]` group advantages of the penalised rewards."""
    penalties: Tensor
    """`[S]` kl_coef * sum_t k_t, taken off each reward."""


def kl_reward_advantages(
    seqs: Sequence[TrainSequence],
    *,
    kl_coef: float,
    estimator: str,
    eps: float,
    normalize_std: bool,
) -> KLRewardAdvantages:
    """Penalised rewards r_i - kl_coef * KL_i and their group advantages (module docstring).

    Reads each sequence's `reward`, `group`, `old_logp`, `ref_logp` and `loss_mask` (None: all
    response tokens count); changes nothing. ValueError when a reward, group or reference
    log-prob is missing.
    """
    if not seqs:
        raise ValueError("loss.kl_in_reward: no sequences")
    if any(s.reward is None or s.group is None or s.ref_logp is None for s in seqs):
        raise ValueError(
            "loss.kl_in_reward needs every sequence's reward, group and reference log-probs"
        )
    lengths = [len(s.response_ids) for s in seqs]
    old = torch.cat([torch.as_tensor(s.old_logp, dtype=torch.float64) for s in seqs])
    ref = torch.cat([torch.as_tensor(s.ref_logp, dtype=torch.float64) for s in seqs])
    mask = torch.cat(
        [
            torch.as_tensor(s.loss_mask if s.loss_mask is not None else [1] * n)
            for s, n in zip(seqs, lengths, strict=True)
        ]
    )
    seq_index = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lengths))
    penalties = kl_coef * sequence_kl(old, ref, mask, seq_index, len(seqs), estimator)
    # (the filters only narrow the types: every reward and group is set, checked above)
    rewards = torch.tensor([s.reward for s in seqs if s.reward is not None], dtype=torch.float64)
    groups = torch.tensor([s.group for s in seqs if s.group is not None])
    adv = group_advantages(rewards - penalties, groups, eps=eps, normalize_std=normalize_std)
    return KLRewardAdvantages(advantages=adv, penalties=penalties)
