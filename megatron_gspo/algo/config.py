"""The `loss:` config section (`PolicyLossConfig`) and its checks: no torch, so that
`megatron_gspo.config` (and the planner, `python -m megatron_gspo.plan`) load without it.
The losses themselves, with their math, are in losses.py (arXiv 2507.18071)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from megatron_gspo.config_io import require

__all__ = ["LOGPROB_CHUNK", "VOCAB_CHUNK", "PolicyLossConfig", "check_mismatch_bounds"]

# The LM head's log-prob chunks (algo/lm_head.py): tokens per chunk and vocabulary rows per
# block; the trainer's (megatron/step.py) and the planner's memory estimate (plan_memory.py).
LOGPROB_CHUNK, VOCAB_CHUNK = 1024, 8192

PolicyLossKind = Literal["gspo", "gspo_token", "grpo"]
TisMode = Literal["none", "token", "sequence"]
Aggregation = Literal["seq_mean", "token_mean"]

# (eps_low, eps_high): GSPO's from the paper's experiments; GRPO's are the paper's baseline
# (DAPO-style clip-higher).
_DEFAULT_EPS: dict[str, tuple[float, float]] = {
    "gspo": (3e-4, 4e-4),
    "gspo_token": (3e-4, 4e-4),
    "grpo": (0.2, 0.27),
}


@dataclass(kw_only=True, slots=True)
class PolicyLossConfig:
    """Which policy loss to use and its knobs. Paper: https://arxiv.org/abs/2507.18071."""

    kind: PolicyLossKind = "gspo"
    """Loss family: "gspo" (sequence ratio, sequence clipping), "gspo_token" (GSPO's ratio with
    per-token advantages, stop-gradient form) or "grpo" (token ratio; the baseline)."""
    eps_low: float | None = None
    """Lower clip half-width: ratios below 1 - eps_low stop pushing down a negative advantage.
    None -> 3e-4 for gspo/gspo_token, 0.2 for grpo."""
    eps_high: float | None = None
    """Upper clip half-width: ratios above 1 + eps_high stop pushing up a positive advantage.
    None -> 4e-4 for gspo/gspo_token, 0.27 for grpo."""
    log_ratio_clamp: float = 10.0
    """|log ratio| bound applied before `exp` (to the sequence mean for GSPO, per token for
    GRPO) so one garbage sequence cannot produce inf/NaN; beyond it the gradient is 0."""
    tis_mode: TisMode = "none"
    """Truncated importance correction pi_old / pi_rollout (needs `rollout_logp`): "token"
    multiplies each token term (gspo_token, grpo), "sequence" multiplies l_i by the capped
    geometric-mean sequence ratio. Useful when pi_old is recomputed by the trainer."""
    tis_cap: float = 2.0
    """Upper truncation of the importance weight (> 0)."""
    aggregation: Aggregation = "seq_mean"
    """How token terms become the loss: "seq_mean" (every sequence weighs the same: the GSPO
    paper's mean over sequences) or "token_mean" (every loss token weighs the same, DAPO,
    https://arxiv.org/abs/2503.14476). Applies to the KL and entropy terms as well."""
    kl_coef: float = 0.0
    """beta of the reference-model KL KL(pi_theta || pi_ref) (0: no reference model is built).
    pi_ref is a frozen copy of the initial policy; see loss.kl_estimator, loss.kl_in_reward."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman, http://joschu.net/blog/kl-approx.html), with
    d = log pi_ref - log pi_theta: k1 = -d, k2 = d^2/2, k3 = exp(d) - 1 - d."""
    kl_in_reward: bool = False
    """false: the KL is a loss term, + kl_coef * (aggregated) KL. true: a reward penalty,
    r_i - kl_coef * sum_t KL_t of pi_old vs pi_ref, then the group advantages again (over the
    kept responses when loss.mask_truncated is on)."""
    ref_offload: bool = False
    """Keep the reference model's weights in host memory between uses (moved to the device for
    its one forward per rollout step); false keeps it on the device. Needs loss.kl_coef > 0."""
    entropy_coef: float = 0.0
    """Entropy bonus: - entropy_coef * (aggregated) per-token entropy of pi_theta (0: off)."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: truncated responses (no stop token) are left out of the loss
    (their group's advantages are computed with them); counted in loss/truncated_masked."""
    seq_mismatch_mask: list[float] | None = None
    """[low, high] or null (off): leave a sequence out of the policy loss when its engine vs
    trainer geometric-mean ratio exp(mean_t(logp_trainer - logp_engine)) leaves [low, high]
    (algo/mismatch.py; NeMo-RL's MoE recipe: [0.999, 1.002]). logp_trainer is the trainer's at
    the rollout weights: free with rl.pi_old=recompute or one mini-batch; with rl.pi_old=engine
    the later mini-batches cost one extra trainer forward of their sequences per rollout
    ((n-1)/n of one forward, time/mismatch_logp_s). Counted in loss/seq_mismatch_masked."""
    token_mismatch_mask: list[float] | None = None
    """[low, high] or null (off): IcePop-style, leave a response token out of the policy loss
    when exp(logp_trainer - logp_engine) leaves [low, high] (same logp_trainer and cost as
    loss.seq_mismatch_mask). Counted in loss/token_mismatch_masked."""

    def __post_init__(self) -> None:
        # Messages name the `loss.*` config keys: this class is that config section.
        require(
            self.kind in _DEFAULT_EPS,
            f"loss.kind={self.kind!r} is not one of {sorted(_DEFAULT_EPS)}; change loss.kind",
        )
        default_low, default_high = _DEFAULT_EPS[self.kind]
        if self.eps_low is None:
            self.eps_low = default_low
        if self.eps_high is None:
            self.eps_high = default_high
        require(
            0.0 <= self.eps_low < 1.0,
            f"loss.eps_low={self.eps_low} must be in [0, 1); change loss.eps_low",
        )
        require(self.eps_high >= 0.0, f"loss.eps_high={self.eps_high} must be >= 0")
        require(
            self.log_ratio_clamp > 0.0,
            f"loss.log_ratio_clamp={self.log_ratio_clamp} must be > 0; change it",
        )
        require(
            self.tis_mode in ("none", "token", "sequence"),
            f"loss.tis_mode={self.tis_mode!r} is not none, token or sequence",
        )
        require(
            not (self.tis_mode == "token" and self.kind == "gspo"),
            "loss.tis_mode=token needs per-token loss terms, which loss.kind=gspo does not "
            "have; use loss.tis_mode=sequence or loss.kind=gspo_token",
        )
        require(self.tis_cap > 0.0, f"loss.tis_cap={self.tis_cap} must be > 0")
        require(
            self.aggregation in ("seq_mean", "token_mean"),
            f"loss.aggregation={self.aggregation!r} is not seq_mean or token_mean",
        )
        require(
            self.kl_estimator in ("k1", "k2", "k3"),
            f"loss.kl_estimator={self.kl_estimator!r} is not k1, k2 or k3",
        )
        for name in ("kl_coef", "entropy_coef"):
            v = getattr(self, name)
            require(v >= 0.0, f"loss.{name}={v} must be >= 0; change loss.{name}")
        require(
            self.kl_coef > 0 or not (self.kl_in_reward or self.ref_offload),
            "loss.kl_in_reward / loss.ref_offload act on the reference model, which only "
            "loss.kl_coef > 0 builds; set loss.kl_coef or leave them false",
        )
        check_mismatch_bounds("loss.seq_mismatch_mask", self.seq_mismatch_mask)
        check_mismatch_bounds("loss.token_mismatch_mask", self.token_mismatch_mask)


def check_mismatch_bounds(key: str, bounds: Sequence[float] | None) -> None:
    """Config check of a `[low, high]` mask (None = off): 0 < low <= 1 <= high, low < high;
    raises a ConfigError naming `key`."""
    if bounds is None:
        return
    require(
        len(bounds) == 2 and 0.0 < bounds[0] <= 1.0 <= bounds[1] and bounds[0] < bounds[1],
        f"{key}={list(bounds)} must be [low, high] with 0 < low <= 1 <= high and low < high "
        f"(e.g. [0.999, 1.002]), or null for off; change {key}",
    )
