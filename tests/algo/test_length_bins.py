"""Mismatch metrics per response-length bin, through `policy_loss`, against a per-sequence
float64 reference written out here."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.algo import PolicyLossConfig, policy_loss
from megatron_gspo.algo.length_bins import LENGTH_BINS, bin_label

from .cases import make_seqs, pack


@pytest.mark.parametrize("kind", ["gspo", "grpo"])
def test_binned_mismatch_matches_a_per_sequence_reference(kind):
    gen = torch.Generator().manual_seed(7)
    lengths = [6, 20, 25, 40, 50, 90, 170, 300, 33, 3]
    seqs = make_seqs(gen, lengths, [0.01] * len(lengths), rollout_noise=4e-3, mask_prob=0.1)
    seqs[-1].mask[:] = False  # a sequence without response tokens counts nowhere
    cfg = PolicyLossConfig(kind=kind)
    _, metrics = policy_loss(pack(seqs, gen=gen).inputs, cfg, denominator=len(seqs))

    lo_log, hi_log = math.log1p(-cfg.eps_low), math.log1p(cfg.eps_high)
    expected: dict[str, list[float]] = {}
    for s in seqs:
        n = int(s.mask.sum())
        if n == 0:
            continue
        diffs = [float(s.logp[t] - s.rollout[t]) for t in range(len(s.mask)) if s.mask[t]]
        mean = sum(diffs) / n
        (lo, hi) = next(b for b in LENGTH_BINS if n >= b[0] and (b[1] is None or n <= b[1]))
        label = bin_label(lo, hi)
        expected.setdefault(f"mismatch/seq_outside_clip_len/{label}", []).append(
            float(not lo_log <= mean <= hi_log)
        )
        expected.setdefault(f"mismatch/seq_log_ratio_abs_len/{label}", []).append(abs(mean))
    got = {k: v for k, v in metrics.items() if "_len/" in k and v[1] > 0}
    assert sorted(got) == sorted(expected)
    for k, vals in expected.items():
        assert got[k][1].item() == len(vals), k
        assert got[k][0].item() == pytest.approx(sum(vals), rel=1e-5, abs=1e-7), k
    # The bins partition the sequences the unbinned metric counts.
    counts = sum(v[1] for k, v in got.items() if k.startswith("mismatch/seq_outside_clip_len"))
    assert counts == metrics["mismatch/seq_outside_clip"][1]
