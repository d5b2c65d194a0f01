"""Target-token log-probs and entropy from vocab-parallel logits, chunked over tokens.

Shape legend:
    T   token positions (packed; of this micro-batch or context-parallel shard)
    V   full vocabulary
    Vp  this tensor-parallel rank's vocab shard: columns [vocab_start, vocab_start + Vp)
    C   rows of one chunk (<= chunk_size)

With z = logits / temperature (full row over the V columns of all shards):

    lse_t     = log sum_v exp(z_{t,v})                      (max / sum-exp all-reduced)
    logp_t    = z_{t,target_t} - lse_t                      (target gathered on its owner shard)
    H_t       = -sum_v p_{t,v} log p_{t,v} = lse_t - sum_v p_{t,v} z_{t,v}
    dlogp/dz  = onehot(target) - p
    dH/dz     = -p (log p + H)

so dL/dlogits = [ g_logp (onehot - p) - g_H p (log p + H) ] / temperature, a per-shard quantity
once lse and H (global) are known: the backward needs no communication.

Memory: the work is done chunk by chunk over T in float32 (float64 if the logits are float64),
so at most a few [C, Vp] float32 buffers are alive, never [T, V]. The backward recomputes p per
chunk from the saved logits and [T] statistics instead of saving [T, Vp] softmax outputs. The
gradient comes back in the logits' dtype (bf16 in, bf16 gradient out).

Tensor parallelism: every rank of `group` gets the same (replicated) [T] outputs. The backward
assumes every rank receives the same upstream gradient, which is the case when each TP rank
computes the same loss from these outputs (Megatron's convention), and returns each rank the
gradient of its own vocab shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_gspo.algo.softmax_rows import all_reduce_rows as _all_reduce
from megatron_gspo.algo.softmax_rows import finish_rows, neg_softmax_grad_

__all__ = ["vocab_parallel_logprobs"]


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        target: Tensor,
        group: dist.ProcessGroup | None,
        vocab_start: int,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        num_tok, vp = logits.shape
        dtype = _compute_dtype(logits)
        local = target.long() - vocab_start
        owned = (local >= 0) & (local < vp)
        local = torch.where(owned, local, 0)  # any in-range column; masked out by `owned`
        logp = torch.empty(num_tok, dtype=dtype, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        zero = logp.new_zeros(())
        for start in range(0, num_tok, chunk_size):
            rows = slice(start, min(num_tok, start + chunk_size))
            # One [C, Vp] buffer, reused in place: z - max.
            x = logits[rows].to(dtype, copy=True).mul_(1.0 / temperature)
            row_max = x.amax(dim=-1)
            _all_reduce(row_max, dist.ReduceOp.MAX, group)  # global max for a stable sum-exp
            x.sub_(row_max[:, None])
            tgt = torch.where(owned[rows], x.gather(1, local[rows, None]).squeeze(1), zero)
            if with_entropy:
                e = x.exp()
                # sum_v e * (z - max) as a batched dot product: no third [C, Vp] buffer.
                ez = torch.bmm(e.unsqueeze(1), x.unsqueeze(2)).view(-1)
                stats = torch.stack([e.sum(-1), tgt, ez])
                del e
            else:
                stats = torch.stack([x.exp_().sum(-1), tgt])
            del x
            # One SUM all-reduce for sum-exp, the (owner-only) target logit and sum p*z.
            _all_reduce(stats, dist.ReduceOp.SUM, group)
            lse[rows], logp[rows], ent = finish_rows(
                stats, row_max, target_shifted=True, with_entropy=with_entropy
            )
            if ent is not None:
                entropy[rows] = ent
        ctx.save_for_backward(logits, local, owned, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)  # unused outputs give None, not [T] zeros
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        logits, local, owned, lse, entropy = ctx.saved_tensors
        nones = (None,) * 6
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return (None, *nones)
        dtype = lse.dtype
        inv_t = 1.0 / ctx.temperature
        g_lp = grad_logp.to(dtype) if grad_logp is not None else torch.zeros_like(lse)
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(start, min(logits.shape[0], start + ctx.chunk_size))
            logq = logits[rows].to(dtype, copy=True).mul_(inv_t).sub_(lse[rows, None])  # log p
            g_h = grad_entropy[rows, None].to(dtype) if grad_entropy is not None else None
            grad = neg_softmax_grad_(logq, g_lp[rows, None], g_h, entropy[rows, None])
            # onehot(target) * g_lp, on the shard that owns the target column only.
            src = torch.where(owned[rows], g_lp[rows], 0).unsqueeze(1)
            grad.scatter_add_(1, local[rows, None], src)
            grad_logits[rows] = grad.mul_(inv_t)
            # Free this chunk's buffers before the next chunk allocates its own.
            del logq, grad
        return (grad_logits, *nones)


def vocab_parallel_logprobs(
    logits: Tensor,
    target: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits / temperature)[target] over the full (sharded) vocab, and entropy.

    Args:
        logits: [T, Vp] this rank's vocab shard of the logits (bf16/fp16/fp32/fp64).
        target: [T] int64 token ids in the FULL vocab [0, V).
        group: tensor-parallel group the vocab is sharded over; None = unsharded (Vp == V).
        vocab_start: first vocab id of this shard (rank * Vp for an even split).
        temperature: sampling temperature; the engine's log-probs are of logits / temperature.
        chunk_size: rows per chunk; bounds the float32 working set to O(chunk_size * Vp).
        with_entropy: also return H_t = -sum_v p log p from the same pass (differentiable).

    Returns:
        (logp [T], entropy [T] or None), float32 (float64 for float64 logits), identical on
        every rank of `group`. Differentiable w.r.t. `logits` (see the module docstring).
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [T, Vp] and target [T], got {tuple(logits.shape)} and "
            f"{tuple(target.shape)}"
        )
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size}: must be > 0")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    logp, entropy = _VocabParallelLogProbs.apply(
        logits, target, group, vocab_start, temperature, chunk_size, with_entropy
    )
    return logp, (entropy if with_entropy else None)
