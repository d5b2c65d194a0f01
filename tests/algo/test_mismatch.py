"""Mismatch masks (loss.seq_mismatch_mask, loss.token_mismatch_mask) against float64 loops, and
the masked policy loss against the float64 reference run on the kept tokens only."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_gspo.algo import (
    PolicyLossConfig,
    identity_seq_sum,
    mismatch_keep_mask,
    policy_loss,
    sequence_mismatch_keep,
    token_mismatch_keep,
)
from megatron_gspo.config_io import ConfigError

from .cases import SeqData, make_seqs, pack, run_reference, scatter_grad

TIGHT = dict(rtol=1e-10, atol=1e-13)
LENGTHS = [1, 2, 3, 5, 8, 13, 1, 4, 6, 7, 9, 2]
GSPO_SCALES = [1e-6, 2e-5, 1e-2, 3e-2, 0.5, 1e-6, 5e-3, 1.0, 1e-6, 30.0, 2e-2, 1e-5]
GRPO_SCALES = [0.05, 0.3, 0.6, 0.1, 1.0, 0.02, 0.4, 0.2, 0.7, 30.0, 0.15, 0.05]


def _inside(x: float, low: float, high: float) -> bool:
    return low <= x <= high  # False for NaN


def test_pure_masks_match_float64_loops() -> None:
    gen = torch.Generator().manual_seed(0)
    low, high = 0.999, 1.002
    engine = -torch.rand(400, generator=gen, dtype=torch.float64) * 4
    d = torch.randn(400, generator=gen, dtype=torch.float64) * 2e-3
    d[:4] = torch.tensor([math.log(low) + 1e-12, math.log(high) - 1e-12, 1e-3, -2e-3])
    trainer = (engine + d).float()  # the trainer's are float32, as packed
    trainer[4], engine[5], trainer[6] = float("nan"), float("inf"), -float("inf")
    got = token_mismatch_keep(trainer, engine, low=low, high=high)
    want = [
        _inside(math.exp(t - e) if math.isfinite(t - e) else math.nan, low, high)
        for t, e in zip(trainer.double().tolist(), engine.tolist(), strict=True)
    ]
    assert got.tolist() == want and 0 < sum(want) < len(want)

    count = torch.randint(0, 40, (300,), generator=gen).double()
    total = torch.randn(300, generator=gen, dtype=torch.float64) * 2e-3 * count
    total[0] = float("nan")
    got = sequence_mismatch_keep(total, count, low=low, high=high)
    want = [
        n == 0 or _inside(math.exp(s / n), low, high)
        for s, n in zip(total.tolist(), count.tolist(), strict=True)
    ]
    assert got.tolist() == want and 0 < sum(want) < len(want)


def test_keep_mask_and_fractions_match_loops() -> None:
    """Both masks together on packed, interleaved tokens with NaN garbage outside the mask."""
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 1, 7, 5, 2, 9, 4]
    seq_index = torch.repeat_interleave(torch.arange(7), torch.tensor(lengths))
    perm = torch.randperm(seq_index.numel(), generator=gen)
    seq_index = seq_index[perm]
    t = seq_index.numel()
    mask = torch.rand(t, generator=gen) > 0.2
    mask[seq_index == 1] = False  # a sequence with no response token
    engine = -torch.rand(t, generator=gen, dtype=torch.float64) * 3
    trainer = engine + torch.randn(t, generator=gen, dtype=torch.float64) * 0.05
    trainer[~mask] = float("nan")
    seq_b, tok_b = [0.98, 1.02], [0.95, 1.05]
    keep, metrics = mismatch_keep_mask(
        mask,
        trainer,
        engine,
        seq_index,
        7,
        seq_bounds=seq_b,
        token_bounds=tok_b,
        seq_sum=identity_seq_sum,
    )
    want_keep, seq_out, tok_out, valid = [], 0, 0, 0
    seq_ok = {}
    for i in range(7):
        toks = [j for j in range(t) if seq_index[j] == i and mask[j]]
        if toks:
            valid += 1
            g = math.exp(sum(trainer[j].item() - engine[j].item() for j in toks) / len(toks))
            seq_ok[i] = _inside(g, *seq_b)
            seq_out += not seq_ok[i]
    for j in range(t):
        if not mask[j]:
            want_keep.append(False)
            continue
        tok_ok = _inside(math.exp(trainer[j].item() - engine[j].item()), *tok_b)
        tok_out += not tok_ok
        want_keep.append(tok_ok and seq_ok[int(seq_index[j])])
    assert keep.tolist() == want_keep
    assert 0 < seq_out < valid and 0 < tok_out < int(mask.sum())
    assert metrics["loss/seq_mismatch_masked"].tolist() == [seq_out, valid]
    assert metrics["loss/token_mismatch_masked"].tolist() == [tok_out, int(mask.sum())]


# Where pi_trainer at the rollout weights comes from (losses.py, PolicyLossInputs):
#   recompute: old_logp (trainer), rollout_logp (engine)
#   first_mb:  the current logp (trainer), old_logp = the engine's
#   given:     trainer_old_logp (a later mini-batch with pi_old from the engine)
SOURCES = ["recompute", "first_mb", "given"]
MASKS = ["seq", "token", "both"]


def _trainer_engine(seqs: list[SeqData], source: str, gen: torch.Generator):
    """Per sequence: the trainer's and the engine's [n] log-probs for `source`."""
    out = []
    for s in seqs:
        if source == "recompute":
            out.append((s.old, s.rollout))
        elif source == "first_mb":
            out.append((s.logp, s.old))
        else:
            out.append((s.old + torch.randn(len(s.old), generator=gen).double() * 0.1, s.old))
    return out


def _bounds(pairs, seqs: list[SeqData]) -> tuple[list[float], list[float]]:
    """Bands at the median |log ratio|: about half of the tokens / sequences leave them."""
    tok = torch.cat([(tr - en)[s.mask] for (tr, en), s in zip(pairs, seqs, strict=True)])
    seq = torch.tensor(
        [(tr - en)[s.mask].mean() for (tr, en), s in zip(pairs, seqs, strict=True) if s.mask.any()]
    )
    qt, qs = tok.abs().median().item(), seq.abs().median().item()
    return [math.exp(-qs), math.exp(qs)], [math.exp(-qt), math.exp(qt)]


def _reference_masked(seqs, pairs, seq_b, tok_b, cfg, denominator):
    """The unmasked float64 reference on the kept tokens; counts of what was left out."""
    kept, seq_out, tok_out = [], 0, 0
    for s, (tr, en) in zip(seqs, pairs, strict=True):
        mask = s.mask.clone()
        toks = [t for t in range(len(mask)) if mask[t]]
        if tok_b is not None:
            for t in toks:
                if not _inside(math.exp(tr[t].item() - en[t].item()), *tok_b):
                    mask[t] = False
                    tok_out += 1
        if seq_b is not None and toks:
            g = math.exp(sum(tr[t].item() - en[t].item() for t in toks) / len(toks))
            if not _inside(g, *seq_b):
                mask[:] = False
                seq_out += 1
        kept.append(dataclasses.replace(s, mask=mask))
    res, grads = run_reference(kept, cfg, denominator)
    return res, grads, seq_out, tok_out


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("kind", ["gspo", "gspo_token", "grpo"])
def test_masked_loss_matches_float64_reference(kind: str, masks: str, source: str) -> None:
    gen = torch.Generator().manual_seed(7)
    scales = GRPO_SCALES if kind == "grpo" else GSPO_SCALES
    seqs = make_seqs(gen, LENGTHS, scales, rollout_noise=0.3 if source == "recompute" else None)
    pairs = _trainer_engine(seqs, source, gen)
    seq_b, tok_b = _bounds(pairs, seqs)
    seq_b = seq_b if masks in ("seq", "both") else None
    tok_b = tok_b if masks in ("token", "both") else None
    cfg = PolicyLossConfig(kind=kind, seq_mismatch_mask=seq_b, token_mismatch_mask=tok_b)
    plain = PolicyLossConfig(kind=kind)
    denominator = 17.0
    ref, ref_grads, seq_out, tok_out = _reference_masked(
        seqs, pairs, seq_b, tok_b, plain, denominator
    )
    valid = sum(bool(s.mask.any()) for s in seqs)
    tokens = int(sum(s.mask.sum() for s in seqs))

    p = pack(seqs, gen=torch.Generator().manual_seed(3))
    inputs = p.inputs
    if source == "given":
        given = torch.tensor([pairs[i][0][t].item() for i, t in p.origin], dtype=torch.float64)
        inputs = dataclasses.replace(inputs, trainer_old_logp=given)
    loss, metrics = policy_loss(inputs, cfg, denominator=denominator)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref.loss.detach(), **TIGHT)
    for i, (g, w) in enumerate(zip(scatter_grad([p], seqs), ref_grads, strict=True)):
        torch.testing.assert_close(g, w, **TIGHT, msg=lambda m, i=i: f"seq {i}: {m}")
    assert sum(g.abs().sum() for g in ref_grads) > 0  # something is still trained
    if seq_b is not None:
        assert 0 < seq_out < valid
        assert metrics["loss/seq_mismatch_masked"].tolist() == [seq_out, valid]
    if tok_b is not None:
        assert 0 < tok_out < tokens
        assert metrics["loss/token_mismatch_masked"].tolist() == [tok_out, tokens]

    # The metrics that describe the rollout stay over every response token.
    _, unmasked = policy_loss(inputs, plain, denominator=denominator)
    for k in ("mismatch/abs_logp_diff", "mismatch/seq_log_ratio_abs", "policy/response_length"):
        torch.testing.assert_close(metrics[k], unmasked[k], rtol=0, atol=0)


def test_bands_that_keep_everything_change_nothing() -> None:
    seqs = make_seqs(torch.Generator().manual_seed(2), LENGTHS, GSPO_SCALES, rollout_noise=0.3)
    wide = PolicyLossConfig(seq_mismatch_mask=[1e-30, 1e30], token_mismatch_mask=[1e-30, 1e30])
    runs = []
    for cfg in (PolicyLossConfig(), wide):
        p = pack(seqs, gen=torch.Generator().manual_seed(1))
        loss, metrics = policy_loss(p.inputs, cfg, denominator=9.0)
        loss.backward()
        runs.append((loss.detach(), metrics, p.leaf.grad))
    (l0, m0, g0), (l1, m1, g1) = runs
    assert torch.equal(l0, l1) and torch.equal(g0, g1)
    assert m1.pop("loss/seq_mismatch_masked")[0] == 0
    assert m1.pop("loss/token_mismatch_masked")[0] == 0
    assert m0.keys() == m1.keys() and all(torch.equal(m0[k], m1[k]) for k in m0)


@pytest.mark.parametrize(
    "value",
    [[1.001, 1.002], [0.9, 0.99], [0.0, 1.1], [1.0, 1.0], [0.9], [0.9, 1.1, 1.2]],
)
@pytest.mark.parametrize("key", ["seq_mismatch_mask", "token_mismatch_mask"])
def test_bad_bands_name_the_key(key: str, value: list[float]) -> None:
    with pytest.raises(ConfigError, match=f"change loss.{key}"):
        PolicyLossConfig(**{key: value})
