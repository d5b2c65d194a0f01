"""Fused LM head against the unfused path (`hidden @ W^T` -> vocab_parallel_logprobs), and a
memory check that no [T, V]-sized buffer is ever allocated."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_gspo.algo import (
    PolicyLossConfig,
    fused_lm_head_logprobs,
    policy_loss,
    vocab_parallel_logprobs,
)

from .cases import make_seqs, pack
from .reference import reference_logprobs


def _data(t: int, v: int, h: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=gen, dtype=torch.float64) * (2 / h**0.5)).to(dtype)
    target = torch.randint(0, v, (t,), generator=gen)
    g_lp, g_h = torch.randn(2, t, generator=gen, dtype=torch.float64)
    return hidden, weight, target, g_lp, g_h


def _unfused(h, w, target, **kw):
    return vocab_parallel_logprobs(h @ w.T, target, **kw)


def _run(fn, hidden, weight, target, g_lp, g_h, with_entropy, **kw):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logp, ent = fn(h, w, target, with_entropy=with_entropy, **kw)
    obj = (logp.double() * g_lp).sum()
    if with_entropy:
        obj = obj + (ent.double() * g_h).sum()
    obj.backward()
    return logp.detach(), (ent.detach() if with_entropy else None), h.grad, w.grad


@pytest.mark.parametrize(
    ("chunk", "vchunk"), [(1, 13), (5, 1), (7, 32), (1024, 8192)]
)  # T = 28, V = 97: chunks divide and do not
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_float64_matches_unfused(chunk, vchunk, temperature, with_entropy) -> None:
    hidden, weight, target, g_lp, g_h = _data(28, 97, 12, torch.float64)
    got = _run(
        fused_lm_head_logprobs, hidden, weight, target, g_lp, g_h, with_entropy,
        temperature=temperature, chunk_size=chunk, vocab_chunk=vchunk,
    )  # fmt: skip
    want = _run(
        _unfused, hidden, weight, target, g_lp, g_h, with_entropy,
        temperature=temperature, chunk_size=5,
    )  # fmt: skip
    assert (got[1] is None) == (not with_entropy)
    for a, b in zip(got, want, strict=True):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # And the independent float64 log_softmax reference of tests/algo/reference.py.
    ref_lp, ref_ent = reference_logprobs(hidden @ weight.T, target, temperature)
    torch.testing.assert_close(got[0], ref_lp, rtol=1e-12, atol=1e-12)
    if with_entropy:
        torch.testing.assert_close(got[1], ref_ent, rtol=1e-12, atol=1e-12)


def test_gspo_loss_and_grads_match_unfused() -> None:
    """Packed sequences through the GSPO loss: loss, hidden and weight gradients (float64)."""
    seqs = make_seqs(torch.Generator().manual_seed(4), [3, 6, 2, 9], [1e-3, 0.3, 1e-5, 1.0])
    p = pack(seqs, gen=torch.Generator().manual_seed(1))
    t = p.inputs.logp.shape[0]
    hidden, weight, target, _, _ = _data(t, 53, 8, torch.float64, seed=5)
    out = []
    for fn in (fused_lm_head_logprobs, _unfused):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        logp, ent = fn(h, w, target, temperature=0.7, chunk_size=4, with_entropy=True)
        # pi_old near pi_theta: some sequences clip, some do not.
        old = logp.detach() + 0.1 * torch.sin(torch.arange(t, dtype=torch.float64))
        batch = replace(p.inputs, logp=logp, old_logp=old, entropy=ent.detach())
        loss, _ = policy_loss(batch, PolicyLossConfig(kind="gspo"), denominator=4.0)
        (loss - 1e-2 * ent.sum()).backward()  # an entropy term in the objective too
        out.append((loss.detach(), logp.detach(), ent.detach(), h.grad, w.grad))
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradcheck_float64() -> None:
    hidden, weight, target, _, _ = _data(5, 11, 3, torch.float64, seed=3)
    h, w = hidden.requires_grad_(True), weight.requires_grad_(True)

    def f(h, w):
        return fused_lm_head_logprobs(
            h, w, target, chunk_size=2, vocab_chunk=4, temperature=0.8, with_entropy=True
        )

    assert torch.autograd.gradcheck(f, (h, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_matches_unfused(dtype) -> None:
    # The unfused path on the same (rounded) logits: with fp32_logits=False the fused one rounds
    # each logit block to `dtype` exactly as the one GEMM does; gradients differ by the
    # accumulation order.
    hidden, weight, target, g_lp, g_h = _data(40, 301, 16, dtype, seed=1)
    kw: dict[str, Any] = dict(temperature=0.7, chunk_size=16)
    fused = partial(fused_lm_head_logprobs, fp32_logits=False)
    got = _run(fused, hidden, weight, target, g_lp, g_h, True, vocab_chunk=64, **kw)
    want = _run(_unfused, hidden, weight, target, g_lp, g_h, True, **kw)
    assert got[0].dtype == torch.float32 and got[2].dtype == dtype and got[3].dtype == dtype
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=2e-5)
    rtol = 1e-5 if dtype == torch.float32 else 2**-6
    for a, b in zip(got[2:], want[2:], strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=rtol * b.abs().max())


def _fp32_head(h, w, target, **kw):
    """The unfused fp32 head, as SGLang computes `--enable-fp32-lm-head` off CUDA: operands
    upcast, one fp32 GEMM, fp32 log-softmax; autograd casts the gradients back to bf16."""
    return vocab_parallel_logprobs(h.float() @ w.float().T, target, **kw)


def _float64_head(h, w, target, **kw):
    return vocab_parallel_logprobs(h.double() @ w.double().T, target, **kw)


def test_bf16_inputs_give_fp32_logits() -> None:
    """bf16 hidden states and weight (the recipes' trainer), fp32 logits (the engines'
    `rollout.launch.fp32_lm_head`): the fused head's log-probs and entropy equal the float64
    math on the same bf16 values to fp32 rounding, and the unfused fp32 head's; its gradients
    (bf16, from bf16 backward GEMMs) are within a bf16 rounding of both. Logits up to |z| ~ 46
    (a sharpened policy): bf16 logit blocks put 0.14 into a log-prob here (measured), fp32
    ones 5e-6."""
    hidden, weight, target, g_lp, g_h = _data(48, 301, 64, torch.bfloat16, seed=2)
    weight = (weight.double() * 4).bfloat16()  # large logits (exact: a power of 2)
    kw: dict[str, Any] = dict(temperature=0.7, chunk_size=16, with_entropy=True)
    fused = _run(fused_lm_head_logprobs, hidden, weight, target, g_lp, g_h, vocab_chunk=64, **kw)
    ref = _run(_float64_head, hidden, weight, target, g_lp, g_h, **kw)
    fp32 = _run(_fp32_head, hidden, weight, target, g_lp, g_h, **kw)
    assert fused[0].dtype == fused[1].dtype == torch.float32
    assert fused[2].dtype == fused[3].dtype == torch.bfloat16
    for want, atol in ((ref, 1e-5), (fp32, 1e-5)):
        for i in (0, 1):  # logp, entropy
            torch.testing.assert_close(fused[i].double(), want[i].double(), rtol=0, atol=atol)
    for want in (ref, fp32):
        for got, w in zip(fused[2:], want[2:], strict=True):  # dL/dhidden, dL/dW
            err = (got.double() - w.double()).abs().max() / w.double().abs().max()
            assert err < 2**-6, err  # measured 4e-3 (dH), 7e-3 (dW); bf16 blocks: 2e-2, 3e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA branch: bf16 GEMM, fp32 out")
def test_cuda_fp32_logits_match_the_cpu_branch() -> None:
    """On CUDA the blocks come from `torch.mm(..., out_dtype=float32)` (SGLang's CUDA branch),
    on CPU from upcast operands: the same products summed in another order."""
    hidden, weight, target, g_lp, g_h = _data(48, 301, 64, torch.bfloat16, seed=2)
    kw: dict[str, Any] = dict(chunk_size=16, vocab_chunk=64, with_entropy=True)
    cpu = _run(fused_lm_head_logprobs, hidden, weight, target, g_lp, g_h, **kw)
    dev = [t.cuda() for t in (hidden, weight, target, g_lp, g_h)]
    gpu = _run(fused_lm_head_logprobs, *dev, **kw)
    for i in (0, 1):
        torch.testing.assert_close(gpu[i].cpu(), cpu[i], rtol=0, atol=1e-5)


def test_shard_partial_and_errors() -> None:
    """A shard that owns none of the targets (no group): logp = -lse, no onehot term."""
    hidden, weight, target, _, _ = _data(6, 13, 4, torch.float64, seed=2)
    h = hidden.clone().requires_grad_(True)
    logp, _ = fused_lm_head_logprobs(h, weight, target + 100, chunk_size=4, vocab_chunk=5)
    torch.testing.assert_close(logp, -torch.logsumexp(hidden @ weight.T, -1))
    logp.sum().backward()
    torch.testing.assert_close(h.grad, -torch.softmax(hidden @ weight.T, -1) @ weight)
    with pytest.raises(ValueError, match="vocab_chunk"):
        fused_lm_head_logprobs(hidden, weight, target, vocab_chunk=0)
    with pytest.raises(ValueError, match="target"):
        fused_lm_head_logprobs(hidden, weight, target[:3])
    with pytest.raises(ValueError, match="weight"):
        fused_lm_head_logprobs(hidden, weight[:, :2], target)


class _Allocations(TorchDispatchMode):
    """Records the element count of every tensor any op returns (every allocation an op makes,
    views included: a view of a [T, V] buffer implies the buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, tuple | list) else (out,):
            if isinstance(x, torch.Tensor):
                self.numels.append((str(func), x.numel()))
        return out


def _largest(fn, t: int, v: int, h: int) -> dict[str, int]:
    hidden, weight, target, g_lp, g_h = _data(t, v, h, torch.float32, seed=7)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    rec = _Allocations()
    with rec:
        logp, ent = fn(hidden, weight, target)
        fwd = max(n for _, n in rec.numels)
        rec.numels.clear()
        ((logp * g_lp.float()).sum() + (ent * g_h.float()).sum()).backward()
    bwd = max(n for _, n in rec.numels)
    return {"forward": fwd, "backward": bwd}


def test_never_allocates_a_logits_sized_buffer() -> None:
    t, v, h = 128, 600, 4
    budget = t * v // 4  # a [T, V/4]-or-larger buffer fails: e.g. [T, V/tp] logits for tp <= 4

    def fused(hd, w, tg):
        return fused_lm_head_logprobs(hd, w, tg, chunk_size=32, vocab_chunk=100, with_entropy=True)

    def unfused(hd, w, tg):
        return _unfused(hd, w, tg, chunk_size=32, with_entropy=True)

    # The recorder sees both passes' [T, V] buffers of the unfused path: this test can fail.
    assert all(n >= t * v for n in _largest(unfused, t, v, h).values())
    got = _largest(fused, t, v, h)
    # What it does allocate: blocks [32, 100], [T, H] and [V, H] (the weight gradient).
    assert all(n <= max(32 * 100, v * h, t * h) < budget for n in got.values()), got
