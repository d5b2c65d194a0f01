"""Pure numerics of the RL update: advantages, policy losses, importance correction, log-probs.

Functions of tensors only (torch and torch.distributed; process groups are passed in
explicitly). Nothing here imports Megatron, so all of it is testable on CPU.

The names below load on first use (PEP 562 `__getattr__`): `megatron_gspo.algo.config`, the
`loss:` config section, imports no torch, so `megatron_gspo.config` and the planner load
without it; `from megatron_gspo.algo import gspo_loss` works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for type checkers; loaded lazily below
    from megatron_gspo.algo.advantages import group_advantages, token_advantages
    from megatron_gspo.algo.config import PolicyLossConfig
    from megatron_gspo.algo.correction import tis_sequence_weights, tis_token_weights
    from megatron_gspo.algo.lm_head import fused_lm_head_logprobs
    from megatron_gspo.algo.logprobs import vocab_parallel_logprobs
    from megatron_gspo.algo.losses import (
        POLICY_LOSSES,
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

# name -> the module of this package that defines it
_WHERE = {
    "group_advantages": "advantages",
    "token_advantages": "advantages",
    "PolicyLossConfig": "config",
    "tis_sequence_weights": "correction",
    "tis_token_weights": "correction",
    "fused_lm_head_logprobs": "lm_head",
    "vocab_parallel_logprobs": "logprobs",
    "POLICY_LOSSES": "losses",
    "PolicyLossFn": "losses",
    "PolicyLossInputs": "losses",
    "cp_seq_sum": "losses",
    "grpo_loss": "losses",
    "gspo_loss": "losses",
    "gspo_token_loss": "losses",
    "identity_seq_sum": "losses",
    "policy_loss": "losses",
    "mismatch_keep_mask": "mismatch",
    "sequence_mismatch_keep": "mismatch",
    "token_mismatch_keep": "mismatch",
    "aggregation_weights": "regularizers",
    "kl_estimate": "regularizers",
    "overlong_penalty": "regularizers",
    "regularized_loss": "regularizers",
    "sequence_kl": "regularizers",
}
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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # once: later look-ups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
