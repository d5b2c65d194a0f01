"""Pure numerics of the RL update: advantages, policy losses, importance correction, log-probs.

Functions of tensors only (torch and torch.distributed; process groups are passed in
explicitly). Nothing here imports Megatron, so all of it is testable on CPU.
"""

from megatron_gspo.algo.advantages import group_advantages, token_advantages
from megatron_gspo.algo.correction import tis_sequence_weights, tis_token_weights
from megatron_gspo.algo.lm_head import fused_lm_head_logprobs
from megatron_gspo.algo.logprobs import vocab_parallel_logprobs
from megatron_gspo.algo.losses import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossFn,
    PolicyLossInputs,
    cp_seq_sum,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
    identity_seq_sum,
    policy_loss,
)
from megatron_gspo.algo.mismatch import (
    mismatch_keep_mask,
    sequence_mismatch_keep,
    token_mismatch_keep,
)
from megatron_gspo.algo.regularizers import (
    aggregation_weights,
    kl_estimate,
    overlong_penalty,
    regularized_loss,
    sequence_kl,
)

__all__ = [
    "POLICY_LOSSES",
    "PolicyLossConfig",
    "PolicyLossFn",
    "PolicyLossInputs",
    "aggregation_weights",
    "cp_seq_sum",
    "fused_lm_head_logprobs",
    "group_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "identity_seq_sum",
    "kl_estimate",
    "mismatch_keep_mask",
    "overlong_penalty",
    "policy_loss",
    "regularized_loss",
    "sequence_kl",
    "sequence_mismatch_keep",
    "tis_sequence_weights",
    "tis_token_weights",
    "token_advantages",
    "token_mismatch_keep",
    "vocab_parallel_logprobs",
]
