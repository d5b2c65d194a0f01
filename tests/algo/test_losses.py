"""Policy losses against the float64 reference, and the reduction contract under splitting."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from megatron_gspo.algo import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossInputs,
    policy_loss,
    token_advantages,
)

from .cases import SeqData, make_seqs, pack, run_packed, run_reference, scatter_grad

TIGHT = dict(rtol=1e-10, atol=1e-13)

# Per-sequence log-ratio spreads: 1e-6 stays inside GSPO's 3e-4 band, 1e-2 / 1 leave it on
# either side, 30 hits the +-10 log-ratio clamp.
GSPO_SCALES = [1e-6, 2e-5, 1e-2, 3e-2, 0.5, 1e-6, 5e-3, 1.0, 1e-6, 30.0, 2e-2, 1e-5]
GRPO_SCALES = [0.05, 0.3, 0.6, 0.1, 1.0, 0.02, 0.4, 0.2, 0.7, 30.0, 0.15, 0.05]
LENGTHS = [1, 2, 3, 5, 8, 13, 1, 4, 6, 7, 9, 2]

VALID = [
    (kind, tis)
    for kind in ("gspo", "gspo_token", "grpo")
    for tis in ("none", "token", "sequence")
    if not (kind == "gspo" and tis == "token")
]


def _seqs(kind: str, seed: int, **kw) -> list[SeqData]:
    gen = torch.Generator().manual_seed(seed)
    scales = GRPO_SCALES if kind == "grpo" else GSPO_SCALES
    return make_seqs(gen, LENGTHS, scales, rollout_noise=0.5, **kw)


def _assert_grads(got: list[Tensor], want: list[Tensor], **tol) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, **(tol or TIGHT), msg=lambda m, i=i: f"seq {i}: {m}")


@pytest.mark.parametrize("kind,tis", VALID)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_float64_reference(kind: str, tis: str, seed: int) -> None:
    seqs = _seqs(kind, seed, per_token_adv=kind == "gspo_token" and seed == 1)
    seqs[3].mask[:] = False  # a sequence with no counted token: contributes 0, no NaN
    cfg = PolicyLossConfig(kind=kind, tis_mode=tis, tis_cap=1.3)
    denominator = 17.0  # the caller's global sequence count, not this micro-batch's
    ref, ref_grads = run_reference(seqs, cfg, denominator)
    # The case must exercise every branch, or the comparison proves little.
    assert ref.clipped_low > 0 and ref.clipped_high > 0 and ref.unclipped > 0, ref
    if tis != "none":
        assert ref.tis_truncated > 0

    gen = torch.Generator().manual_seed(seed + 100)
    token_adv = isinstance(seqs[0].adv, Tensor)
    loss, metrics, grads = run_packed(seqs, cfg, denominator, gen=gen, token_adv=token_adv)
    torch.testing.assert_close(loss, ref.loss.detach(), **TIGHT)
    _assert_grads(grads, ref_grads)
    assert all(torch.isfinite(g).all() for g in grads)

    # Clip metrics count exactly the clipped branches of the reference.
    assert metrics["policy/clip_frac_low"].tolist() == [ref.clipped_low, ref.elements]
    assert metrics["policy/clip_frac_high"].tolist() == [ref.clipped_high, ref.elements]
    clipped = ref.clipped_low + ref.clipped_high
    assert metrics["policy/clip_frac"].tolist() == [clipped, ref.elements]
    if tis != "none":
        assert metrics["tis/clip_frac"][0].item() == ref.tis_truncated
    for name, value in metrics.items():
        assert value.shape == (2,) and value.dtype == torch.float32, name
        assert torch.isfinite(value).all(), name


def test_metrics_values() -> None:
    seqs = _seqs("gspo", 0)
    cfg = PolicyLossConfig(kind="gspo")
    _, m, _ = run_packed(seqs, cfg, 12.0)
    counted = [s for s in seqs if s.mask.any()]
    lengths = [int(s.mask.sum()) for s in counted]
    assert m["policy/response_length"].tolist() == [sum(lengths), len(counted)]
    diffs = torch.cat([(s.logp - s.rollout)[s.mask] for s in counted])
    torch.testing.assert_close(
        m["mismatch/abs_logp_diff"], torch.tensor([diffs.abs().sum(), len(diffs)]).float()
    )
    ent = torch.cat([s.entropy[s.mask] for s in counted])
    torch.testing.assert_close(m["policy/entropy"], torch.tensor([ent.sum(), len(ent)]).float())


@pytest.mark.parametrize("tis", ["none", "sequence"])
def test_gspo_token_with_constant_advantages_is_gspo(tis: str) -> None:
    seqs = _seqs("gspo", 3)
    gspo = PolicyLossConfig(kind="gspo", tis_mode=tis)
    tok = PolicyLossConfig(kind="gspo_token", tis_mode=tis)
    loss_a, _, grads_a = run_packed(seqs, gspo, 9.0, gen=torch.Generator().manual_seed(1))
    loss_b, _, grads_b = run_packed(seqs, tok, 9.0, gen=torch.Generator().manual_seed(1))
    # Per-token advantages equal to A_i, built with the public broadcast helper.
    p = pack(seqs, gen=torch.Generator().manual_seed(1))
    per_tok = token_advantages(p.inputs.advantages, p.inputs.seq_index)
    inputs_c = PolicyLossInputs(
        **{f: getattr(p.inputs, f) for f in PolicyLossInputs.__slots__ if f != "advantages"}
        | {"advantages": per_tok, "advantages_per_token": True}
    )
    loss_c, _ = policy_loss(inputs_c, tok, denominator=9.0)
    loss_c.backward()
    grads_c = scatter_grad([p], seqs)
    # The gradient must be non-trivial for the comparison to mean something.
    assert sum(g.abs().sum() for g in grads_a) > 0
    for loss, grads in ((loss_b, grads_b), (loss_c.detach(), grads_c)):
        torch.testing.assert_close(loss, loss_a, rtol=1e-14, atol=1e-15)
        _assert_grads(grads, grads_a, rtol=1e-14, atol=1e-15)


def _split_losses(seqs, cfg, groups, denominator, reduction=None):
    """Run each micro-batch (a list of sequence ids) and sum the losses, as Megatron does."""
    total, packs = torch.zeros((), dtype=torch.float64), []
    for g, ids in enumerate(groups):
        part = [seqs[i] for i in ids]
        p = pack(part, gen=torch.Generator().manual_seed(g))
        loss = (reduction or _contract)(p.inputs, cfg, denominator)
        loss.backward()
        total = total + loss.detach()
        # Map the micro-batch's local sequence ids back to global ones for the gradients.
        p.origin = [(ids[i], t) for i, t in p.origin]
        packs.append(p)
    return total, scatter_grad(packs, seqs)


def _contract(inputs: PolicyLossInputs, cfg: PolicyLossConfig, denominator: float) -> Tensor:
    return policy_loss(inputs, cfg, denominator=denominator)[0]


def _token_mean_per_microbatch(inputs, cfg, denominator):
    """Planted wrong reduction: token-count-normalised per micro-batch (length-weighted).

    Uses the registered loss's own per-token terms by asking it for one sequence-free value: the
    per-sequence loss times its length, normalised by the micro-batch token count and scaled to
    the micro-batch's share of sequences. Equal to the contract only if all lengths are equal.
    """
    total = torch.zeros((), dtype=torch.float64)
    n_tok = inputs.mask.sum()
    for i in range(inputs.num_seqs):
        sel = inputs.seq_index == i
        n_i = (inputs.mask & sel).sum()
        one = PolicyLossInputs(
            logp=inputs.logp[sel],
            old_logp=inputs.old_logp[sel],
            advantages=inputs.advantages[i : i + 1],
            seq_index=torch.zeros(int(sel.sum()), dtype=torch.long),
            mask=inputs.mask[sel],
            num_seqs=1,
            advantages_per_token=False,
        )
        l_i = policy_loss(one, cfg, denominator=1.0)[0]
        total = total + l_i * n_i
    return total / n_tok * inputs.num_seqs / denominator


@pytest.mark.parametrize("kind", ["gspo", "gspo_token", "grpo"])
def test_microbatch_split_invariance_and_planted_wrong_reduction(kind: str) -> None:
    seqs = [s for s in _seqs(kind, 5) if s.mask.any()]
    cfg = PolicyLossConfig(kind=kind)
    n = len(seqs)
    whole, whole_grads = _split_losses(seqs, cfg, [list(range(n))], n)
    unequal = [[0], list(range(1, 4)), list(range(4, n - 1)), [n - 1]]  # sizes 1, 3, .., 1
    split, split_grads = _split_losses(seqs, cfg, unequal, n)
    torch.testing.assert_close(split, whole, **TIGHT)
    _assert_grads(split_grads, whole_grads)

    # The same check, applied to a length-weighted reduction, must fail: the test can catch it.
    w_whole, w_grads = _split_losses(seqs, cfg, [list(range(n))], n, _token_mean_per_microbatch)
    w_split, w_split_grads = _split_losses(seqs, cfg, unequal, n, _token_mean_per_microbatch)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(w_split, w_whole, **TIGHT)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(w_whole, whole, **TIGHT)


def _cp_shards(seqs, cfg, keep_fns, seq_sum_mode="cp"):
    """Fake context parallelism in one process: each shard holds some tokens of every sequence.

    seq_sum on shard r returns its local [S, k] sums plus the other shards' (recorded in a first
    pass from the same leaves), so autograd flows into every shard, like an all-reduce whose
    backward all-reduces the gradient.
    """
    packs = [
        pack(seqs, gen=torch.Generator().manual_seed(r), keep=k) for r, k in enumerate(keep_fns)
    ]
    recorded: list[Tensor] = []
    for p in packs:

        def record(x: Tensor) -> Tensor:
            recorded.append(x)
            return x

        policy_loss(p.inputs, cfg, denominator=1.0, seq_sum=record)
    total = torch.zeros((), dtype=torch.float64)
    for r, p in enumerate(packs):
        others = [x for q, x in enumerate(recorded) if q != r]
        if seq_sum_mode == "cp":
            seq_sum = lambda x, others=others: x + sum(others)
        else:  # planted bug: no reduction, each shard sees only its own partial sums
            seq_sum = lambda x: x
        total = total + policy_loss(p.inputs, cfg, denominator=len(seqs), seq_sum=seq_sum)[0]
    total.backward()
    return total.detach(), scatter_grad(packs, seqs)


@pytest.mark.parametrize("kind,tis", VALID)
def test_context_parallel_hook(kind: str, tis: str) -> None:
    seqs = _seqs(kind, 7)
    cfg = PolicyLossConfig(kind=kind, tis_mode=tis)
    whole, whole_grads = _cp_shards(seqs, cfg, [lambda i, t: True])
    # Zig-zag-like split with uneven shares; sequence 0 (length 1) lives on shard 0 only.
    halves = [lambda i, t: (t + i) % 3 == 0, lambda i, t: (t + i) % 3 != 0]
    split, split_grads = _cp_shards(seqs, cfg, halves)
    torch.testing.assert_close(split, whole, **TIGHT)
    _assert_grads(split_grads, whole_grads)
    # Planted bug: no reduction (each shard sees its partial sums: s_i and |y_i| are wrong).
    bad, _ = _cp_shards(seqs, cfg, halves, seq_sum_mode="none")
    assert not torch.allclose(bad, whole, rtol=1e-6, atol=1e-8)


def test_garbage_inputs_stay_finite() -> None:
    gen = torch.Generator().manual_seed(11)
    seqs = make_seqs(gen, [4, 7, 1, 3], [1e4, 1e3, 1e5, 50.0], rollout_noise=1e4, garbage=1e30)
    seqs[1].logp[seqs[1].mask] = 1e4
    seqs[1].old[seqs[1].mask] = -1e4
    for kind, tis in VALID:
        cfg = PolicyLossConfig(kind=kind, tis_mode=tis)
        loss, metrics, grads = run_packed(seqs, cfg, 4.0)
        assert torch.isfinite(loss), (kind, tis)
        assert all(torch.isfinite(g).all() for g in grads), (kind, tis)
        assert all(torch.isfinite(v).all() for v in metrics.values()), (kind, tis)
    # NaN / inf at masked positions must not leak into values or gradients.
    seqs = make_seqs(gen, [5, 6], [0.1, 0.1], rollout_noise=0.1, garbage=float("inf"))
    for kind, tis in VALID:
        cfg = PolicyLossConfig(kind=kind, tis_mode=tis)
        loss, _, grads = run_packed(seqs, cfg, 2.0)
        assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)


def test_config_defaults_and_validation() -> None:
    assert (PolicyLossConfig().eps_low, PolicyLossConfig().eps_high) == (3e-4, 4e-4)
    gt = PolicyLossConfig(kind="gspo_token")
    assert (gt.eps_low, gt.eps_high) == (3e-4, 4e-4)
    grpo = PolicyLossConfig(kind="grpo")
    assert (grpo.eps_low, grpo.eps_high) == (0.2, 0.27)
    assert PolicyLossConfig(kind="grpo", eps_low=0.1).eps_low == 0.1
    assert set(POLICY_LOSSES) == {"gspo", "gspo_token", "grpo"}
    bad = {
        "kind": dict(kind="ppo"),
        "eps_low": dict(eps_low=1.5),
        "eps_high": dict(eps_high=-0.1),
        "log_ratio_clamp": dict(log_ratio_clamp=0.0),
        "tis_mode": dict(tis_mode="token"),  # with kind gspo
        "tis_cap": dict(tis_cap=0.0),
    }
    for field, kwargs in bad.items():
        with pytest.raises(ValueError, match=field):
            PolicyLossConfig(**kwargs)
    with pytest.raises(TypeError):
        PolicyLossConfig("gspo")  # kw_only


def test_input_validation() -> None:
    x = torch.zeros(4)
    idx = torch.tensor([0, 0, 1, 1])
    kw = dict(logp=x, old_logp=x, seq_index=idx, mask=x.bool(), num_seqs=2)
    assert PolicyLossInputs(advantages=torch.zeros(2), **kw).advantages_per_token is False
    assert PolicyLossInputs(advantages=torch.zeros(4), **kw).advantages_per_token is True
    with pytest.raises(ValueError, match="advantages"):
        PolicyLossInputs(advantages=torch.zeros(3), **kw)
    with pytest.raises(ValueError, match="old_logp"):
        PolicyLossInputs(advantages=torch.zeros(2), **kw | {"old_logp": torch.zeros(3)})
    with pytest.raises(ValueError, match="advantages_per_token"):
        PolicyLossInputs(advantages=torch.zeros(4), **kw | {"num_seqs": 4})
    inputs = PolicyLossInputs(advantages=torch.zeros(4), **kw)
    with pytest.raises(ValueError, match="per-sequence"):
        policy_loss(inputs, PolicyLossConfig(kind="gspo"), denominator=2)
    inputs = PolicyLossInputs(advantages=torch.zeros(2), **kw)
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(inputs, PolicyLossConfig(kind="grpo", tis_mode="token"), denominator=2)
    with pytest.raises(ValueError, match="denominator"):
        policy_loss(inputs, PolicyLossConfig(), denominator=0)


def test_low_precision_logp_counts_exactly() -> None:
    """bf16 log-probs: sums and counts run in float32 (bf16 cannot count past 256)."""
    x = torch.randn(600, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    inputs = PolicyLossInputs(
        logp=x.requires_grad_(True),
        old_logp=x.detach().float() - 1e-4,
        advantages=torch.tensor([1.0, -1.0]),
        seq_index=torch.arange(600) // 300,
        mask=torch.ones(600, dtype=torch.bool),
        num_seqs=2,
    )
    loss, metrics = policy_loss(inputs, PolicyLossConfig(kind="gspo"), denominator=2)
    loss.backward()
    assert metrics["policy/response_length"].tolist() == [600.0, 2.0]
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert torch.isfinite(loss)


@pytest.mark.parametrize("kind", ["gspo", "grpo"])
def test_seq_outside_clip_counts_sequences_outside_the_band(kind: str) -> None:
    """mismatch/seq_outside_clip: the share of sequences whose mean engine-vs-trainer log-ratio
    lies outside [log(1 - eps_low), log(1 + eps_high)], against a float64 count by hand."""
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 1, 4, 2, 5, 2]
    # per-sequence offsets: inside the GSPO band, outside on each side, and GRPO-sized ones
    offsets = [1e-4, -5e-4, 6e-4, 0.0, 0.25, -0.3]
    seq_index = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    engine = torch.randn(len(seq_index), generator=gen, dtype=torch.float64) - 2
    logp = engine + torch.tensor(offsets, dtype=torch.float64)[seq_index]
    inputs = PolicyLossInputs(
        logp=logp.float(),
        old_logp=engine.float(),
        advantages=torch.ones(len(lengths)),
        seq_index=seq_index,
        mask=torch.ones(len(seq_index), dtype=torch.bool),
        num_seqs=len(lengths),
    )
    cfg = PolicyLossConfig(kind=kind)
    _, metrics = policy_loss(inputs, cfg, denominator=1.0)
    lo, hi = torch.tensor([1 - cfg.eps_low, 1 + cfg.eps_high], dtype=torch.float64).log()
    mean = torch.tensor(offsets, dtype=torch.float64)
    want = float(((mean < lo) | (mean > hi)).sum())
    got_sum, got_count = metrics["mismatch/seq_outside_clip"].tolist()
    assert (got_sum, got_count) == (want, len(lengths))
    assert want == (4.0 if kind == "gspo" else 2.0)  # the case covers both sides
