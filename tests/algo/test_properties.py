"""Hypothesis properties of the policy losses (random lengths, advantages, eps, layouts)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_gspo.algo import PolicyLossConfig, PolicyLossInputs, policy_loss

from .cases import make_seqs, run_packed, run_reference

KINDS = st.sampled_from(["gspo", "gspo_token", "grpo"])
SETTINGS = settings(max_examples=50, deadline=None)


@st.composite
def batches(draw, max_seqs: int = 6, max_len: int = 9):
    n = draw(st.integers(1, max_seqs))
    lengths = draw(st.lists(st.integers(1, max_len), min_size=n, max_size=n))
    scales = draw(st.lists(st.sampled_from([1e-6, 1e-4, 1e-2, 0.3, 3.0]), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**16))
    seqs = make_seqs(torch.Generator().manual_seed(seed), lengths, scales, mask_prob=0.2)
    return seqs, seed


eps_values = st.floats(1e-5, 0.5)


@SETTINGS
@given(batch=batches(), kind=KINDS, eps_low=eps_values, eps_high=eps_values)
def test_property_matches_reference(batch, kind, eps_low, eps_high) -> None:
    seqs, seed = batch
    cfg = PolicyLossConfig(kind=kind, eps_low=eps_low, eps_high=eps_high)
    ref, ref_grads = run_reference(seqs, cfg, 7.0)
    loss, _, grads = run_packed(seqs, cfg, 7.0, gen=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(loss, ref.loss.detach(), rtol=1e-10, atol=1e-13)
    for g, w in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)


@SETTINGS
@given(batch=batches(), kind=KINDS, seed=st.integers(0, 2**16))
def test_property_sequence_order_invariance(batch, kind, seed) -> None:
    seqs, _ = batch
    cfg = PolicyLossConfig(kind=kind)
    loss, metrics, grads = run_packed(seqs, cfg, 5.0)
    perm = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed)).tolist()
    loss_p, metrics_p, grads_p = run_packed(
        [seqs[i] for i in perm], cfg, 5.0, gen=torch.Generator().manual_seed(seed)
    )
    torch.testing.assert_close(loss_p, loss, rtol=1e-12, atol=1e-14)
    for j, i in enumerate(perm):
        torch.testing.assert_close(grads_p[j], grads[i], rtol=1e-12, atol=1e-14)
    for name, value in metrics.items():
        torch.testing.assert_close(metrics_p[name], value, rtol=1e-6, atol=1e-6)


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
    denominator=st.floats(1.0, 100.0),
)
def test_property_gspo_unclipped_gradient_is_uniform_per_sequence(lengths, seed, denominator):
    gen = torch.Generator().manual_seed(seed)
    seqs = make_seqs(gen, lengths, [1e-7] * len(lengths), mask_prob=0.0)
    cfg = PolicyLossConfig(kind="gspo")
    _, metrics, grads = run_packed(seqs, cfg, denominator, gen=gen)
    assert metrics["policy/clip_frac"][0] == 0  # all inside the band by construction
    for s, g in zip(seqs, grads, strict=True):
        ratio = torch.exp((s.logp - s.old).mean())
        want = -s.adv * ratio / (len(g) * denominator)
        torch.testing.assert_close(g, want.expand_as(g), rtol=1e-12, atol=0.0)


@SETTINGS
@given(batch=batches(max_seqs=8), kind=KINDS, cuts=st.lists(st.integers(0, 8), max_size=4))
def test_property_split_into_microbatches(batch, kind, cuts) -> None:
    """Any split into micro-batches, each with the global denominator, sums to one call."""
    seqs, seed = batch
    cfg = PolicyLossConfig(kind=kind)
    n = len(seqs)
    whole, _, whole_grads = run_packed(seqs, cfg, float(n))
    bounds = sorted({0, n, *[c % (n + 1) for c in cuts]})
    total = torch.zeros((), dtype=torch.float64)
    grads = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        loss, _, g = run_packed(seqs[lo:hi], cfg, float(n), gen=torch.Generator().manual_seed(seed))
        total = total + loss
        grads += g
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-14)
    for g, w in zip(grads, whole_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)


def test_registry_signature_is_uniform() -> None:
    """Every kind runs through the same call with the same inputs: no caller branches."""
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    inputs = PolicyLossInputs(
        logp=x,
        old_logp=x.detach() + 0.01,
        advantages=torch.tensor([1.0, -1.0], dtype=torch.float64),
        seq_index=torch.tensor([0, 1, 0, 1, 1, 0]),
        mask=torch.ones(6, dtype=torch.bool),
        num_seqs=2,
    )
    names = None
    for kind in ("gspo", "gspo_token", "grpo"):
        loss, metrics = policy_loss(inputs, PolicyLossConfig(kind=kind), denominator=2.0)
        assert loss.shape == () and loss.requires_grad
        names = names or set(metrics)
        assert set(metrics) == names  # same metric keys whatever the kind
