"""The policy-gradient step on megatron-core: forward_step_func, loss, optimizer step, log-probs.

Uses megatron-core's public schedule contract: `get_forward_backward_func()` (no pipelining,
1F1B or interleaved, chosen by the layout) calls our `forward_step(data_iterator, model)`, which
returns the model output and a loss function; the loss function returns
`(loss, num_tokens, reduced)`.

Reduction: the models are built with `calculate_per_token_loss=True`. Megatron then SUMS the
micro-batch losses over micro-batches and data-parallel ranks, sums the `num_tokens` counts over
micro-batches, pipeline stages and the DP x CP group, and divides the gradients by that total
(`finalize_model_grads`). We put the number of SEQUENCES in `num_tokens` (counted on CP rank 0
only) and return the SUM of per-sequence losses (each CP shard its share, see
`megatron_gspo.algo.losses`), so the gradient is that of the mean over the sequences of the
global mini-batch: every sequence weighs the same whatever its length, micro-batch, DP rank,
CP split or pipeline schedule. With `loss.aggregation=token_mean` `num_tokens` is what its name
says, this shard's loss tokens (every CP rank counts its own), and the loss the sum of token
terms: the gradient is that of the mean over the loss tokens of the global mini-batch.

LM head: with `StepConfig.fused_lm_head` (the default) the model's output layer is replaced, per
call, through megatron-core's own `output_processor` hook of `GPTModel.forward` (no patch): it
receives the final hidden states and the output (or tied embedding) weight and returns
`(logp, entropy)` from `megatron_gspo.algo.fused_lm_head_logprobs`, so no [T, Vp] logits exist
on the last stage in either pass; its logits are fp32 from the bf16 GEMM, as the engines' fp32
LM head (`rollout.launch.fp32_lm_head`) computes them. Otherwise the output layer's logits (in
the model's dtype) go through the chunked `vocab_parallel_logprobs`. Either way `Float16Module`
is asked not to upcast its output (`fp32_output=False`): the log-prob ops upcast per chunk
themselves.

Shape legend: `T` packed tokens of a micro-batch on this CP shard, `H` hidden size, `Vp` vocab
shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from megatron_gspo import dist
from megatron_gspo.algo import (
    PolicyLossConfig,
    PolicyLossInputs,
    cp_seq_sum,
    fused_lm_head_logprobs,
    identity_seq_sum,
    regularized_loss,
    vocab_parallel_logprobs,
)
from megatron_gspo.algo.config import LOGPROB_CHUNK, VOCAB_CHUNK
from megatron_gspo.layout import Layout
from megatron_gspo.megatron import replay
from megatron_gspo.megatron.packing import (
    PackedMicroBatch,
    TrainSequence,
    pad_multiple,
    plan_micro_batches,
)
from megatron_gspo.megatron.transfer import gather_logprob_rows, logprobs_by_sequence

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    """What the loss needs besides the data."""

    loss: PolicyLossConfig
    temperature: float = 1.0
    """Sampling temperature: log-probs are of logits / temperature, as the engine's are."""
    logprob_chunk: int = LOGPROB_CHUNK
    """Tokens per chunk of the vocab-parallel log-softmax (fused or not)."""
    fused_lm_head: bool = True
    """Fuse the output layer into the log-prob op (no logits materialised); false: the output
    layer's logits, then the chunked log-softmax."""
    vocab_chunk: int = VOCAB_CHUNK
    """Vocab rows of the output weight per block of the fused LM head."""


# What the model returns on the last stage: the output layer's [1, T, Vp] logits, or the fused
# head's (logp [T], entropy [T]).
ModelOutput = Tensor | tuple[Tensor, Tensor]


def _groups() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    return dict(
        tp=tp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
        cp=cp,
        cp_group=ps.get_context_parallel_group() if cp > 1 else None,
        cp_rank=ps.get_context_parallel_rank(),
    )


def _logprobs(output: ModelOutput, mb: PackedMicroBatch, cfg: StepConfig) -> tuple[Tensor, Tensor]:
    if isinstance(output, tuple):  # the fused head already computed them
        return output
    g = _groups()
    logits = output.reshape(-1, output.size(-1))  # [1, T, Vp] -> [T, Vp]
    logp, entropy = vocab_parallel_logprobs(
        logits,
        mb.labels,
        group=g["tp_group"],
        vocab_start=g["tp_rank"] * logits.size(-1),
        temperature=cfg.temperature,
        chunk_size=cfg.logprob_chunk,
        with_entropy=True,
    )
    assert entropy is not None  # asked for with_entropy
    return logp, entropy


def _policy_loss(mb: PackedMicroBatch, cfg: StepConfig, output: ModelOutput) -> tuple[Any, ...]:
    logp, entropy = _logprobs(output, mb, cfg)
    g = _groups()
    # The entropy bonus differentiates the per-token entropy; otherwise it is a metric only.
    if cfg.loss.entropy_coef == 0:
        entropy = entropy.detach()
    batch = PolicyLossInputs(
        logp=logp,
        old_logp=mb.old_logp,
        advantages=mb.advantages,
        advantages_per_token=mb.advantages_per_token,
        seq_index=mb.seq_index,
        mask=mb.mask,
        num_seqs=mb.num_seqs,
        rollout_logp=mb.rollout_logp,
        trainer_old_logp=mb.trainer_old_logp,
        entropy=entropy,
        # A padding micro-batch (no sequence, nothing masked in) has no reference log-probs.
        ref_logp=mb.ref_logp
        if mb.ref_logp is not None or mb.seq_ids != [-1] or cfg.loss.kl_coef == 0
        else torch.zeros_like(logp.detach()),
    )
    seq_sum = cp_seq_sum(g["cp_group"]) if g["cp"] > 1 else identity_seq_sum
    # Sum of per-sequence (per-token) losses; Megatron divides by the global sequence (loss
    # token) count, our `num_tokens`.
    loss, metrics = regularized_loss(batch, cfg.loss, denominator=1.0, seq_sum=seq_sum)
    # On the loss's device: megatron-core sums it into its own device counter and all-reduces.
    if cfg.loss.aggregation == "token_mean":  # this CP shard's loss tokens: the shards add up
        num_seqs = mb.mask.bool().sum().to(device=loss.device, dtype=torch.int)
    else:
        real = sum(1 for i in mb.seq_ids if i >= 0) if g["cp_rank"] == 0 else 0
        num_seqs = torch.tensor(real, dtype=torch.int, device=loss.device)
    return (
        loss,
        num_seqs,
        {"metrics": metrics, "loss": loss.detach().clone(), "num_seqs": num_seqs.clone()},
    )


def plan_for_this_rank(
    seqs: Sequence[TrainSequence], layout: Layout, max_tokens: int
) -> list[PackedMicroBatch]:
    """This rank's packed micro-batches of a mini-batch every rank holds whole: its DP share,
    its CP shard, padded for sequence parallelism, and as many micro-batches as every other DP
    rank (a multiple of pp for the interleaved schedule), on the job's device (`dist.device()`:
    the model's inputs and the loss's inputs must live with the model)."""
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    planned = plan_micro_batches(
        seqs,
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        max_tokens=max_tokens,
        multiple=pad_multiple(layout.tp, cp, layout.sp),
        cp_size=cp,
        cp_rank=ps.get_context_parallel_rank(),
        count_multiple=layout.pp if layout.vpp else 1,
    )
    # Packed on the host (cheap Python bookkeeping), moved once here, the one place every
    # caller (train step, log-prob recompute, routing probe) gets its micro-batches from.
    return [mb.to(dist.device()) for mb in planned]


def _fused_head(
    mb: PackedMicroBatch,
    cfg: StepConfig,
    *,
    hidden_states: Tensor,
    output_layer: ColumnParallelLinear,
    output_weight: Tensor | None,
    config: TransformerConfig,
    **_: object,
) -> tuple[Tensor, Tensor]:
    """megatron-core `output_processor`: the fused output layer + log-probs + entropy from the
    final hidden states [S(/tp under SP), 1, H] and the output weight shard [Vp, H]."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    if getattr(config, "use_mup", False) or getattr(output_layer, "bias", None) is not None:
        raise ValueError(
            "model.fused_lm_head=true supports an output layer without bias or MuP logit "
            "scaling; set model.fused_lm_head=false for this model"
        )
    g = _groups()
    weight = output_weight if output_weight is not None else output_layer.weight
    sp = g["tp"] > 1 and output_layer.sequence_parallel
    if sp:
        # As the column-parallel layer does: all-gather the sequence shards; its backward
        # reduce-scatters the per-vocab-shard hidden gradients.
        hidden_states = gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=True, group=g["tp_group"]
        )
    logp, entropy = fused_lm_head_logprobs(
        hidden_states.reshape(-1, hidden_states.size(-1)),  # [S, 1, H] -> [T, H]
        weight,
        mb.labels,
        group=g["tp_group"],
        vocab_start=g["tp_rank"] * weight.size(0),
        temperature=cfg.temperature,
        chunk_size=cfg.logprob_chunk,
        vocab_chunk=cfg.vocab_chunk,
        with_entropy=True,
        reduce_grad_hidden=not sp,  # without SP the hidden states are TP-replicated
    )
    assert entropy is not None
    return logp, entropy


def _skip_head(*, hidden_states: Tensor, **_: object) -> Tensor:
    """megatron-core `output_processor` for forward passes that need no log-probs."""
    return hidden_states


def _has_float16_wrapper(model: torch.nn.Module) -> bool:
    from megatron.core.transformer.module import Float16Module

    m: object = model
    while m is not None:
        if isinstance(m, Float16Module):
            return True
        m = getattr(m, "module", None)
    return False


def _forward(
    model: torch.nn.Module, mb: PackedMicroBatch, cfg: StepConfig | None = None
) -> ModelOutput:
    """The model on one micro-batch; on the last stage: the fused head's (logp, entropy) when
    `cfg.fused_lm_head`, the output layer's logits when not, the final hidden states (no LM
    head at all) when `cfg` is None."""
    g = _groups()
    kwargs: dict[str, Any] = {"packed_seq_params": mb.packed_seq_params(g["cp_group"])}
    if cfg is None:
        kwargs["output_processor"] = _skip_head
    elif cfg.fused_lm_head:
        kwargs["output_processor"] = partial(_fused_head, mb, cfg)
    if _has_float16_wrapper(model):
        kwargs["fp32_output"] = False  # no fp32 copy of the logits: the log-prob ops upcast
    if mb.routed_experts is not None or getattr(model, "_replay_armed", False):
        model._replay_armed = replay.arm(model, mb.routed_experts) > 0  # type: ignore[assignment]
    return model(mb.input_ids, mb.position_ids, None, **kwargs)


def policy_forward_step(
    data_iterator: Iterator[PackedMicroBatch], model: torch.nn.Module, *, cfg: StepConfig
) -> tuple[ModelOutput, Any]:
    """megatron-core `forward_step_func` for the policy loss (bind `cfg` with partial)."""
    mb = next(data_iterator)
    return _forward(model, mb, cfg), partial(_policy_loss, mb, cfg)


def _iterators(
    model: list[torch.nn.Module], mbs: Sequence[PackedMicroBatch]
) -> Iterator[PackedMicroBatch] | list[Iterator[PackedMicroBatch]]:
    its = [iter(mbs) for _ in model]
    return its if len(model) > 1 else its[0]


def reduce_metrics(outputs: list[dict[str, Any]]) -> dict[str, float]:
    """Sum the per-micro-batch [sum, count] metrics over micro-batches, then over every rank
    that computed some (last pipeline stage, all DP and CP ranks; TP ranks are duplicates and
    are counted once); return sum / count per name, and `loss` as the mean over sequences (over
    loss tokens with loss.aggregation=token_mean).
    Identical on every rank."""
    from megatron.core import parallel_state as ps

    names = sorted({k for o in outputs for k in o["metrics"]})
    # Collectives run on the job's device (NCCL needs CUDA tensors, gloo CPU ones).
    stacked = torch.zeros(len(names) + 1, 2, dtype=torch.float64, device=dist.device())
    for o in outputs:
        for i, k in enumerate(names):
            if k in o["metrics"]:
                stacked[i] += o["metrics"][k].to(stacked)
        stacked[-1, 0] += o["loss"].to(stacked)
        stacked[-1, 1] += o["num_seqs"].to(stacked)
    # Names can differ between stages (non-last stages have none): agree on them first.
    all_names: list[list[str]] = [None] * torch.distributed.get_world_size()  # type: ignore
    torch.distributed.all_gather_object(all_names, names)
    union = sorted({k for ns in all_names for k in ns})
    full = torch.zeros(len(union) + 1, 2, dtype=torch.float64, device=dist.device())
    for i, k in enumerate(names):
        full[union.index(k)] = stacked[i]
    full[-1] = stacked[-1]
    if ps.get_tensor_model_parallel_rank() != 0:
        full.zero_()
    torch.distributed.all_reduce(full)
    # A metric no rank measured (count 0) is absent: NaN means a non-finite value, nothing else.
    out = {k: (full[i, 0] / full[i, 1]).item() for i, k in enumerate(union) if full[i, 1] > 0}
    out["loss"] = (full[-1, 0] / full[-1, 1].clamp(min=1)).item()  # mean over sequences
    return out


class UpdateOverflow(RuntimeError):
    """The optimizer's step size does not fit in the parameters' dtype (exit code 3)."""


def train_step(
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer,
    micro_batches: Sequence[PackedMicroBatch],
    cfg: StepConfig,
) -> dict[str, float]:
    """One optimizer step over this rank's micro-batches. Returns reduced metrics, the global
    loss (sum over ranks of the shares), the grad norm and whether the step was applied."""
    for chunk in model:
        chunk.zero_grad_buffer()  # type: ignore[operator]  # megatron-core DDP chunks
    optimizer.zero_grad()
    outputs = _schedule(model, micro_batches, partial(policy_forward_step, cfg=cfg), False)
    metrics = reduce_metrics(outputs)
    # megatron-core's fp32 optimizers never look for inf/NaN (only its loss-scaled fp16 path
    # does), and clipping by a NaN norm would write NaN into every weight: check every rank's
    # gradients and the global loss, and skip the step everywhere if any is not finite.
    if math.isfinite(metrics["loss"]) and grads_finite(model):
        try:
            ok, grad_norm, _ = optimizer.step()
        except RuntimeError as e:  # torch: a step size past float32's range (optim.lr=1e38)
            if "without overflow" not in str(e):
                raise
            lr = optimizer.param_groups[0]["lr"]
            raise UpdateOverflow(
                f"the optimizer step at learning rate {lr:g} does not fit in the parameters' "
                f"dtype ({e}); lower optim.lr. Nothing of this step was pushed or saved"
            ) from None
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
    else:
        ok = False
        metrics["grad_norm"] = float("nan")  # measured: the gradient is not finite
        for chunk in model:
            chunk.zero_grad_buffer()  # type: ignore[operator]  # megatron-core DDP chunks
        optimizer.zero_grad()
    metrics["update_successful"] = float(bool(ok))
    return metrics


def grads_finite(model: list[torch.nn.Module]) -> bool:
    """Whether every gradient on every rank is finite (a collective: call on all ranks)."""
    # Count non-finite tensors on the device: one host sync for the whole model, not one per
    # parameter (this runs before every optimizer step).
    bad = torch.zeros(1, device=dist.device())
    for chunk in model:
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                bad += (~torch.isfinite(g)).any()
    torch.distributed.all_reduce(bad)
    return bool(bad.item() == 0)


def nonfinite_params(model: list[torch.nn.Module]) -> str | None:
    """None when every parameter on every rank is finite, else the first non-finite one of
    each rank that has one (`name (rank r)`, comma-separated). A collective: call on all ranks.

    The common path is one fused max-|x| per parameter (`_foreach_norm`, NaN propagates), one
    flag, one all-reduce and one host sync; names are looked up only once a rank has one."""
    params = [p for chunk in model for p in chunk.parameters()]
    bad = torch.zeros(1, device=dist.device())
    if params:
        maxes = torch._foreach_norm([p.detach() for p in params], float("inf"))
        bad += (~torch.isfinite(torch.stack([m.float() for m in maxes]))).any()
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    if initialized:
        torch.distributed.all_reduce(bad)
    if bad.item() == 0:
        return None
    mine = ""
    for chunk in model:
        for name, p in chunk.named_parameters():
            if not bool(torch.isfinite(p.detach()).all()):
                mine = f"{name.removeprefix('module.')} (rank {dist.rank()})"
                break
        if mine:
            break
    found = [mine]
    if initialized:
        found = [""] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(found, mine)
    return ", ".join(f for f in found if f)


def _logprob_rows(mb: PackedMicroBatch, cfg: StepConfig, output: ModelOutput) -> dict[str, Tensor]:
    logp, _ = _logprobs(output, mb, cfg)
    keep = mb.token_pos >= 0
    sid = torch.tensor(mb.seq_ids, device=mb.seq_index.device)[mb.seq_index[keep]]
    rows = torch.stack([sid.double(), mb.token_pos[keep].double(), logp[keep].double()], 1)
    return {"rows": rows.detach()}


@torch.no_grad()
def forward_only(
    model: list[torch.nn.Module],
    micro_batches: Sequence[PackedMicroBatch],
    reduce: Callable[[PackedMicroBatch, ModelOutput], dict[str, Any]],
    cfg: StepConfig | None = None,
) -> list[dict[str, Any]]:
    """One forward pass over `micro_batches` through megatron-core's schedule (any pipeline
    layout); `reduce(mb, output)` runs on the last stage and its dicts are returned there.
    `output` is what `_forward(model, mb, cfg)` returns (cfg None: hidden states, no LM head)."""

    def loss(mb: PackedMicroBatch, output: ModelOutput) -> tuple[Tensor, Tensor, dict[str, Any]]:
        first = output[0] if isinstance(output, tuple) else output
        zero = torch.tensor(0, dtype=torch.int, device=first.device)  # megatron sums it on device
        return first.sum() * 0.0, zero, reduce(mb, output)

    def step(
        data_iterator: Iterator[PackedMicroBatch], m: torch.nn.Module
    ) -> tuple[ModelOutput, partial[tuple[Tensor, Tensor, dict[str, Any]]]]:
        mb = next(data_iterator)
        return _forward(m, mb, cfg), partial(loss, mb)

    return _schedule(model, micro_batches, step, True)


def _schedule(
    model: list[torch.nn.Module],
    micro_batches: Sequence[PackedMicroBatch],
    forward_step: Callable[..., Any],
    forward_only: bool,
) -> list[dict[str, Any]]:
    """megatron-core's schedule for this layout (no pipelining, 1F1B or interleaved) over
    `micro_batches`; the loss functions' dicts (last pipeline stage; [] elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=_iterators(model, micro_batches),
        model=model,
        num_microbatches=len(micro_batches),
        seq_length=max(m.input_ids.size(1) for m in micro_batches),  # p2p shapes exchanged
        micro_batch_size=1,
        forward_only=forward_only,
    )
    return outputs or []


@torch.no_grad()
def compute_logprobs(
    model: list[torch.nn.Module],
    micro_batches: Sequence[PackedMicroBatch],
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
    fused_lm_head: bool = True,
) -> dict[int, Tensor]:
    """Current-policy log-probs of every response token of every sequence in the mini-batch
    (all DP ranks' sequences), as `{seq_id: [R] float64}`, identical on every rank.
    `fused_lm_head`: through the fused LM head (no logits) or the output layer's logits.

    Used to recompute pi_old, and to measure trainer/engine log-prob mismatch.
    """
    cfg = StepConfig(
        loss=PolicyLossConfig(),
        temperature=temperature,
        logprob_chunk=chunk,
        fused_lm_head=fused_lm_head,
    )
    outputs = forward_only(model, micro_batches, lambda mb, out: _logprob_rows(mb, cfg, out), cfg)
    from megatron.core import parallel_state as ps

    rows = torch.cat([o["rows"] for o in outputs]) if outputs else torch.zeros(0, 3)
    # Tensors on the host (the default group's gloo side), TP duplicates left out: TP ranks
    # compute the same rows as TP rank 0 (the vocab-parallel log-softmax is all-reduced).
    gathered = gather_logprob_rows(rows, duplicate=ps.get_tensor_model_parallel_rank() != 0)
    return logprobs_by_sequence(gathered)
