"""Truncated importance correction between the trainer's pi_old and the rollout engine.

Shape legend:
    T  packed response-token positions (of this micro-batch / context-parallel shard)
    S  sequences in the micro-batch

When the trainer recomputes pi_old (`old_logp`) instead of trusting the engine's log-probs
(`rollout_logp`), the samples still came from the engine's distribution pi_rollout. A truncated
importance weight (TIS) re-weights the loss towards pi_old:

    token level:     w_{i,t} = min( pi_old(y_{i,t}) / pi_rollout(y_{i,t}), cap )
    sequence level:  w_i     = min( (pi_old(y_i) / pi_rollout(y_i)) ^ (1/|y_i|), cap )
                             = min( exp( mean_t [log pi_old - log pi_rollout] ), cap )

Weights are constants (no gradient: both distributions are fixed during the update). The log
ratio is clamped to +-log_ratio_clamp before `exp`, like the policy ratio, so a garbage engine
log-prob cannot produce inf. Where the weight multiplies is the loss's business (see losses.py):
the per-token term (token level) or the per-sequence loss l_i (sequence level).
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["tis_sequence_weights", "tis_token_weights"]


def tis_token_weights(
    old_logp: Tensor, rollout_logp: Tensor, *, cap: float, log_ratio_clamp: float
) -> tuple[Tensor, Tensor]:
    """Token-level truncated importance weights.

    Args:
        old_logp, rollout_logp: [T] log-probs of the sampled tokens under pi_old / pi_rollout
            (masked positions should already be neutralised by the caller; they are not read
            specially here).
        cap: upper truncation of the weight (> 0).
        log_ratio_clamp: |log ratio| bound applied before `exp`.

    Returns:
        (weights [T] detached, truncated [T] bool: where the cap was hit).
    """
    log_w = (old_logp.detach() - rollout_logp.detach()).clamp(-log_ratio_clamp, log_ratio_clamp)
    raw = log_w.exp()
    return raw.clamp(max=cap), raw > cap


def tis_sequence_weights(
    log_ratio_sum: Tensor, count: Tensor, *, cap: float, log_ratio_clamp: float
) -> tuple[Tensor, Tensor]:
    """Sequence-level (geometric-mean) truncated importance weights.

    Args:
        log_ratio_sum: [S] full-sequence sum over response tokens of log pi_old - log pi_rollout
            (already summed over context-parallel shards by the caller).
        count: [S] full-sequence response-token counts; a sequence with 0 tokens gets weight 1.
        cap, log_ratio_clamp: as in `tis_token_weights`.

    Returns:
        (weights [S] detached, truncated [S] bool).
    """
    mean = log_ratio_sum.detach() / count.detach().clamp_min(1)
    raw = mean.clamp(-log_ratio_clamp, log_ratio_clamp).exp()
    return raw.clamp(max=cap), raw > cap
