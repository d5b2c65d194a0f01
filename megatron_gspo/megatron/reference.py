"""The reference model of the KL term (loss.kl_coef > 0): a frozen copy of the initial policy.

Built by the same adapter as the policy (`make_provider` / `build_model`) at the same layout, so
each rank holds exactly the shards of the policy chunks it mirrors; no DDP wrapper and no
optimizer (it never trains). Its weights are copied from the policy's chunks when the policy is
built, before any checkpoint is loaded: on a resume the copy is again the initial policy (the
HF weights, or the seeded initialisation, as in the first run).

`loss.ref_offload`: the weights live in host memory between uses and come to the device for the
one forward per rollout step (`TrainerOffload`, storage level: the same tensors refilled).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_gspo.megatron import step as mstep
from megatron_gspo.megatron.config import PolicySpec
from megatron_gspo.megatron.model import build_model, make_provider
from megatron_gspo.megatron.offload import TrainerOffload
from megatron_gspo.megatron.packing import PackedMicroBatch

if TYPE_CHECKING:
    from megatron.bridge import AutoBridge

__all__ = ["ReferenceModel"]


def _inner(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model under megatron-core's DDP / Float16Module wrappers (same keys either way)."""
    while isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module  # type: ignore[assignment]
    return chunk


@dataclass
class ReferenceModel:
    """pi_ref on this rank: model chunks of the policy's layout, frozen."""

    model: list[torch.nn.Module]
    offload: bool = False
    _mem: TrainerOffload | None = field(default=None, repr=False)

    @classmethod
    def from_policy(
        cls,
        bridge: AutoBridge,
        spec: PolicySpec,
        policy_model: Sequence[torch.nn.Module],
        *,
        offload: bool,
    ) -> ReferenceModel:
        """Build the chunks for `spec.parallel` / `spec.model` and copy `policy_model` into them."""
        model = build_model(make_provider(bridge, spec.parallel, spec.model), ddp_config=None)
        for chunk, pol in zip(model, policy_model, strict=True):
            ref_inner = _inner(chunk)
            # strict: the same adapter and layout give the same parameter set on this rank.
            ref_inner.load_state_dict(_inner(pol).state_dict(), strict=True)
            ref_inner.requires_grad_(False)
        out = cls(model, offload=offload)
        if offload:
            # Parameters only: there are no gradients or optimizer state.
            out._mem = TrainerOffload(model, None, grads=False, optimizer_state=False)
            out._mem.offload()
        return out

    def logprobs(
        self, micro_batches: Sequence[PackedMicroBatch], *, temperature: float
    ) -> dict[int, torch.Tensor]:
        """log pi_ref of every response token of the mini-batch (`step.compute_logprobs`:
        `{seq_id: [R] float64}`, identical on every rank). A collective over the job."""
        if self._mem is not None:
            self._mem.reload()
        try:
            return mstep.compute_logprobs(self.model, micro_batches, temperature=temperature)
        finally:
            if self._mem is not None:
                self._mem.offload()
