"""Policy losses: GSPO, GSPO-token and GRPO on packed response tokens.

Shape legend:
    T  packed response-token positions of this micro-batch (or of this context-parallel shard)
    S  sequences in the micro-batch
    k  number of per-sequence sums stacked for the one context-parallel all-reduce

Math (Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071):

    lr_{i,t} = log pi_theta(y_{i,t}) - log pi_old(y_{i,t})
    GSPO:       s_i     = exp( clamp( (1/|y_i|) sum_t lr_{i,t}, -c, c ) )
                l_i     = -min( s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i )
    GSPO-token: s_{i,t} = sg[s_i] * exp(log pi_theta(y_{i,t}) - sg[log pi_theta(y_{i,t})])
                l_i     = (1/|y_i|) sum_t -min( s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t} )
    GRPO:       w_{i,t} = exp( clamp(lr_{i,t}, -c, c) )
                l_i     = (1/|y_i|) sum_t -min( w_{i,t} A_{i,t}, clip(w_{i,t}) A_{i,t} )

Reduction contract (the part implementations get wrong):

    loss = ( sum_i l_i ) / denominator

with `denominator` the number of sequences of the GLOBAL batch (all micro-batches, all
data-parallel ranks), so that Megatron's sum over micro-batches and data-parallel ranks is a mean
over sequences in which every sequence weighs the same whatever its length. |y_i| counts only
tokens with mask 1; a sequence with no such token contributes 0 (but still counts in the
caller's denominator).

`loss.aggregation=token_mean` (DAPO's token-level loss) instead weighs every loss token the same:

    loss = ( sum_i |y_i| l_i ) / denominator,   denominator = loss tokens of the GLOBAL batch

i.e. GSPO's l_i counts |y_i| times, and the token-level kinds drop their 1/|y_i|.

Context parallelism: every per-sequence sum over tokens that the loss needs whole (log-ratio sums,
token counts, TIS log-ratio sums) is stacked into ONE [S, k] tensor and passed through
`seq_sum`: identity on one rank; under CP an autograd-aware all-reduce over the CP group whose
backward all-reduces the gradient (`cp_seq_sum`). The returned loss is then this shard's SHARE
of the loss, and the sum of the losses over the CP ranks equals the loss above:
  * token-level kinds add this shard's token terms / |y_i| (|y_i| summed through `seq_sum`);
  * GSPO weights l_i (which every shard can compute from the all-reduced sums) by the fraction
    of y_i's tokens that this shard holds, n_i^local / |y_i| (exactly 1 on one rank).
So the gradients that come back to each shard's log-probs are those of the unsplit loss.

Metrics: `dict[str, Tensor]`, each a detached float32 tensor [sum, count]; all-reduce a stack of
them by SUM over any set of ranks/micro-batches and report sum / count. Per-token metrics count
this shard's tokens. Per-sequence metrics (GSPO clip fractions and ratios, sequence log-ratios,
response length, sequence-level TIS) count every sequence with >= 1 response token once PER
CONTEXT-PARALLEL RANK, so both sum and count scale by the CP size and the ratio is unaffected.

    policy/clip_frac_low|_high|      clipping ACTIVE (gradient zeroed): ratio < 1 - eps_low with
      clip_frac                      A < 0 | ratio > 1 + eps_high with A > 0 | either; per
                                     sequence (gspo) or per token (gspo_token, grpo)
    policy/ratio, policy/ratio_sq    the ratio and its square, same unit (std = sqrt(E[r^2]-E[r]^2))
    policy/abs_log_ratio             per token |logp - old_logp|
    policy/seq_log_ratio[_abs]       per sequence clamped mean log(pi_theta / pi_old) (and |.|)
    mismatch/abs_logp_diff           per token |logp - logp_engine|, logp_engine = rollout_logp if
                                     given, else old_logp (pure mismatch on the first mini-batch)
    mismatch/seq_log_ratio_abs       per sequence |mean_t (logp - logp_engine)|: vs the clip band
    mismatch/seq_outside_clip        per sequence: that mean log-ratio lies outside
                                     [log(1 - eps_low), log(1 + eps_high)]
    mismatch/seq_outside_clip_len/B, the two above per response-length bin B ("32-63", ...:
      mismatch/seq_log_ratio_abs_len/B `algo/length_bins.py`); a bin with no sequence is absent
    mismatch/old_rollout_abs_diff    per token |old_logp - rollout_logp| (only with rollout_logp)
    policy/entropy                   per token (only with entropy)
    policy/response_length           per sequence |y_i|
    tis/weight, tis/clip_frac        TIS weight and how often the cap bit (tis_mode != "none")
    loss/seq|token_mismatch_masked   left out by loss.*_mismatch_mask (algo/mismatch.py)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from megatron_gspo.algo.config import PolicyLossConfig
from megatron_gspo.algo.correction import tis_sequence_weights, tis_token_weights
from megatron_gspo.algo.length_bins import by_length
from megatron_gspo.algo.mismatch import mismatch_masks

__all__ = [
    "POLICY_LOSSES",
    "PolicyLossConfig",
    "PolicyLossFn",
    "PolicyLossInputs",
    "SeqSum",
    "cp_seq_sum",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "identity_seq_sum",
    "policy_loss",
]

SeqSum = Callable[[Tensor], Tensor]


@dataclass(kw_only=True, slots=True)
class PolicyLossInputs:
    """Packed per-token tensors of one micro-batch (or one context-parallel shard of it).

    All [T] tensors are aligned: position t belongs to sequence `seq_index[t]`.
    """

    logp: Tensor
    """[T] log pi_theta of the sampled tokens (current policy; requires grad)."""
    old_logp: Tensor
    """[T] log pi_old (the engine's log-probs by default, or recomputed by the trainer)."""
    advantages: Tensor
    """[S] per-sequence advantages, or [T] per-token ones (gspo_token, grpo)."""
    seq_index: Tensor
    """[T] int64 sequence id in 0..S-1 of each token (tokens of a sequence need not be
    contiguous: zig-zag CP shards are fine)."""
    mask: Tensor
    """[T] bool/0-1: 1 for response tokens that count; 0 for prompt, padding, masked."""
    num_seqs: int
    """S: number of sequences in the micro-batch (the same on every CP shard)."""
    rollout_logp: Tensor | None = None
    """[T] the engine's log-probs when `old_logp` was recomputed by the trainer (TIS, and the
    mismatch metrics); None means `old_logp` IS the engine's."""
    entropy: Tensor | None = None
    """[T] per-token entropy of pi_theta: metrics, and the entropy bonus (with grad) when
    loss.entropy_coef > 0."""
    ref_logp: Tensor | None = None
    """[T] log pi_ref of the reference model (the KL term and kl/mean; constant)."""
    advantages_per_token: bool | None = None
    """Whether `advantages` is [T]; None infers it from the shape (an error when S == T)."""
    trainer_old_logp: Tensor | None = None
    """[T] the trainer's log-probs at the rollout weights, for the mismatch masks when no other
    field holds them. None: `old_logp` if `rollout_logp` is given (pi_old recomputed), else the
    current `logp`, detached: exact on the first update after the rollout only."""

    def __post_init__(self) -> None:
        t = self.logp.shape
        if self.logp.dim() != 1:
            raise ValueError(f"logp must be 1-D [T], got {tuple(t)}")
        for name in ("old_logp", "seq_index", "mask", "rollout_logp", "entropy", "ref_logp",
                     "trainer_old_logp"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value.shape != t:
                raise ValueError(f"{name} must have shape [T]={tuple(t)}, got {value.shape}")
        if self.seq_index.dtype.is_floating_point:
            raise ValueError(f"seq_index must be an integer tensor, got {self.seq_index.dtype}")
        n_adv, n_tok = self.advantages.numel(), t[0]
        if self.advantages.dim() != 1 or n_adv not in (self.num_seqs, n_tok):
            raise ValueError(
                f"advantages must be [S]=({self.num_seqs},) or [T]=({n_tok},), "
                f"got {tuple(self.advantages.shape)}"
            )
        if self.advantages_per_token is None:
            if self.num_seqs == n_tok:
                raise ValueError("S == T: set advantages_per_token to say what advantages holds")
            self.advantages_per_token = n_adv == n_tok
        elif n_adv != (n_tok if self.advantages_per_token else self.num_seqs):
            raise ValueError(
                f"advantages_per_token={self.advantages_per_token} disagrees with advantages "
                f"shape {tuple(self.advantages.shape)}"
            )


class PolicyLossFn(Protocol):
    """The one signature every registered loss has (so callers never branch on the kind)."""

    def __call__(
        self,
        batch: PolicyLossInputs,
        cfg: PolicyLossConfig,
        *,
        denominator: float | Tensor,
        seq_sum: SeqSum = ...,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


def identity_seq_sum(x: Tensor) -> Tensor:
    """`seq_sum` on one rank (no context parallelism)."""
    return x


def cp_seq_sum(group: torch.distributed.ProcessGroup | None) -> SeqSum:
    """`seq_sum` for context parallelism: differentiable SUM all-reduce over the CP group.

    Its backward all-reduces the gradient, which is the exact adjoint when every CP rank
    back-propagates its own share of the loss (see the module docstring).
    """
    from torch.distributed.nn.functional import all_reduce

    return lambda x: all_reduce(x, group=group)


class _SeqStats(NamedTuple):
    """What every loss kind needs per sequence, after the one `seq_sum` call."""

    mask: Tensor  # [T] bool
    logp: Tensor  # [T] logp with masked positions zeroed (so garbage there cannot leak)
    old_logp: Tensor  # [T] likewise
    local_count: Tensor  # [S] response tokens of each sequence on this shard
    # NamedTuple's own `count` method is shadowed on purpose: the field is the natural name.
    count: Tensor  # type: ignore[assignment]  # [S] full-sequence response-token count
    valid: Tensor  # [S] bool: count > 0
    seq_log_ratio: Tensor  # [S] clamped mean log-ratio; carries grad iff requested
    inside_clamp: Tensor  # [S] bool: |mean log-ratio| <= clamp (gradient flows)
    engine_seq_log_ratio: Tensor  # [S] mean log(pi_theta / pi_engine), detached
    tis_seq: tuple[Tensor, Tensor] | None  # sequence-level TIS (weights [S], truncated [S])


def _metric(total: Tensor, count: Tensor) -> Tensor:
    # Summed in the input dtype, reported in float32 so the caller can stack all metrics.
    return torch.stack([total.detach().sum().float(), count.detach().sum().float()])


def _sequence_stats(
    batch: PolicyLossInputs, cfg: PolicyLossConfig, seq_sum: SeqSum, *, grad: bool
) -> _SeqStats:
    mask = batch.mask.bool()
    # At least float32: token counts and log-ratio sums in bf16 would be off past 256 tokens.
    dtype = torch.promote_types(batch.logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=batch.logp.device)
    # torch.where (not multiplication by the mask) so inf/NaN at masked positions gives 0
    # values and 0 gradients.
    logp = torch.where(mask, batch.logp.to(dtype), zero)
    old = torch.where(mask, batch.old_logp.detach().to(logp.dtype), zero)
    lr = logp - old if grad else (logp - old).detach()
    cols = [lr, mask.to(logp.dtype)]
    if batch.rollout_logp is not None:
        rollout = torch.where(mask, batch.rollout_logp.detach().to(logp.dtype), zero)
        cols.append((logp - rollout).detach())
        if cfg.tis_mode == "sequence":
            cols.append(old - rollout)
    per_tok = torch.stack(cols, dim=-1)  # [T, k]
    local = per_tok.new_zeros(batch.num_seqs, per_tok.shape[1]).index_add(
        0, batch.seq_index, per_tok
    )
    full = seq_sum(local)  # [S, k]: the single CP all-reduce of this micro-batch
    count = full[:, 1].detach()
    denom = count.clamp_min(1)
    mean_lr = full[:, 0] / denom
    c = cfg.log_ratio_clamp
    engine = full[:, 2].detach() / denom if batch.rollout_logp is not None else mean_lr.detach()
    tis_seq = None
    if cfg.tis_mode == "sequence":
        if batch.rollout_logp is None:
            raise ValueError("tis_mode='sequence' needs batch.rollout_logp (the engine log-probs)")
        tis_seq = tis_sequence_weights(full[:, 3], count, cap=cfg.tis_cap, log_ratio_clamp=c)
    return _SeqStats(
        mask=mask,
        logp=logp,
        old_logp=old,
        local_count=local[:, 1].detach(),
        count=count,
        valid=count > 0,
        seq_log_ratio=mean_lr.clamp(-c, c),
        inside_clamp=mean_lr.detach().abs() <= c,
        engine_seq_log_ratio=engine,
        tis_seq=tis_seq,
    )


def _clipped_objective(ratio: Tensor, adv: Tensor, cfg: PolicyLossConfig) -> Tensor:
    """min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A), elementwise."""
    assert cfg.eps_low is not None and cfg.eps_high is not None  # filled by __post_init__
    clipped = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    return torch.minimum(ratio * adv, clipped * adv)


def _clip_metrics(
    ratio: Tensor, adv: Tensor, where: Tensor, cfg: PolicyLossConfig
) -> dict[str, Tensor]:
    """Fractions of elements (sequences or tokens) where clipping is ACTIVE (zero gradient)."""
    assert cfg.eps_low is not None and cfg.eps_high is not None
    r, n = ratio.detach(), where.float()
    low = ((r < 1.0 - cfg.eps_low) & (adv < 0) & where).float()
    high = ((r > 1.0 + cfg.eps_high) & (adv > 0) & where).float()
    return {
        "policy/clip_frac_low": _metric(low, n),
        "policy/clip_frac_high": _metric(high, n),
        "policy/clip_frac": _metric(low + high, n),
        "policy/ratio": _metric(torch.where(where, r, 0), n),
        "policy/ratio_sq": _metric(torch.where(where, r * r, 0), n),
    }


def _common_metrics(
    batch: PolicyLossInputs, st: _SeqStats, cfg: PolicyLossConfig
) -> dict[str, Tensor]:
    m, mf = st.mask, st.mask.float()
    valid = st.valid.float()
    engine = batch.rollout_logp if batch.rollout_logp is not None else batch.old_logp
    lp = batch.logp.detach()
    assert cfg.eps_low is not None and cfg.eps_high is not None
    # Would the engine's sequence ratio alone already be clipped? The figure that says whether
    # engine log-probs are usable as pi_old (meaningful on the first mini-batch).
    outside = (st.engine_seq_log_ratio < math.log1p(-cfg.eps_low)) | (
        st.engine_seq_log_ratio > math.log1p(cfg.eps_high)
    )
    engine_abs = st.engine_seq_log_ratio.abs()
    out = {
        "policy/abs_log_ratio": _metric(torch.where(m, (lp - batch.old_logp).abs(), 0), mf),
        "policy/seq_log_ratio": _metric(st.seq_log_ratio.detach() * valid, valid),
        "policy/seq_log_ratio_abs": _metric(st.seq_log_ratio.detach().abs() * valid, valid),
        "mismatch/abs_logp_diff": _metric(torch.where(m, (lp - engine).abs(), 0), mf),
        "mismatch/seq_log_ratio_abs": _metric(engine_abs * valid, valid),
        "mismatch/seq_outside_clip": _metric(outside.float() * valid, valid),
        "policy/response_length": _metric(st.count, valid),
    }
    # The same two mismatch figures per response-length bin (measurement only).
    per_seq = {"mismatch/seq_outside_clip": outside, "mismatch/seq_log_ratio_abs": engine_abs}
    out |= by_length(per_seq, st.count, st.valid)
    if batch.rollout_logp is not None:
        diff = (batch.old_logp - batch.rollout_logp).abs()
        out["mismatch/old_rollout_abs_diff"] = _metric(torch.where(m, diff, 0), mf)
    if batch.entropy is not None:
        out["policy/entropy"] = _metric(torch.where(m, batch.entropy.detach(), 0), mf)
    if st.tis_seq is not None:
        w, cut = st.tis_seq
        out["tis/weight"] = _metric(w * valid, valid)
        out["tis/clip_frac"] = _metric(cut.float() * valid, valid)
    return out


def _check_denominator(denominator: float | Tensor) -> None:
    if isinstance(denominator, int | float) and not denominator > 0:
        raise ValueError(f"denominator={denominator}: must be the > 0 global normaliser")


def gspo_loss(
    batch: PolicyLossInputs,
    cfg: PolicyLossConfig,
    *,
    denominator: float | Tensor,
    seq_sum: SeqSum = identity_seq_sum,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: sequence-level ratio and clipping, one loss per sequence.

        s_i = exp(clamp(mean_t lr_{i,t}, +-c));   l_i = -min(s_i A_i, clip(s_i) A_i) * w_i
        loss = sum_i l_i * (n_i^local / |y_i|) / denominator

    `w_i` is the sequence-level TIS weight (1 without TIS). Unclipped, every token of y_i gets the
    same gradient -A_i s_i w_i / (|y_i| denominator). Needs per-sequence advantages [S].
    """
    _check_denominator(denominator)
    if batch.advantages_per_token:
        raise ValueError("kind='gspo' needs per-sequence advantages [S]; use kind='gspo_token'")
    st = _sequence_stats(batch, cfg, seq_sum, grad=True)
    adv = batch.advantages.detach().to(st.logp.dtype)
    ratio = st.seq_log_ratio.exp()
    seq_loss = -_clipped_objective(ratio, adv, cfg)
    if st.tis_seq is not None:
        seq_loss = seq_loss * st.tis_seq[0]  # w_i multiplies the whole per-sequence loss
    # This shard's share of l_i (1 without CP); 0 for sequences with no response token.
    # token_mean: l_i counts once per loss token, i.e. |y_i| * share = this shard's tokens.
    share = st.local_count
    if cfg.aggregation == "seq_mean":
        share = share / st.count.clamp_min(1)
    loss = (seq_loss * share).sum() / denominator
    metrics = _common_metrics(batch, st, cfg)
    metrics.update(_clip_metrics(ratio, adv, st.valid, cfg))
    return loss, metrics


def _token_level(
    batch: PolicyLossInputs,
    cfg: PolicyLossConfig,
    st: _SeqStats,
    ratio: Tensor,
    denominator: float | Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Shared tail of the token-level kinds: per-sequence mean of clipped token terms."""
    if batch.advantages_per_token:
        adv = batch.advantages.detach().to(ratio.dtype)
    else:
        adv = batch.advantages.detach().to(ratio.dtype)[batch.seq_index]
    term = -_clipped_objective(ratio, adv, cfg)  # [T]
    metrics = _common_metrics(batch, st, cfg)
    if cfg.tis_mode == "token":
        if batch.rollout_logp is None:
            raise ValueError("tis_mode='token' needs batch.rollout_logp (the engine log-probs)")
        w, cut = tis_token_weights(
            st.old_logp,
            torch.where(st.mask, batch.rollout_logp.to(ratio.dtype), 0),
            cap=cfg.tis_cap,
            log_ratio_clamp=cfg.log_ratio_clamp,
        )
        term = term * w  # w_{i,t} multiplies each token term
        mf = st.mask.float()
        metrics["tis/weight"] = _metric(torch.where(st.mask, w, 0), mf)
        metrics["tis/clip_frac"] = _metric((cut & st.mask).float(), mf)
    elif st.tis_seq is not None:
        term = term * st.tis_seq[0][batch.seq_index]  # w_i multiplies l_i, i.e. all its terms
    # 1/|y_i| with |y_i| the FULL sequence count, so shards' partial sums add up to the mean;
    # token_mean: every token term weighs 1.
    if cfg.aggregation == "seq_mean":
        term = term * (1.0 / st.count.clamp_min(1))[batch.seq_index]
    loss = torch.where(st.mask, term, 0).sum() / denominator
    metrics.update(_clip_metrics(ratio, adv, st.mask, cfg))
    return loss, metrics


def gspo_token_loss(
    batch: PolicyLossInputs,
    cfg: PolicyLossConfig,
    *,
    denominator: float | Tensor,
    seq_sum: SeqSum = identity_seq_sum,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token: GSPO's sequence ratio with per-token advantages (stop-gradient form).

        s_{i,t} = sg[s_i] * exp(logp_t - sg[logp_t])          (numerically s_i)
        l_i = (1/|y_i|) sum_t -min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t}) * w
        loss = sum_i l_i / denominator   (this shard's tokens' part of it under CP)

    With A_{i,t} = A_i it equals GSPO in value and gradient, including where the log-ratio clamp
    is active (the gradient is then 0 in both). Advantages may be [S] or [T].
    """
    _check_denominator(denominator)
    st = _sequence_stats(batch, cfg, seq_sum, grad=False)
    s_i = st.seq_log_ratio.exp()[batch.seq_index]  # sg[s_i]: built from detached sums
    # exp(x - sg[x]) == 1 with d/dx == 1; zeroed where GSPO's clamp zeroes the gradient.
    live = st.inside_clamp[batch.seq_index].to(st.logp.dtype)
    ratio = s_i * torch.exp((st.logp - st.logp.detach()) * live)
    return _token_level(batch, cfg, st, ratio, denominator)


def grpo_loss(
    batch: PolicyLossInputs,
    cfg: PolicyLossConfig,
    *,
    denominator: float | Tensor,
    seq_sum: SeqSum = identity_seq_sum,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO: token ratio w_{i,t} = exp(clamp(lr_{i,t}, +-c)), per-sequence mean of token terms.

    l_i = (1/|y_i|) sum_t -min(w_{i,t} A_{i,t}, clip(w_{i,t}) A_{i,t}) * w^TIS
    loss = sum_i l_i / denominator   (this shard's tokens' part of it under CP)
    """
    _check_denominator(denominator)
    st = _sequence_stats(batch, cfg, seq_sum, grad=False)
    c = cfg.log_ratio_clamp
    ratio = (st.logp - st.old_logp).clamp(-c, c).exp()
    return _token_level(batch, cfg, st, ratio, denominator)


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "grpo": grpo_loss,
}
"""The one place an algorithm name maps to code."""


def policy_loss(
    batch: PolicyLossInputs,
    cfg: PolicyLossConfig,
    *,
    denominator: float | Tensor,
    seq_sum: SeqSum = identity_seq_sum,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dispatch to `POLICY_LOSSES[cfg.kind]`; see the module docstring for the contract.

    Returns (loss: scalar, this micro-batch's share of the global mean over sequences;
    metrics: name -> float32 [sum, count]).

    With loss.seq_mismatch_mask / loss.token_mismatch_mask the loss sees only the kept tokens
    (a masked sequence: none; it still counts in `denominator`), while the metrics that describe
    the rollout (mismatch/*, policy/entropy, policy/response_length) stay over every token.
    """
    fn = POLICY_LOSSES[cfg.kind]
    if cfg.seq_mismatch_mask is None and cfg.token_mismatch_mask is None:
        return fn(batch, cfg, denominator=denominator, seq_sum=seq_sum)
    keep, extra = mismatch_masks(batch, cfg, seq_sum)
    loss, metrics = fn(
        dataclasses.replace(batch, mask=keep), cfg, denominator=denominator, seq_sum=seq_sum
    )
    whole = _common_metrics(batch, _sequence_stats(batch, cfg, seq_sum, grad=False), cfg)
    rollout = ("mismatch/", "policy/entropy", "policy/response_length")
    return loss, metrics | {k: v for k, v in whole.items() if k.startswith(rollout)} | extra
