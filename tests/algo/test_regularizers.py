"""KL estimators, entropy bonus, token-mean aggregation and overlong shaping against float64
references written from the formulas (one sequence, one token at a time), plus the invariances
the training step relies on (micro-batch split, context-parallel shards)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from megatron_gspo.algo import (
    PolicyLossConfig,
    kl_estimate,
    overlong_penalty,
    regularized_loss,
    sequence_kl,
)

from .cases import SeqData, make_seqs, pack, scatter_grad, to_reference
from .reference import reference_loss
from .test_losses import GRPO_SCALES, GSPO_SCALES, LENGTHS, TIGHT, _assert_grads


# -- independent references ---------------------------------------------------------------
def _ref_kl(logp: Tensor, ref: float, estimator: str, clamp: float) -> Tensor:
    """One token: log r = ref - logp; beyond the clamp the value is a constant (no gradient)."""
    log_r = ref - logp
    if abs(log_r.item()) > clamp:
        log_r = torch.tensor(math.copysign(clamp, log_r.item()), dtype=torch.float64)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return log_r**2 / 2
    return torch.exp(log_r) - 1 - log_r


def _reference_total(
    seqs: list[SeqData],
    ref_logp: list[Tensor],
    cfg: PolicyLossConfig,
    denominator: float,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Policy loss (tests/algo/reference.py, per sequence), + KL, - entropy, aggregated per
    sequence or per token by explicit loops. Returns (loss, d/dlogp, d/dentropy) per sequence."""
    ref_seqs, leaves = to_reference(seqs)
    ents = [s.entropy.clone().requires_grad_(True) for s in seqs]
    kw = dict(kind=cfg.kind, eps_low=cfg.eps_low, eps_high=cfg.eps_high, clamp=cfg.log_ratio_clamp)
    total = torch.zeros((), dtype=torch.float64)
    for i, seq in enumerate(ref_seqs):
        toks = [t for t, m in enumerate(seq.mask) if m]
        if not toks:
            continue
        n = len(toks)
        l_i = reference_loss([seq], denominator=1.0, **kw).loss
        kl = sum(_ref_kl(seq.logp[t], ref_logp[i][t].item(), cfg.kl_estimator, 10.0) for t in toks)
        ent = sum(ents[i][t] for t in toks)
        if cfg.aggregation == "seq_mean":  # l_i as it is; token sums divided by |y_i|
            total = total + l_i + cfg.kl_coef * kl / n - cfg.entropy_coef * ent / n
        else:  # every token weighs 1: l_i (a per-sequence mean) counts |y_i| times
            total = total + n * l_i + cfg.kl_coef * kl - cfg.entropy_coef * ent
    loss = total / denominator
    loss.backward()

    def grads(ts: list[Tensor]) -> list[Tensor]:
        return [
            torch.where(s.mask, t.grad, 0.0) if t.grad is not None else torch.zeros_like(t)
            for s, t in zip(seqs, ts, strict=True)
        ]

    return loss.detach(), grads(leaves), grads(ents)


# -- helpers ----------------------------------------------------------------------------------
def _case(kind: str, seed: int) -> tuple[list[SeqData], list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    scales = GRPO_SCALES if kind == "grpo" else GSPO_SCALES
    seqs = make_seqs(gen, LENGTHS, scales)
    seqs[3].mask[:] = False  # no counted token: contributes nothing, no NaN
    refs = []
    for s in seqs:
        ref = s.logp + torch.randn(len(s.mask), generator=gen, dtype=torch.float64) * 0.3
        ref = torch.where(s.mask, ref, float("nan"))  # garbage where masked
        refs.append(ref)
    t = int(seqs[5].mask.nonzero()[0])
    refs[5][t] = seqs[5].logp[t] + 25.0  # past the +-10 clamp (k3 would overflow otherwise)
    return seqs, refs


def _packed(seqs, refs, keep=None, seed=3):
    p = pack(seqs, gen=torch.Generator().manual_seed(seed), keep=keep)
    p.inputs.ref_logp = torch.tensor([refs[i][t].item() for i, t in p.origin], dtype=torch.float64)
    ent = p.inputs.entropy.detach().clone().requires_grad_(True)
    p.inputs.entropy = ent
    return p, ent


def _scatter(values: Tensor, origin, seqs) -> list[Tensor]:
    out = [torch.zeros(len(s.mask), dtype=torch.float64) for s in seqs]
    for (i, t), v in zip(origin, values.double().tolist(), strict=True):
        out[i][t] += v
    return out


# -- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_their_formulas_and_gradients(estimator: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(64, generator=gen, dtype=torch.float64) * 4).requires_grad_(True)
    ref = logp.detach() + torch.randn(64, generator=gen, dtype=torch.float64)
    ref[0] = logp[0].item() - 40  # clamped: constant value, no gradient
    got = kl_estimate(logp, ref, estimator, clamp=10.0)
    got.sum().backward()
    leaves = [logp.detach()[t].clone().requires_grad_(True) for t in range(64)]
    want = torch.stack([_ref_kl(x, ref[t].item(), estimator, 10.0) for t, x in enumerate(leaves)])
    want.sum().backward()
    torch.testing.assert_close(got.detach(), want.detach(), **TIGHT)
    want_grad = torch.stack([torch.zeros(()) if x.grad is None else x.grad for x in leaves])
    torch.testing.assert_close(logp.grad, want_grad.double(), **TIGHT)
    assert logp.grad[0] == 0
    same = kl_estimate(logp.detach(), logp.detach(), estimator)
    assert torch.equal(same, torch.zeros_like(same))  # policy == reference: exactly 0
    if estimator != "k1":
        assert (got >= 0).all()


def test_kl_estimators_estimate_the_true_kl() -> None:
    """Monte Carlo over y ~ p: E[k1] = E[k3] = KL(p || q) exactly (unbiased), k2 close."""
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64) * 0.5, 0)
    q = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64) * 0.5, 0)
    exact = (p * (p.log() - q.log())).sum().item()
    y = torch.multinomial(p, 400_000, replacement=True, generator=gen)
    for est, tol in (("k1", 4.0), ("k3", 4.0), ("k2", None)):
        k = kl_estimate(p.log()[y], q.log()[y], est)
        err = abs(k.mean().item() - exact)
        if tol is None:
            assert err < 0.1 * exact, (est, k.mean().item(), exact)  # biased, small here
        else:
            assert err < tol * k.std().item() / math.sqrt(y.numel()), (est, err)


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean"])
@pytest.mark.parametrize("kind", ["gspo", "gspo_token", "grpo"])
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_total_loss_matches_float64_reference(kind, aggregation, estimator) -> None:
    seqs, refs = _case(kind, seed=2)
    cfg = PolicyLossConfig(
        kind=kind,
        aggregation=aggregation,
        kl_coef=0.3,
        kl_estimator=estimator,
        entropy_coef=0.05,
    )
    denominator = 23.0  # the global count (sequences or tokens), not this micro-batch's
    want, want_lp, want_ent = _reference_total(seqs, refs, cfg, denominator)
    p, ent = _packed(seqs, refs)
    loss, metrics = regularized_loss(p.inputs, cfg, denominator=denominator)
    loss.backward()
    torch.testing.assert_close(loss.detach(), want, **TIGHT)
    _assert_grads(scatter_grad([p], seqs), want_lp)
    _assert_grads(_scatter(ent.grad, p.origin, seqs), want_ent)
    # kl/mean: per loss token, the estimator itself
    mask = p.inputs.mask
    k = kl_estimate(p.inputs.logp.detach(), p.inputs.ref_logp, estimator)
    assert metrics["kl/mean"][1].item() == mask.sum().item()
    assert metrics["kl/mean"][0].item() == pytest.approx(k[mask].sum().item(), rel=1e-6)
    for name, value in metrics.items():
        assert torch.isfinite(value).all(), name


def test_token_mean_differs_from_seq_mean_and_terms_are_off_by_default() -> None:
    seqs, refs = _case("grpo", seed=4)
    out = {}
    for agg in ("seq_mean", "token_mean"):
        p, _ = _packed(seqs, refs)
        out[agg] = regularized_loss(
            p.inputs, PolicyLossConfig(kind="grpo", aggregation=agg), denominator=1.0
        )[0]
    assert not torch.allclose(out["seq_mean"], out["token_mean"])  # unequal lengths
    # Defaults: the loss is the policy loss alone (ref_logp only adds the kl/mean metric).
    p, _ = _packed(seqs, refs)
    from megatron_gspo.algo import policy_loss

    base, _ = policy_loss(p.inputs, PolicyLossConfig(kind="grpo"), denominator=1.0)
    reg, metrics = regularized_loss(p.inputs, PolicyLossConfig(kind="grpo"), denominator=1.0)
    assert torch.equal(base, reg) and "kl/mean" in metrics and "kl/loss" not in metrics


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean"])
def test_micro_batches_and_context_parallel_shards_add_up(aggregation: str) -> None:
    """Global normaliser: split into micro-batches (each with the GLOBAL denominator) or into
    CP shards (seq_sum all-reducing per-sequence sums), the shares sum to the whole loss and
    gradient."""
    seqs, refs = _case("grpo", seed=5)
    cfg = PolicyLossConfig(kind="grpo", aggregation=aggregation, kl_coef=0.2, entropy_coef=0.1)
    tokens = sum(int(s.mask.sum()) for s in seqs)
    d = float(tokens if aggregation == "token_mean" else len(seqs))
    whole, whole_lp, whole_ent = _reference_total(seqs, refs, cfg, d)
    # micro-batches: sequences split 5 / 7, each micro-batch its own pack
    total, grads, ent_grads = torch.zeros((), dtype=torch.float64), None, None
    parts = [list(range(5)), list(range(5, len(seqs)))]
    got_lp = [torch.zeros(len(s.mask), dtype=torch.float64) for s in seqs]
    got_ent = [torch.zeros(len(s.mask), dtype=torch.float64) for s in seqs]
    for part in parts:
        sub = [seqs[i] for i in part]
        p, ent = _packed(sub, [refs[i] for i in part])
        loss, _ = regularized_loss(p.inputs, cfg, denominator=d)
        loss.backward()
        total = total + loss.detach()
        for j, (g, e) in enumerate(
            zip(scatter_grad([p], sub), _scatter(ent.grad, p.origin, sub), strict=True)
        ):
            got_lp[part[j]] += g
            got_ent[part[j]] += e
    torch.testing.assert_close(total, whole, **TIGHT)
    _assert_grads(got_lp, whole_lp)
    _assert_grads(got_ent, whole_ent)
    del grads, ent_grads
    # CP shards: a token of sequence i goes to shard (t + i) % 3 == 0; each seq_sum call adds
    # the other shard's recorded sums of the same call (an all-reduce, autograd included).
    keeps = [lambda i, t: (t + i) % 3 == 0, lambda i, t: (t + i) % 3 != 0]
    shards = [_packed(seqs, refs, keep=k, seed=r) for r, k in enumerate(keeps)]
    recorded: list[list[Tensor]] = [[], []]
    for r, (p, _) in enumerate(shards):
        regularized_loss(p.inputs, cfg, denominator=d, seq_sum=lambda x, r=r: _rec(recorded[r], x))
    total = torch.zeros((), dtype=torch.float64)
    for r, (p, _) in enumerate(shards):
        calls = iter(range(len(recorded[r])))
        other = recorded[1 - r]

        def seq_sum(x: Tensor, calls=calls, other=other) -> Tensor:
            return x + other[next(calls)].detach()

        total = total + regularized_loss(p.inputs, cfg, denominator=d, seq_sum=seq_sum)[0]
    total.backward()
    torch.testing.assert_close(total.detach(), whole, **TIGHT)
    # token-level terms: each token's gradient lives on its own shard (GRPO needs no CP grad)
    _assert_grads(scatter_grad([p for p, _ in shards], seqs), whole_lp)
    ent_cp = [torch.zeros(len(s.mask), dtype=torch.float64) for s in seqs]
    for p, ent in shards:
        for k, v in enumerate(_scatter(ent.grad, p.origin, seqs)):
            ent_cp[k] += v
    _assert_grads(ent_cp, whole_ent)


def _rec(store: list[Tensor], x: Tensor) -> Tensor:
    store.append(x.detach().clone())
    return x


def test_sequence_kl_sums_the_masked_tokens() -> None:
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.5, -9.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 0])
    got = sequence_kl(logp, ref, mask, torch.tensor([0, 0, 1, 1]), 2, "k3")
    k3 = [math.exp(r - lp) - 1 - (r - lp) for lp, r in zip(logp.tolist(), ref.tolist())]
    assert got.tolist() == pytest.approx([k3[0] + k3[1], k3[2]], abs=1e-15)


def _dapo(n: int, l_max: int, buf: int) -> float:
    """DAPO eq. 13 as written in the paper."""
    if n <= l_max - buf:
        return 0.0
    if n <= l_max:
        return ((l_max - buf) - n) / buf
    return -1.0


def test_overlong_penalty_is_dapo_eq_13() -> None:
    lengths = torch.arange(0, 30)
    got = overlong_penalty(lengths, 24, 8, factor=0.5)
    want = [0.5 * _dapo(n, 24, 8) for n in range(30)]
    assert got.tolist() == pytest.approx(want, abs=1e-15)
    assert got[16] == 0 and got[20] == -0.25 and got[24] == -0.5 and got[29] == -0.5
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 4, 5)


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        (dict(aggregation="mean"), "loss.aggregation"),
        (dict(kl_estimator="k4"), "loss.kl_estimator"),
        (dict(kl_coef=-1.0), "loss.kl_coef"),
        (dict(entropy_coef=-0.1), "loss.entropy_coef"),
        (dict(kl_in_reward=True), "loss.kl_coef"),
        (dict(ref_offload=True), "loss.kl_coef"),
    ],
)
def test_config_refuses_bad_values_naming_the_key(kw, key) -> None:
    from megatron_gspo.config_io import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        PolicyLossConfig(**kw)


def test_missing_inputs_are_refused() -> None:
    seqs, refs = _case("gspo", 6)
    p, _ = _packed(seqs, refs)
    p.inputs.ref_logp = None
    with pytest.raises(ValueError, match="ref_logp"):
        regularized_loss(p.inputs, PolicyLossConfig(kl_coef=0.1), denominator=1.0)
    p.inputs.entropy = None
    with pytest.raises(ValueError, match="entropy"):
        regularized_loss(p.inputs, PolicyLossConfig(entropy_coef=0.1), denominator=1.0)
