"""`TrainSequence`: one sampled response in the form the loss consumes (plain data, no torch).

It is the hand-over between the RL side (`rollout/experience.py` builds them from engine
samples and advantages) and the trainer (`megatron/packing.py` packs them into micro-batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type only: the fields may be tensor views (megatron/transfer.py)
    from torch import Tensor


@dataclass(kw_only=True)
class TrainSequence:
    """One sampled response with what the loss needs. Per-token fields are lists on rank 0;
    on the ranks that receive the rollout, 1-D tensor views of the broadcast buffer
    (megatron/transfer.py), which `megatron.packing.pack` reads alike."""

    seq_id: int
    """Global index of the sequence in its rollout batch (for reassembly and metrics)."""
    prompt_ids: Sequence[int] | Tensor
    response_ids: Sequence[int] | Tensor
    old_logp: Sequence[float] | Tensor
    """pi_old log-probs of the response tokens (the engine's, or recomputed)."""
    advantage: float | Sequence[float] | Tensor
    """Per-sequence advantage, or per response token (GSPO-token)."""
    loss_mask: Sequence[int] | Tensor | None = None
    """1 = the token counts in the loss; None = all response tokens count."""
    rollout_logp: Sequence[float] | Tensor | None = None
    """Engine log-probs when `old_logp` was recomputed (truncated importance correction)."""
    trainer_old_logp: Sequence[float] | Tensor | None = None
    """The trainer's log-probs at the rollout weights when pi_old is the engine's and a
    mismatch mask needs them (loss.seq_mismatch_mask), filled by the policy before the update."""
    ref_logp: Sequence[float] | Tensor | None = None
    """Reference-model log-probs (loss.kl_coef > 0), filled by the policy before the update."""
    reward: float | None = None
    """The sequence's reward and its group (an id shared by the group's members): what
    loss.kl_in_reward needs to recompute the advantage after the KL penalty."""
    group: int | None = None
    routed_experts: Tensor | None = None
    """`[P + R - 1, L, K]` expert ids the engine routed each prompt and response token to (the
    last response token has none), replayed by the trainer with `rl.routing_replay` (a study
    control); None: the trainer routes itself (the default)."""

    def __post_init__(self) -> None:
        r = len(self.response_ids)
        if self.routed_experts is not None and len(self.routed_experts) != self.length - 1:
            raise ValueError(
                f"sequence {self.seq_id}: routed_experts has {len(self.routed_experts)} rows "
                f"for {self.length} tokens (expected one per token but the last)"
            )
        if len(self.prompt_ids) == 0:  # a tensor has no truth value
            raise ValueError(f"sequence {self.seq_id}: empty prompt")
        for name in ("old_logp", "loss_mask", "rollout_logp", "ref_logp", "trainer_old_logp"):
            v = getattr(self, name)
            if v is not None and len(v) != r:
                raise ValueError(
                    f"sequence {self.seq_id}: {name} has {len(v)} entries for {r} response tokens"
                )
        if not isinstance(self.advantage, float | int) and len(self.advantage) != r:
            raise ValueError(f"sequence {self.seq_id}: per-token advantage length mismatch")

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)
