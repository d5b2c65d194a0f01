"""Chunked vocab-parallel log-probs and entropy against a float64 log_softmax reference."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.algo import vocab_parallel_logprobs

from .reference import reference_logprobs


def _data(t: int, v: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, v, generator=gen, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, v, (t,), generator=gen)
    g_lp = torch.randn(t, generator=gen, dtype=torch.float64)
    g_h = torch.randn(t, generator=gen, dtype=torch.float64)
    return logits, target, g_lp, g_h


def _grads(fn, logits, target, g_lp, g_h, with_entropy):
    x = logits.clone().requires_grad_(True)
    logp, ent = fn(x, target)
    obj = (logp.double() * g_lp).sum()
    if with_entropy:
        obj = obj + (ent.double() * g_h).sum()
    obj.backward()
    return logp.detach(), (ent.detach() if with_entropy else None), x.grad


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 32, 1024])  # T = 28: divides and does not
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_float64_matches_reference(chunk_size, temperature, with_entropy) -> None:
    logits, target, g_lp, g_h = _data(28, 97, torch.float64)
    got = _grads(
        lambda x, t: vocab_parallel_logprobs(
            x, t, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy
        ),
        logits,
        target,
        g_lp,
        g_h,
        with_entropy,
    )
    want = _grads(
        lambda x, t: reference_logprobs(x, t, temperature), logits, target, g_lp, g_h, with_entropy
    )
    assert (got[1] is None) == (not with_entropy)
    for a, b in zip(got, want, strict=True):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradcheck_float64() -> None:
    logits, target, _, _ = _data(5, 11, torch.float64, seed=3)
    x = logits.requires_grad_(True)

    def f(x):
        logp, ent = vocab_parallel_logprobs(
            x, target, chunk_size=2, temperature=0.8, with_entropy=True
        )
        return logp, ent

    assert torch.autograd.gradcheck(f, (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs(dtype) -> None:
    logits, target, g_lp, g_h = _data(40, 301, dtype, seed=1)
    got = _grads(
        lambda x, t: vocab_parallel_logprobs(
            x, t, chunk_size=16, temperature=0.7, with_entropy=True
        ),
        logits,
        target,
        g_lp,
        g_h,
        True,
    )
    # The reference sees exactly the same (rounded) input values, in float64.
    want = _grads(
        lambda x, t: reference_logprobs(x, t, 0.7), logits.double(), target, g_lp, g_h, True
    )
    assert got[0].dtype == torch.float32 and got[2].dtype == dtype
    torch.testing.assert_close(got[0].double(), want[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(got[1].double(), want[1], rtol=0, atol=2e-5)
    # The gradient is computed in float32 (|log p + H| ~ 10 loses a few bits) and rounded once
    # to the input dtype (bf16: relative 2^-8).
    rtol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got[2].double(), want[2], rtol=rtol, atol=1e-5)


def test_only_entropy_or_only_logp_used() -> None:
    logits, target, _, _ = _data(6, 13, torch.float64, seed=2)
    x = logits.clone().requires_grad_(True)
    _, ent = vocab_parallel_logprobs(x, target, chunk_size=4, with_entropy=True)
    ent.sum().backward()
    y = logits.clone().requires_grad_(True)
    ref = torch.log_softmax(y, -1)
    (-(ref.exp() * ref).sum()).backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-12)


def test_shard_targets_outside_are_ignored_and_errors() -> None:
    # One shard on its own (no group): targets it does not own contribute no onehot term.
    logits, target, _, _ = _data(4, 10, torch.float64)
    x = logits.clone().requires_grad_(True)
    logp, _ = vocab_parallel_logprobs(x, target + 100, vocab_start=0)
    # The owner shard adds z_target - max (max is global), others add 0.
    lse_shifted = torch.logsumexp(logits, -1) - logits.max(-1).values
    torch.testing.assert_close(logp, -lse_shifted)
    logp.sum().backward()
    torch.testing.assert_close(x.grad, -torch.softmax(logits, -1))
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_logprobs(logits, target, chunk_size=0)
    with pytest.raises(ValueError, match="target"):
        vocab_parallel_logprobs(logits, target[:3])
