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
vocab blocks of Vb = min(Vc, max(C Vc / T, H)) rows outer, token chunks inner; each [C, Vb]
logit block is recomputed from the saved hidden states and W, turned into its gradient (cast to
W's dtype into a [T, Vb] buffer) and multiplied into dL/dhidden ([T, H], compute dtype); after
the token chunks, dL/dW of the block is one GEMM over all T tokens, written once. The per-block
buffers are allocated once and reused (a fresh large block per chunk costs page faults on CPU).
So the largest buffers are [C, Vc]-element blocks, [T, H]-element ones and [Vp, H] (the gradient
W needs anyway): no [T, V] or [T, Vp] tensor exists in either pass.

Precision: logit blocks are fp32 (float64 for float64 inputs) straight out of the GEMM, from
bf16/fp16 operands with fp32 accumulation, as SGLang's `--enable-fp32-lm-head` computes the
engine's logits (`rollout.launch.fp32_lm_head`, on by default; SGLang 0.5.23
`LogitsProcessor._compute_lm_head`): on CUDA `torch.mm(h, W^T, out_dtype=float32)`, the bf16 GEMM
at bf16 cost with an fp32 output; on CPU, where that kernel does not exist, the block's operands
upcast to fp32 (products of bf16 values are exact in fp32, so both are the same sum up to its
order). Rounding the logits to bf16 instead (`fp32_logits=False`, the unfused output layer's
precision) puts up to half a bf16 ulp of the logit (~4e-3 at |z| ~ 1) into every log-prob: a
train/inference mismatch the size of GSPO's 3e-4 clip band. The gradient blocks dL/dz are
computed in fp32 and cast to W's dtype for the two backward GEMMs (bf16 cost, as the unfused
output layer's bf16 backward), dL/dhidden accumulating in fp32.

Cost: 4 [T, Vp, H] GEMMs (forward, backward recompute, dH, dW) to the unfused path's 3, and
the same softmax work; measured breakdown in docs/lm_head.md.

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


def _view(flat: Tensor, rows: int, cols: int) -> Tensor:
    """A contiguous [rows, cols] view of the front of a reused flat buffer. Reusing one buffer
    per role instead of allocating a fresh block per chunk saves the allocator's page faults:
    on CPU a fresh block of this size is a new mmap whose pages the kernel zeroes on first
    touch, which cost as much as all the softmax arithmetic (see benchmarks/logprob_loss.py)."""
    return flat[: rows * cols].view(rows, cols)


def _logits_into(out: Tensor, h: Tensor, w: Tensor, fp32_logits: bool, lo_buf: Tensor) -> Tensor:
    """out[C, Vc] (float32/float64) = h[C, H] @ w[Vc, H]^T, the block of logits.

    fp32_logits: fp32 accumulation and output from bf16/fp16 operands, as SGLang's fp32 LM head
    (CUDA: the same-dtype GEMM with `out_dtype`; elsewhere the operands upcast, as SGLang does
    off CUDA). False: the GEMM in the inputs' dtype into `lo_buf`, rounded there, then upcast."""
    if h.dtype == out.dtype:  # fp32 / fp64 inputs: the GEMM is already in the compute dtype
        return torch.mm(h, w.T, out=out)
    if not fp32_logits:
        return out.copy_(torch.mm(h, w.T, out=_view(lo_buf, *out.shape)))
    if h.is_cuda and h.dtype == w.dtype:
        return torch.mm(h, w.T, out_dtype=out.dtype, out=out)
    return torch.mm(h.to(out.dtype), w.T.to(out.dtype), out=out)


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
        fp32_logits: bool,
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
        blk = min(num_tok, chunk_size) * min(vp, vocab_chunk)
        # the GEMM's [C, Vc] output in the inputs' dtype (only for blocks rounded there)
        lo_buf = hidden.new_empty(0 if fp32_logits else blk)
        z_buf, e_buf = logp.new_empty(blk), logp.new_empty(blk)  # z - max, exp(z - max)
        for rows in _spans(num_tok, chunk_size):
            h = hidden[rows]
            loc, own = local[rows], owned[rows]
            # Running max m, sum exp(z - m) and sum exp(z - m) (z - m) (0 without entropy).
            m: Tensor | None = None
            s, a, tgt = (logp.new_zeros(h.shape[0]) for _ in range(3))
            for vc in cols:
                nc, nv = h.shape[0], vc.stop - vc.start
                z = _logits_into(_view(z_buf, nc, nv), h, weight[vc], fp32_logits, lo_buf)
                if inv_t != 1.0:  # a full pass over the block: skip it at temperature 1
                    z.mul_(inv_t)
                hit = own & (loc >= vc.start) & (loc < vc.stop)
                idx = (loc - vc.start).clamp_(0, z.shape[1] - 1)
                tgt += torch.where(hit, z.gather(1, idx[:, None]).squeeze(1), 0.0)
                bm = z.amax(-1)
                new_m = bm if m is None else torch.maximum(m, bm)
                z.sub_(new_m[:, None])
                e = torch.exp(z, out=_view(e_buf, nc, nv))
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
        ctx.cfg = (inv_t, chunk_size, vocab_chunk, with_entropy, reduce_grad_hidden, fp32_logits)
        ctx.set_materialize_grads(False)  # unused outputs give None, not [T] zeros
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, local, owned, lse, entropy = ctx.saved_tensors
        inv_t, chunk_size, vocab_chunk, with_entropy, reduce_grad_hidden, fp32_logits = ctx.cfg
        nones = (None,) * 9
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
        nc0, wdt = (rows_list[0].stop if rows_list else 0), weight.dtype
        # Vocab block width of the backward: the [T, Vb] dL/dlogits buffer (W's dtype) holds no
        # more elements than one [C, Vc] block or one [T, H] (the size of `hidden`), so dL/dW of
        # a block is ONE GEMM over all T tokens, written once (no float32 [Vb, H] accumulator
        # summed over token chunks). Vb >= min(H, Vc): each block adds a [T, H] product into the
        # float32 dL/dhidden, T H Vp / Vb element updates in all; with Vb = C Vc / T alone that
        # was 4 T Vp at T=8192, H=4096 and cost more than the softmax (docs/lm_head.md).
        hd = hidden.shape[1]
        vb = min(vp, max(1, nc0 * vocab_chunk // num_tok, min(hd, vocab_chunk))) if num_tok else vp
        blk = nc0 * vb
        lo_buf = hidden.new_empty(0 if fp32_logits else blk)  # [C, Vb] logits rounded there
        lq_buf = lse.new_empty(blk)  # log p, then dL/dz (compute dtype)
        p_buf = lse.new_empty(blk) if g_h is not None else None  # p (entropy term)
        gz_buf = weight.new_empty(num_tok * vb)  # [T, Vb] dL/dlogits, W's dtype
        dh_buf = hidden.new_empty(nc0 * hd, dtype=wdt)  # [C, H] dH block
        for vc in _spans(vp, vb):
            w = weight[vc]
            nv = w.shape[0]
            gz_all = _view(gz_buf, num_tok, nv)
            for rows in rows_list:
                h = hidden[rows]
                nc = h.shape[0]
                # log p of the block, in place in the recomputed logits.
                logq = _logits_into(_view(lq_buf, nc, nv), h, w, fp32_logits, lo_buf)
                if inv_t != 1.0:
                    logq.mul_(inv_t)
                logq.sub_(lse[rows, None])
                gh_rows = g_h[rows, None] if g_h is not None else None
                p_out = _view(p_buf, nc, nv) if p_buf is not None else None
                grad = neg_softmax_grad_(
                    logq, g_lp[rows, None], gh_rows, entropy[rows, None], p_out=p_out
                )
                loc = local[rows] - vc.start
                hit = owned[rows] & (loc >= 0) & (loc < nv)
                src = torch.where(hit, g_lp[rows], 0.0).unsqueeze(1)
                grad.scatter_add_(1, loc.clamp(0, nv - 1)[:, None], src)
                if inv_t != 1.0:
                    grad.mul_(inv_t)
                gz = gz_all[rows]
                gz.copy_(grad)  # dL/dlogits block, in W's dtype
                del grad, logq
                if grad_hidden is not None:  # add_ on the view: no __setitem__ copy back
                    grad_hidden[rows].add_(torch.mm(gz, w, out=_view(dh_buf, nc, hd)))
            if grad_weight is not None:
                torch.mm(gz_all.T, hidden, out=grad_weight[vc])
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
    fp32_logits: bool = True,
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
        fp32_logits: bf16/fp16 inputs give fp32 logit blocks (fp32 accumulation and output,
            SGLang's fp32 LM head); False rounds each block to the inputs' dtype first (the
            unfused output layer's precision). No effect on fp32/fp64 inputs.

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
        fp32_logits,
    )
    return logp, (entropy if with_entropy else None)
