"""Two gloo ranks: vocab-parallel log-probs (TP), the CP loss hook with a real all-reduce, and
the fused LM head on TP2, TP2+SP and CP2 against the unfused single-rank path in float64."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_gspo.algo import (
    PolicyLossConfig,
    PolicyLossInputs,
    cp_seq_sum,
    fused_lm_head_logprobs,
    identity_seq_sum,
    policy_loss,
    vocab_parallel_logprobs,
)
from megatron_gspo.testing.harness import spawn_ranks

from .cases import make_seqs, pack, run_packed, scatter_grad
from .reference import reference_logprobs

WORLD = 2
VALID = [("gspo", "sequence"), ("gspo", "none"), ("gspo_token", "token"), ("grpo", "sequence")]
# The mismatch masks: the sequence mask's ratio is a full-sequence mean (the CP all-reduce).
MASKED = [
    ("gspo", dict(seq_mismatch_mask=[0.9, 1.1], token_mismatch_mask=[0.7, 1.4])),
    ("gspo_token", dict(seq_mismatch_mask=[0.9, 1.1])),
    ("grpo", dict(token_mismatch_mask=[0.7, 1.4], tis_mode="sequence")),
]


def _check_tensor_parallel(rank: int) -> None:
    gen = torch.Generator().manual_seed(0)
    t, v = 19, 2 * 37
    for dtype in (torch.float64, torch.bfloat16):
        logits = (torch.randn(t, v, generator=gen, dtype=torch.float64) * 4).to(dtype)
        target = torch.randint(0, v, (t,), generator=gen)
        g_lp, g_h = torch.randn(2, t, generator=gen, dtype=torch.float64)
        vp = v // WORLD
        cols = slice(rank * vp, (rank + 1) * vp)
        shard = logits[:, cols].clone().requires_grad_(True)
        logp, ent = vocab_parallel_logprobs(
            shard,
            target,
            group=dist.group.WORLD,
            vocab_start=rank * vp,
            temperature=0.9,
            chunk_size=5,
            with_entropy=True,
        )
        ((logp.double() * g_lp).sum() + (ent.double() * g_h).sum()).backward()

        full = logits.double().requires_grad_(True)
        ref_lp, ref_ent = reference_logprobs(full, target, 0.9)
        ((ref_lp * g_lp).sum() + (ref_ent * g_h).sum()).backward()
        tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=0, atol=3e-5)
        torch.testing.assert_close(logp.double(), ref_lp.detach(), **tol)
        torch.testing.assert_close(ent.double(), ref_ent.detach(), **tol)
        gtol = tol if dtype == torch.float64 else dict(rtol=2**-8, atol=1e-5)
        assert shard.grad.dtype == dtype
        torch.testing.assert_close(shard.grad.double(), full.grad[:, cols], **gtol)


def _check_context_parallel(rank: int) -> None:
    seqs = make_seqs(
        torch.Generator().manual_seed(4),
        [1, 3, 6, 2, 9, 4],
        [1e-6, 1e-2, 0.3, 1e-5, 2e-2, 1.0],
        rollout_noise=0.3,
    )
    for kind, kw in [(k, dict(tis_mode=t)) for k, t in VALID] + MASKED:
        cfg = PolicyLossConfig(kind=kind, **kw)  # type: ignore[arg-type]
        whole, whole_metrics, whole_grads = run_packed(seqs, cfg, 10.0)
        for k in ("loss/seq_mismatch_masked", "loss/token_mismatch_masked"):
            if k in whole_metrics:  # the masks must leave out some, not all
                assert 0 < whole_metrics[k][0] < whole_metrics[k][1], (kind, k)
        # Each rank holds every other token of each sequence (rank 1 gets nothing of seq 0).
        p = pack(seqs, gen=torch.Generator().manual_seed(rank), keep=lambda i, t: t % 2 == rank)
        loss, metrics = policy_loss(
            p.inputs, cfg, denominator=10.0, seq_sum=cp_seq_sum(dist.group.WORLD)
        )
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)  # what Megatron's sum over CP ranks would see
        torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-14)
        grads = scatter_grad([p], seqs)
        for i, s in enumerate(seqs):
            mine = torch.arange(len(s.mask)) % 2 == rank
            torch.testing.assert_close(grads[i][mine], whole_grads[i][mine], rtol=1e-12, atol=1e-14)
        names = sorted(metrics)
        stacked = torch.stack([metrics[n] for n in names])
        dist.all_reduce(stacked)
        for n, (num, den) in zip(names, stacked, strict=True):
            want = whole_metrics[n]
            if want[1] == 0:  # e.g. a response-length bin no sequence falls in
                assert den == 0 and num == 0, (n, num, den)
                continue
            torch.testing.assert_close(num / den, want[0] / want[1], rtol=1e-5, atol=1e-6)


class _SequenceParallelGather(torch.autograd.Function):
    """All-gather row shards (forward); sum the gradients and keep this rank's rows (backward):
    what sequence parallelism does around the output layer."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        parts = [torch.empty_like(x) for _ in range(WORLD)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g.chunk(WORLD)[dist.get_rank()]


def _check_fused_lm_head(rank: int) -> None:
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 6, 2, 9]
    t, v, h, temp = sum(lengths), 2 * 29, 6, 0.8
    hidden = torch.randn(t, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) * 0.7
    target = torch.randint(0, v, (t,), generator=gen)
    g_lp, g_h = torch.randn(2, t, generator=gen, dtype=torch.float64)
    tol = dict(rtol=1e-12, atol=1e-12)

    def reference(objective):  # the unfused path on one rank, full vocab
        rh, rw = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(rh @ rw.T, target, temperature=temp, with_entropy=True)
        objective(lp, ent, torch.arange(t)).backward()
        return lp.detach(), ent.detach(), rh.grad, rw.grad

    def weighted(lp, ent, idx):
        return (lp * g_lp[idx]).sum() + (ent * g_h[idx]).sum()

    # TP2 (hidden replicated) and TP2 + SP (hidden row shards, gathered): W vocab shards.
    ref = reference(weighted)
    vp = v // WORLD
    cols = slice(rank * vp, (rank + 1) * vp)
    mine = slice(rank * t // WORLD, (rank + 1) * t // WORLD)
    for sp in (False, True):
        hh = (hidden[mine] if sp else hidden).clone().requires_grad_(True)
        w = weight[cols].clone().requires_grad_(True)
        lp, ent = fused_lm_head_logprobs(
            _SequenceParallelGather.apply(hh) if sp else hh,
            w,
            target,
            group=dist.group.WORLD,
            vocab_start=rank * vp,
            temperature=temp,
            chunk_size=3,
            vocab_chunk=7,
            with_entropy=True,
            reduce_grad_hidden=not sp,
        )
        weighted(lp, ent, torch.arange(t)).backward()
        torch.testing.assert_close(lp, ref[0], **tol)
        torch.testing.assert_close(ent, ref[1], **tol)
        torch.testing.assert_close(hh.grad, ref[2][mine] if sp else ref[2], **tol)
        torch.testing.assert_close(w.grad, ref[3][cols], **tol)

    # CP2, packed: each rank holds every other token; GSPO loss with the CP sequence sum.
    seq_index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    adv = torch.randn(len(lengths), generator=gen, dtype=torch.float64)
    mask = torch.rand(t, generator=gen) > 0.2
    # pi_old near pi_theta, one sequence far off: some sequences clip, some do not.
    old = ref[0] + 0.02 * torch.sin(torch.arange(t, dtype=torch.float64)) + (seq_index == 1) * 0.5
    cfg = PolicyLossConfig(kind="gspo")

    def gspo(lp, ent, idx, seq_sum=identity_seq_sum):
        batch = PolicyLossInputs(
            logp=lp,
            old_logp=old[idx],
            advantages=adv,
            seq_index=seq_index[idx],
            mask=mask[idx],
            num_seqs=len(lengths),
            entropy=ent.detach(),
        )
        loss, _ = policy_loss(batch, cfg, denominator=float(len(lengths)), seq_sum=seq_sum)
        return loss - 0.01 * (ent * mask[idx]).sum()  # an entropy term in the objective too

    ref_loss = gspo(ref[0], ref[1], torch.arange(t)).detach()
    ref = reference(gspo)
    idx = torch.arange(t)[torch.arange(t) % WORLD == rank]
    hh = hidden[idx].clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp, ent = fused_lm_head_logprobs(
        hh, w, target[idx], temperature=temp, chunk_size=4, vocab_chunk=16, with_entropy=True
    )
    loss = gspo(lp, ent, idx, cp_seq_sum(dist.group.WORLD))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)  # Megatron sums the CP shards' losses and weight gradients
    dist.all_reduce(w.grad)
    torch.testing.assert_close(total, ref_loss, **tol)
    torch.testing.assert_close(hh.grad, ref[2][idx], **tol)
    torch.testing.assert_close(w.grad, ref[3], **tol)


def _ranks(rank: int, world: int) -> None:
    assert world == WORLD
    _check_tensor_parallel(rank)
    _check_context_parallel(rank)
    _check_fused_lm_head(rank)
    # Leave together: rank 0 hosts the TCP store, and tearing it down while rank 1 is still
    # talking to it aborted rank 0 (SIGABRT, "terminate called without an active
    # exception") in about 1 run in 10.
    dist.barrier()


@pytest.mark.multirank
def test_two_gloo_ranks() -> None:
    spawn_ranks(_ranks, WORLD)  # gloo ranks forked from the session's preloaded forkserver
