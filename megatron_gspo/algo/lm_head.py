"""Fused LM head: output layer + target log-probs (+ entropy), never materialising the logits.

Shape legend:
    T   token positions (packed; of this micro-batch or context-parallel shard)
    H   hidden size
    V   full vocabulary
    Vp  this tensor-parallel rank's vocab shard: rows [vocab_start, vocab_start + Vp) of W
    C   tokens of one chunk (<= chunk_size);  Vc  vocab columns of one chunk (<= vocab_chunk)

With z = (hidden @ W^T) / temperature (the logits, never built whole), the outputs are those of
`megatron_gspo.algo.logprobs.vocab_parallel_logprobs(hidden @ W^T, ...)`:

    lse_t   = log sum_v exp(z_{t,v})            logp_t = z_{t,target_t} - lse_t
    H_t     = lse_t - sum_v p_{t,v} z_{t,v}     (entropy of p = softmax(z_t))
    dL/dz   = g_logp (onehot(target) - p) - g_H p (log p + H)
    dL/dhidden = (dL/dz / temperature) @ W      dL/dW = (dL/dz / temperature)^T @ hidden

Forward: per token chunk, an online (running max) log-sum-exp over vocab chunks of [C, Vc]
logits; one MAX and one SUM all-reduce per token chunk over `group` combine the shards' partial
statistics (max m, sum e = sum exp(z - m), sum e (z - m), owner-only target logit). Backward:
vocab chunks outer, token chunks inner; each [C, Vc] logit block is recomputed from the saved
hidden states and W, turned into its gradient, and accumulated into dL/dhidden ([T, H], compute
dtype) and into a [Vc, H] compute-dtype accumulator for that W block, written once into dL/dW.
So the largest buffers are [C, Vc] blocks, [T, H] and [Vp, H] (the gradient W needs anyway):
no [T, V] or [T, Vp] tensor exists in either pass. Logit blocks are computed in the inputs'
dtype (a bf16 GEMM, as the unfused output layer does) and upcast to float32 (float64 for float64
inputs) for the softmax statistics; the gradient blocks are cast back to W's dtype for the two
backward GEMMs, as the unfused path's bf16 logits gradient is.

Tensor parallelism: `weight` is this rank's vocab shard; `hidden` is the same on every rank of
`group` (sequence parallelism gathers it first). Every rank returns the same [T] outputs and
dL/dW for its own shard. dL/dhidden is summed over `group` when `reduce_grad_hidden` (the
column-parallel layer's input all-reduce); pass False where the caller's own gather reduces it
(sequence parallelism's all-gather reduce-scatters the gradient in backward). As in
`vocab_parallel_logprobs`, every rank must receive the same upstream gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_gspo.algo.softmax_rows import all_reduce_rows as _all_reduce
from megatron_gspo.algo.softmax_rows import finish_rows, neg_softmax_grad_

__all__ = ["fused_lm_head_logprobs"]


def _spans(n: int, step: int) -> list[slice]:
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]


class _FusedLMHead(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        target: Tensor,
        group: dist.ProcessGroup | None,
        vocab_start: int,
        temperature: float,
        chunk_size: int,
        vocab_chunk: int,
        with_entropy: bool,
        reduce_grad_hidden: bool,
    ) -> tuple[Tensor, Tensor]:
        num_tok, vp = hidden.shape[0], weight.shape[0]
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        inv_t = 1.0 / temperature
        local = target.long() - vocab_start
        owned = (local >= 0) & (local < vp)
        logp = torch.empty(num_tok, dtype=dtype, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        cols = _spans(vp, vocab_chunk)
        for rows in _spans(num_tok, chunk_size):
            h = hidden[rows]
            loc, own = local[rows], owned[rows]
            # Running max m, sum exp(z - m) and sum exp(z - m) (z - m) (0 without entropy).
            m: Tensor | None = None
            s, a, tgt = (logp.new_zeros(h.shape[0]) for _ in range(3))
            for vc in cols:
                z = (h @ weight[vc].T).to(dtype).mul_(inv_t)  # [C, Vc]
                hit = own & (loc >= vc.start) & (loc < vc.stop)
                idx = (loc - vc.start).clamp_(0, z.shape[1] - 1)
                tgt += torch.where(hit, z.gather(1, idx[:, None]).squeeze(1), 0.0)
                bm = z.amax(-1)
                new_m = bm if m is None else torch.maximum(m, bm)
                z.sub_(new_m[:, None])
                e = z.exp()
                bs = e.sum(-1)
                # sum e (z - new_m) as a batched dot product: no third [C, Vc] buffer.
                ba = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1) if with_entropy else a
                del z, e
                if m is None:
                    s, a = bs, ba
                else:
                    # Rescale the running sums from max m to max new_m (<= 0 exponent).
                    d = m - new_m
                    f = d.exp()
                    if with_entropy:  # sum e (z - m) -> sum e' (z - new_m)
                        a = (a + d * s) * f + ba
                    s = s * f + bs
                m = new_m
            assert m is not None  # Vp > 0: at least one vocab chunk
            g_m = m.clone()
            _all_reduce(g_m, dist.ReduceOp.MAX, group)
            d = m - g_m
            f = d.exp()
            # One SUM all-reduce: sum-exp, the (owner-only) target logit, sum p (z - max).
            parts = [s * f, tgt] + ([(a + d * s) * f] if with_entropy else [])
            stats = torch.stack(parts)
            _all_reduce(stats, dist.ReduceOp.SUM, group)
            lse[rows], logp[rows], ent = finish_rows(
                stats, g_m, target_shifted=False, with_entropy=with_entropy
            )
            if ent is not None:
                entropy[rows] = ent
        ctx.save_for_backward(hidden, weight, local, owned, lse, entropy)
        ctx.group = group
        ctx.cfg = (inv_t, chunk_size, vocab_chunk, with_entropy, reduce_grad_hidden)
        ctx.set_materialize_grads(False)  # unused outputs give None, not [T] zeros
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, local, owned, lse, entropy = ctx.saved_tensors
        inv_t, chunk_size, vocab_chunk, with_entropy, reduce_grad_hidden = ctx.cfg
        nones = (None,) * 8
        if not with_entropy:
            grad_entropy = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logp is None and grad_entropy is None) or not (need_h or need_w):
            return (None, None, *nones)
        dtype = lse.dtype
        g_lp = grad_logp.to(dtype) if grad_logp is not None else torch.zeros_like(lse)
        g_h = grad_entropy.to(dtype) if grad_entropy is not None else None
        num_tok, vp = hidden.shape[0], weight.shape[0]
        grad_hidden = hidden.new_zeros(hidden.shape, dtype=dtype) if need_h else None
        grad_weight = torch.empty_like(weight) if need_w else None
        rows_list = _spans(num_tok, chunk_size)
        for vc in _spans(vp, vocab_chunk):
            w = weight[vc]
            acc_w = torch.zeros(w.shape, dtype=dtype, device=w.device) if need_w else None
            for rows in rows_list:
                h = hidden[rows]
                # log p of the block, in place in the recomputed logits.
                logq = (h @ w.T).to(dtype).mul_(inv_t).sub_(lse[rows, None])
                gh_rows = g_h[rows, None] if g_h is not None else None
                grad = neg_softmax_grad_(logq, g_lp[rows, None], gh_rows, entropy[rows, None])
                loc = local[rows] - vc.start
                hit = owned[rows] & (loc >= 0) & (loc < w.shape[0])
                src = torch.where(hit, g_lp[rows], 0.0).unsqueeze(1)
                grad.scatter_add_(1, loc.clamp(0, w.shape[0] - 1)[:, None], src)
                gz = grad.mul_(inv_t).to(weight.dtype)  # dL/dlogits block, in W's dtype
                del grad, logq
                if grad_hidden is not None:
                    grad_hidden[rows] += gz @ w
                if acc_w is not None:
                    acc_w += gz.T @ h.to(weight.dtype)
                del gz
            if grad_weight is not None and acc_w is not None:
                grad_weight[vc] = acc_w
        if grad_hidden is not None and reduce_grad_hidden:
            _all_reduce(grad_hidden, dist.ReduceOp.SUM, ctx.group)
        gh = grad_hidden.to(hidden.dtype) if grad_hidden is not None else None
        return (gh, grad_weight, *nones)


def fused_lm_head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    vocab_chunk: int = 8192,
    with_entropy: bool = False,
    reduce_grad_hidden: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log softmax(hidden @ W^T / temperature)[target] over the full (sharded) vocab, and entropy,
    without building the [T, Vp] logits (see the module docstring for the math and memory).

    Args:
        hidden: [T, H] final hidden states (after the final norm), the same on every rank of
            `group`.
        weight: [Vp, H] this rank's vocab shard of the output (or tied embedding) weight.
        target: [T] int64 token ids in the FULL vocab [0, V).
        group: tensor-parallel group the vocab is sharded over; None = unsharded (Vp == V).
        vocab_start: first vocab id of this shard (rank * Vp for an even split).
        temperature: sampling temperature; the engine's log-probs are of logits / temperature.
        chunk_size: tokens per chunk (C).
        vocab_chunk: vocab rows of W per chunk (Vc); a block of logits is [C, Vc].
        with_entropy: also return H_t = -sum_v p log p from the same pass (differentiable).
        reduce_grad_hidden: sum dL/dhidden over `group` in backward (False when the caller's
            sequence-parallel gather reduce-scatters it).

    Returns:
        (logp [T], entropy [T] or None), float32 (float64 for float64 hidden), identical on
        every rank of `group`. Differentiable w.r.t. `hidden` and `weight`.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [T, H] and weight [Vp, H], got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"expected target [T={hidden.shape[0]}], got {tuple(target.shape)}")
    if chunk_size <= 0 or vocab_chunk <= 0:
        raise ValueError(f"chunk_size={chunk_size}, vocab_chunk={vocab_chunk}: must be > 0")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    logp, entropy = _FusedLMHead.apply(
        hidden,
        weight,
        target,
        group,
        vocab_start,
        temperature,
        chunk_size,
        vocab_chunk,
        with_entropy,
        reduce_grad_hidden,
    )
    return logp, (entropy if with_entropy else None)
