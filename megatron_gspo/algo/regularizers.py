"""Terms next to the policy loss: reference-model KL, entropy bonus, the loss aggregation
(per-sequence mean or token mean), and DAPO's overlong reward shaping.

Shape legend:
    T  packed response-token positions of this micro-batch (or context-parallel shard)
    S  sequences in the micro-batch
    B  samples of a rollout batch (overlong shaping)

KL estimators (Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html),
per sampled token y_t, with d_t = log pi_ref(y_t) - log pi_theta(y_t) clamped to +-c:

    k1_t = -d_t                      unbiased for KL(pi_theta || pi_ref), can be negative
    k2_t = d_t^2 / 2                 biased, low variance, >= 0
    k3_t = exp(d_t) - 1 - d_t        unbiased, >= 0, low variance ("low_var_kl")

All three are exactly 0 where pi_theta == pi_ref. The clamp keeps exp finite for one garbage
token; beyond it the gradient is 0 (as for the policy loss's log-ratio clamp).

Aggregation (`loss.aggregation`), one per-token weight w_t for every per-token term x_t:

    seq_mean:   w_t = 1 / |y_i|      D = number of sequences of the global batch
    token_mean: w_t = 1              D = number of loss tokens of the global batch
    term        = sum_t w_t x_t / D

|y_i| is the full sequence's loss-token count (summed over context-parallel shards through
`seq_sum`), so every shard adds its tokens' part and the shards' parts add up to the term.

The total loss of a micro-batch (its share of the global mean; Megatron sums the shares):

    loss = policy_loss + kl_coef * sum_t w_t k_t / D - entropy_coef * sum_t w_t H_t / D

The KL term is added only when `ref_logp` is given and kl_coef > 0 and the KL is not in the
reward (`loss.kl_in_reward`); the entropy term only when entropy_coef > 0, on the
differentiable per-token entropy the step computes when asked.

Metrics: `kl/mean` per loss token (k of `loss.kl_estimator`; whenever `ref_logp` is given),
`kl/loss`, `entropy/loss` (the added terms, per sequence or per token as aggregated).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from megatron_gspo.algo.losses import (
    PolicyLossConfig,
    PolicyLossInputs,
    SeqSum,
    identity_seq_sum,
    policy_loss,
)

__all__ = [
    "KL_ESTIMATORS",
    "aggregation_weights",
    "kl_estimate",
    "overlong_penalty",
    "regularized_loss",
    "sequence_kl",
]

KlEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str, clamp: float = 10.0) -> Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate [T] (see the module docstring).

    Args:
        logp: [T] log pi_theta of the sampled tokens (may carry grad).
        ref_logp: [T] log pi_ref of the same tokens (treated as a constant).
        estimator: "k1", "k2" or "k3".
        clamp: |d_t| bound before exp (> 0).
    Returns:
        [T] in the dtype of `logp` (no reduction, no mask).
    """
    d = (ref_logp.detach().to(logp.dtype) - logp).clamp(-clamp, clamp)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        # expm1 keeps k3 accurate (and exactly 0) for tiny d, where exp(d) - 1 would cancel.
        return torch.expm1(d) - d
    raise ValueError(f"loss.kl_estimator={estimator!r} is not one of {KL_ESTIMATORS}")


def aggregation_weights(
    mask: Tensor,
    seq_index: Tensor,
    num_seqs: int,
    aggregation: str,
    seq_sum: SeqSum = identity_seq_sum,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Per-token weights w_t [T] of `loss.aggregation` (0 where mask is 0), in `dtype`.

    seq_mean: 1 / |y_i| with |y_i| the full sequence's mask count (`seq_sum` all-reduces the
    per-sequence counts over context-parallel shards); token_mean: 1. Detached.
    """
    m = mask.detach().bool()
    if aggregation == "token_mean":
        return m.to(dtype)
    if aggregation != "seq_mean":
        raise ValueError(f"loss.aggregation={aggregation!r} is not seq_mean or token_mean")
    local = torch.zeros(num_seqs, 1, dtype=dtype, device=mask.device)
    local.index_add_(0, seq_index, m.to(dtype)[:, None])
    count = seq_sum(local)[:, 0].detach().clamp_min(1)
    return torch.where(m, 1.0 / count[seq_index], 0.0)


def sequence_kl(
    logp: Tensor, ref_logp: Tensor, mask: Tensor, seq_index: Tensor, num_seqs: int, estimator: str
) -> Tensor:
    """Per-sequence summed KL estimate [S]: sum_{t in y_i, mask_t} k_t (the reward penalty's
    KL, `loss.kl_in_reward`: r_i <- r_i - kl_coef * sum_t k_t, as a token-level reward summed
    over the response). Computed in float64; no grad."""
    k = kl_estimate(logp.detach().double(), ref_logp.double(), estimator)
    k = torch.where(mask.bool(), k, 0.0)
    return torch.zeros(num_seqs, dtype=torch.float64, device=k.device).index_add_(0, seq_index, k)


def _metric(total: Tensor, count: Tensor) -> Tensor:
    return torch.stack([total.detach().sum().float(), count.detach().sum().float()])


def regularized_loss(
    batch: PolicyLossInputs,
    cfg: PolicyLossConfig,
    *,
    denominator: float | Tensor,
    seq_sum: SeqSum = identity_seq_sum,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`policy_loss` plus the KL and entropy terms (module docstring), same contract:
    (loss: scalar, this micro-batch's share of the global mean; metrics: name -> [sum, count]).

    `denominator` is D of `cfg.aggregation` (sequences or loss tokens of the global batch;
    1.0 when the caller's framework divides by D itself, as Megatron does).
    """
    loss, metrics = policy_loss(batch, cfg, denominator=denominator, seq_sum=seq_sum)
    kl_loss = cfg.kl_coef > 0 and not cfg.kl_in_reward and batch.ref_logp is not None
    if cfg.kl_coef > 0 and not cfg.kl_in_reward and batch.ref_logp is None:
        raise ValueError("loss.kl_coef > 0 needs the reference log-probs (batch.ref_logp)")
    ent_loss = cfg.entropy_coef > 0
    if ent_loss and batch.entropy is None:
        raise ValueError("loss.entropy_coef > 0 needs the per-token entropy (batch.entropy)")
    if not (kl_loss or ent_loss or batch.ref_logp is not None):
        return loss, metrics
    mask = batch.mask.bool()
    mf = mask.float()
    # At least float32 (token counts in bf16 would be off past 256 tokens).
    dtype = torch.promote_types(batch.logp.dtype, torch.float32)
    w = aggregation_weights(
        mask, batch.seq_index, batch.num_seqs, cfg.aggregation, seq_sum, dtype=dtype
    )
    # Metric unit of the added terms: per sequence (seq_mean) or per token (token_mean).
    unit = w.sum() if cfg.aggregation == "seq_mean" else mf.sum()
    if batch.ref_logp is not None:
        # torch.where, not a product: garbage at masked positions gives 0 value and 0 grad.
        lp = torch.where(mask, batch.logp, 0.0)
        ref = torch.where(mask, batch.ref_logp.to(lp.dtype), 0.0)
        k = torch.where(mask, kl_estimate(lp, ref, cfg.kl_estimator, cfg.log_ratio_clamp), 0.0)
        metrics["kl/mean"] = _metric(k, mf)
        if kl_loss:
            term = (k.to(dtype) * w).sum()
            loss = loss + cfg.kl_coef * term / denominator
            metrics["kl/loss"] = _metric(term, unit)
    if ent_loss:
        assert batch.entropy is not None
        h = torch.where(mask, batch.entropy, 0.0)
        term = (h.to(dtype) * w).sum()
        loss = loss - cfg.entropy_coef * term / denominator
        metrics["entropy/loss"] = _metric(term, unit)
    return loss, metrics


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al., arXiv 2503.14476, eq. 13), times `factor`:

        R_len(|y|) = 0                                  |y| <= L_max - L_buf
                   = ((L_max - L_buf) - |y|) / L_buf    L_max - L_buf < |y| <= L_max
                   = -1                                 |y| > L_max

    added to the task reward. Args: lengths [B] response token counts; max_len L_max (the
    generation cap); buffer L_buf (0 < L_buf <= L_max); factor >= 0. Returns [B] float64 <= 0.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer={buffer} must be in (0, max_len={max_len}]")
    n = lengths.double()
    start = max_len - buffer
    ramp = (start - n) / buffer
    pen = torch.where(n <= start, 0.0, torch.where(n <= max_len, ramp, -1.0))
    return pen * factor
