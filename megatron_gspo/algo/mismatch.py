"""Mismatch masks: leave out of the policy loss what the engine and the trainer disagree on.

Shape legend:
    T  packed response-token positions (of this micro-batch / context-parallel shard)
    S  sequences in the micro-batch

The rollout engine (bf16 / FP8 kernels, its own MoE routing) and the trainer compute different
log-probs for the same tokens at the same weights. Two defences drop the samples where they
disagree most, instead of re-weighting them (truncated importance correction, correction.py):

    d_{i,t} = log pi_trainer(y_{i,t}) - log pi_engine(y_{i,t})      (trainer at the rollout weights)
    sequence mask:  keep y_i      iff  low <= exp( (1/|y_i|) sum_t d_{i,t} ) <= high
    token mask:     keep y_{i,t}  iff  low <= exp( d_{i,t} ) <= high

The sequence ratio is the geometric mean over ALL of y_i's response tokens (the token mask does
not change it), |y_i| counted over the caller's mask. A sequence with no response token is kept
(it contributes nothing anyway). A NaN or infinite d leaves its token / sequence out: no
comparison with a bound holds. Computed in float64, detached (the masks are constants).

Peer data points (no code taken from them): NeMo-RL's MoE / ProRLv2 recipes offer a token-level
mask (IcePop, "ICE-POP") and a sequence-level mask ("seq-mask-tis") for backend mismatch,
https://docs.nvidia.com/nemo/rl/latest/guides/prorlv2.html; the MoE recipe keeps sequences whose
geometric-mean ratio lies in [0.999, 1.002]. IcePop (Ring-1T, Ant Group) masks tokens whose
train/inference probability ratio leaves [alpha, beta].

Metrics (`[sum, count]` float32, as in losses.py):
    loss/seq_mismatch_masked    per sequence with >= 1 response token (once per CP rank, like
                                the loss's other per-sequence metrics): left out by the
                                sequence mask
    loss/token_mismatch_masked  per response token of this shard: left out by the token mask
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # types only: losses.py imports this module
    from megatron_gspo.algo.losses import PolicyLossConfig, PolicyLossInputs

__all__ = [
    "mismatch_keep_mask",
    "mismatch_masks",
    "sequence_mismatch_keep",
    "token_mismatch_keep",
]


def token_mismatch_keep(
    trainer_logp: Tensor, engine_logp: Tensor, *, low: float, high: float
) -> Tensor:
    """Token mask: [T] bool, True where low <= exp(trainer_logp - engine_logp) <= high.

    Args:
        trainer_logp, engine_logp: [T] log-probs of the sampled tokens (any float dtype; the
            ratio is formed in float64). Positions outside the caller's mask are not special.
        low, high: the kept band of the probability ratio.
    """
    ratio = (trainer_logp.detach().double() - engine_logp.detach().double()).exp()
    return (ratio >= low) & (ratio <= high)


def sequence_mismatch_keep(
    log_ratio_sum: Tensor, count: Tensor, *, low: float, high: float
) -> Tensor:
    """Sequence mask: [S] bool, True where low <= exp(log_ratio_sum / count) <= high, or count 0.

    Args:
        log_ratio_sum: [S] full-sequence sum of log pi_trainer - log pi_engine over response
            tokens (already summed over context-parallel shards by the caller).
        count: [S] full-sequence response-token counts.
    """
    ratio = (log_ratio_sum.detach().double() / count.detach().double().clamp_min(1)).exp()
    return ((ratio >= low) & (ratio <= high)) | (count == 0)


def _metric(total: Tensor, count: Tensor) -> Tensor:
    return torch.stack([total.detach().sum().float(), count.detach().sum().float()])


def mismatch_keep_mask(
    mask: Tensor,
    trainer_logp: Tensor,
    engine_logp: Tensor,
    seq_index: Tensor,
    num_seqs: int,
    *,
    seq_bounds: Sequence[float] | None,
    token_bounds: Sequence[float] | None,
    seq_sum: Callable[[Tensor], Tensor],
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss mask after the mismatch masks, and their metrics (module docstring).

    Args:
        mask: [T] bool/0-1, the response tokens that count.
        trainer_logp, engine_logp: [T] (garbage at masked positions is ignored).
        seq_index: [T] int64 sequence of each token, 0..num_seqs-1.
        seq_bounds, token_bounds: [low, high] of each mask, None = that mask off.
        seq_sum: identity on one rank, the context-parallel SUM all-reduce otherwise (called
            once, only when the sequence mask is on, on a detached [S, 2] float64 tensor).

    Returns:
        (keep [T] bool: mask AND token kept AND sequence kept; metrics name -> [sum, count]).
    """
    m = mask.detach().bool()
    keep = m.clone()
    metrics: dict[str, Tensor] = {}
    if token_bounds is not None:
        tok = token_mismatch_keep(
            trainer_logp, engine_logp, low=token_bounds[0], high=token_bounds[1]
        )
        metrics["loss/token_mismatch_masked"] = _metric((m & ~tok).float(), m.float())
        keep &= tok
    if seq_bounds is not None:
        # torch.where, not a product: garbage (NaN) at masked positions must not reach the sums.
        d = torch.where(m, trainer_logp.detach().double() - engine_logp.detach().double(), 0.0)
        cols = torch.stack([d, m.double()], dim=-1)  # [T, 2]
        local = cols.new_zeros(num_seqs, 2).index_add(0, seq_index, cols)
        full = seq_sum(local)  # [S, 2]
        seq_keep = sequence_mismatch_keep(
            full[:, 0], full[:, 1], low=seq_bounds[0], high=seq_bounds[1]
        )
        valid = (full[:, 1] > 0).float()
        metrics["loss/seq_mismatch_masked"] = _metric((~seq_keep).float() * valid, valid)
        keep &= seq_keep[seq_index]
    return keep, metrics


def mismatch_masks(
    batch: PolicyLossInputs, cfg: PolicyLossConfig, seq_sum: Callable[[Tensor], Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """`mismatch_keep_mask` of a loss batch under `cfg` (loss.seq_mismatch_mask,
    loss.token_mismatch_mask). pi_engine: `rollout_logp` if given, else `old_logp`. pi_trainer at
    the rollout weights: `trainer_old_logp` if given, else `old_logp` when `rollout_logp` is given
    (pi_old recomputed by the trainer), else the current `logp` (exact on the first update after
    the rollout only: the caller passes `trainer_old_logp` for later ones)."""
    recomputed = batch.rollout_logp is not None
    trainer = batch.trainer_old_logp
    if trainer is None:
        trainer = batch.old_logp if recomputed else batch.logp
    return mismatch_keep_mask(
        batch.mask,
        trainer,
        batch.rollout_logp if batch.rollout_logp is not None else batch.old_logp,
        batch.seq_index,
        batch.num_seqs,
        seq_bounds=cfg.seq_mismatch_mask,
        token_bounds=cfg.token_mismatch_mask,
        seq_sum=seq_sum,
    )
