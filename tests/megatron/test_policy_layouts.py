"""GSPO on real megatron-core: loss, gradients and metrics are identical for every layout.

One single-rank launch is the reference, one 2-rank launch runs DP=2, TP=2(+SP), CP=2, PP=2
(1F1B), PP=2 interleaved (VPP=2, with a padding micro-batch), EP=2 and TP=2+EP=2 on packed
sequences of unequal lengths split into micro-batches of unequal sizes (and a different
micro-batch split per layout). Gradients are compared as the weight delta of an Adam step with
lr = eps >> |g|, gathered to full HF tensors.
Planted reductions (per-micro-batch mean; length-weighted) must fail the same comparison.
The token-mean aggregation with the KL and entropy terms on (loss.aggregation=token_mean,
loss.kl_coef, loss.entropy_coef) is compared the same way at DP=2, CP=2 and PP=2.

LM head: the GSPO reference runs the unfused path (output-layer logits, then the chunked
log-softmax), every parallel layout the fused LM head (the default), so each layout comparison
is also fused-vs-current; a tied-embeddings model on PP=2 (the last stage's copy of the
embedding) is compared the same way, and the fused head on one rank must match the unfused one
to fp32 round-off.
"""

from __future__ import annotations

import math

import pytest

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.testing.harness import spawn_ranks
from tests.megatron import policy_ranks

pytestmark = pytest.mark.multirank

LAYOUTS = {
    "dp2": dict(),
    "tp2": dict(tp=2),
    "cp2": dict(cp=2),
    "pp2": dict(pp=2),
    "pp2vpp2": dict(pp=2, vpp=2),
    "ep2": dict(ep=2),
    "tp2ep2": dict(tp=2, ep=2, etp=1),
}
EXTRA = {  # name: (layout, kind, distopt)
    "cp2-grpo": ("cp2", "grpo", False),
    "dp2-gspo_token": ("dp2", "gspo_token", False),
    "ep2-distopt": ("ep2", "gspo", True),
}
# loss.aggregation=token_mean with the KL (k3) and entropy terms on
REG = dict(aggregation="token_mean", kl_coef=0.5, kl_estimator="k3", entropy_coef=0.05)
REG_LAYOUTS = ("dp2", "cp2", "pp2")
GRAD_TOL, METRIC_TOL = 2e-4, 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # four layers: the interleaved case needs pp * vpp = 4 model chunks
    path = tmp_path_factory.mktemp("tiny") / "hf"
    save_tiny_hf_checkpoint(f"{path}-tied", seed=0, num_hidden_layers=4, tie_word_embeddings=True)
    return str(save_tiny_hf_checkpoint(path, seed=0, num_hidden_layers=4))


@pytest.fixture(scope="module")
def reference(hf_dir: str) -> dict:
    cases = [dict(name="gspo", layout={}, kind="gspo", fused=False)]  # the current LM head path
    cases += [dict(name=k, layout={}, kind=k) for k in ("gspo_token", "grpo")]
    cases.append(dict(name="gspo-fused", layout={}, kind="gspo"))
    cases.append(dict(name="tied", layout={}, fused=False, hf_dir=f"{hf_dir}-tied"))
    cases.append(dict(name="micro_batch_mean", layout={}, plant="micro_batch_mean"))
    cases.append(dict(name="token_mean", layout={}, loss=REG))
    return spawn_ranks(policy_ranks.main, 1, hf_dir, cases)[0]


@pytest.fixture(scope="module")
def parallel(hf_dir: str) -> list[dict]:
    cases = [dict(name=n, layout=lay) for n, lay in LAYOUTS.items()]
    cases.append(dict(name="pp2-tied", layout=LAYOUTS["pp2"], hf_dir=f"{hf_dir}-tied"))
    cases.append(dict(name="tp2-unfused", layout=LAYOUTS["tp2"], fused=False))
    cases += [
        dict(name=n, layout=LAYOUTS[lay], kind=k, distopt=d) for n, (lay, k, d) in EXTRA.items()
    ]
    cases += [
        dict(name="dp2-micro_batch_mean", layout={}, plant="micro_batch_mean"),
        dict(name="dp2-length_weighted", layout={}, plant="length_weighted"),
    ]
    cases += [dict(name=f"{n}-token_mean", layout=LAYOUTS[n], loss=REG) for n in REG_LAYOUTS]
    return spawn_ranks(policy_ranks.main, 2, hf_dir, cases)


def _grad_err(weights: dict, ref_weights: dict, init: dict) -> float:
    worst = 0.0
    for name, w in weights.items():
        d, d_ref = w - init[name], ref_weights[name] - init[name]
        worst = max(worst, (d - d_ref).abs().max().item() / (d_ref.abs().max().item() or 1.0))
    return worst


@pytest.fixture(scope="module")
def init(hf_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{hf_dir}/model.safetensors")


def _same_step(got: dict, ref: dict, init: dict, grad_tol: float, metric_tol: float) -> None:
    err = _grad_err(got["weights"], ref["weights"], init)
    assert err < grad_tol, f"gradient relative error {err}"
    assert set(got["metrics"]) == set(ref["metrics"])
    for k, v in ref["metrics"].items():
        if not math.isnan(v):
            assert got["metrics"][k] == pytest.approx(v, rel=metric_tol, abs=1e-6), k
    assert got["current"].keys() == ref["current"].keys()
    assert (
        max((got["current"][k] - ref["current"][k]).abs().max().item() for k in ref["current"])
        < 1e-5
    )


def test_fused_lm_head_matches_unfused_on_one_rank(reference, init) -> None:
    """Loss, metrics, log-probs and every weight's gradient (the output weight's, and through
    the hidden states every layer below): fused vs the output layer + chunked log-softmax."""
    assert reference["gspo-fused"]["fused_calls"] > 0 and reference["gspo"]["fused_calls"] == 0
    _same_step(reference["gspo-fused"], reference["gspo"], init, grad_tol=2e-5, metric_tol=1e-6)


@pytest.mark.parametrize("name", ["pp2-tied", "tp2-unfused"])
def test_tied_and_unfused_layouts(name, parallel, reference, hf_dir) -> None:
    """Tied embeddings on PP=2 (fused) vs tied on one rank (unfused); the unfused path on TP=2."""
    from safetensors.torch import load_file

    tied = name.endswith("tied")
    # The last stage (rank 1 on PP=2) ran the fused head, or nobody did.
    assert (parallel[1][name]["fused_calls"] > 0) == tied
    ref = reference["tied" if tied else "gspo"]
    init = load_file(f"{hf_dir}{'-tied' if tied else ''}/model.safetensors")
    _same_step(parallel[0][name], ref, init, grad_tol=GRAD_TOL, metric_tol=METRIC_TOL)


def _metrics(results: list[dict], name: str) -> dict:
    return results[0][name]["metrics"]


@pytest.mark.parametrize("name", [*LAYOUTS, *EXTRA])
def test_policy_step_matches_single_rank(name, parallel, reference, init) -> None:
    kind = EXTRA[name][1] if name in EXTRA else "gspo"
    ref = reference[kind]
    got = parallel[0][name]
    assert sum(r[name]["fused_calls"] for r in parallel) > 0, "the fused LM head did not run"
    err = _grad_err(got["weights"], ref["weights"], init)
    assert err < GRAD_TOL, f"{name}: gradient relative error {err}"
    m, m_ref = got["metrics"], ref["metrics"]
    assert set(m) == set(m_ref)
    for k, v in m_ref.items():
        if math.isnan(v):
            continue
        assert m[k] == pytest.approx(v, rel=METRIC_TOL, abs=1e-6), f"{name}: metric {k}"
    # both ranks agree on the reduced metrics
    assert parallel[1][name]["metrics"]["loss"] == pytest.approx(m["loss"], rel=1e-6)


def test_reference_exercises_both_clip_sides(reference) -> None:
    m = reference["gspo"]["metrics"]
    assert 0 < m["policy/clip_frac_low"] < 1 and 0 < m["policy/clip_frac_high"] < 1
    assert 0 < m["policy/clip_frac"] < 1


def test_layouts_split_micro_batches_differently(parallel, reference) -> None:
    counts = {parallel[0]["dp2"]["num_micro_batches"], reference["gspo"]["num_micro_batches"]}
    assert len(counts) == 2, "the DP split must change the micro-batch partition"


def test_interleaved_case_runs_the_steady_state(parallel) -> None:
    # VPP pads the micro-batch count to a multiple of pp; >= 2 * pp reaches the steady state where
    # one p2p call carries both directions (the case patch mcore-p2p-two-rank-order fixes)
    n = parallel[0]["pp2vpp2"]["num_micro_batches"]
    assert n % 2 == 0 and n >= 4, n


def test_gspo_token_with_constant_advantages_equals_gspo(reference, init) -> None:
    err = _grad_err(reference["gspo_token"]["weights"], reference["gspo"]["weights"], init)
    assert err < GRAD_TOL
    assert reference["gspo_token"]["metrics"]["loss"] == pytest.approx(
        reference["gspo"]["metrics"]["loss"], rel=1e-5
    )


def test_current_logprobs_match_across_layouts(parallel, reference) -> None:
    ref = reference["gspo"]["current"]
    for name in LAYOUTS:
        cur = parallel[0][name]["current"]
        assert cur.keys() == ref.keys()
        assert max((cur[k] - ref[k]).abs().max().item() for k in ref) < 1e-5, name


def test_planted_micro_batch_mean_is_caught(parallel, reference, init) -> None:
    err = _grad_err(
        parallel[0]["dp2-micro_batch_mean"]["weights"],
        reference["micro_batch_mean"]["weights"],
        init,
    )
    assert err > 100 * GRAD_TOL, f"a per-micro-batch mean went unnoticed ({err})"


def test_planted_length_weighting_is_caught(parallel, reference, init) -> None:
    err = _grad_err(
        parallel[0]["dp2-length_weighted"]["weights"], reference["gspo"]["weights"], init
    )
    assert err > 100 * GRAD_TOL, f"a length-weighted reduction went unnoticed ({err})"


@pytest.mark.parametrize("name", REG_LAYOUTS)
def test_token_mean_with_kl_and_entropy_matches_single_rank(name, parallel, reference, init):
    """The global token normaliser (num_tokens = loss tokens, every CP shard its own) and the
    added terms are layout-invariant; the case differs from the sequence mean (it can fail)."""
    ref, got = reference["token_mean"], parallel[0][f"{name}-token_mean"]
    err = _grad_err(got["weights"], ref["weights"], init)
    assert err < GRAD_TOL, f"{name}: gradient relative error {err}"
    m, m_ref = got["metrics"], ref["metrics"]
    assert set(m) == set(m_ref) and {"kl/mean", "kl/loss", "entropy/loss"} <= set(m)
    for k, v in m_ref.items():
        assert m[k] == pytest.approx(v, rel=METRIC_TOL, abs=1e-6), f"{name}: metric {k}"
    assert m_ref["kl/mean"] > 1e-4  # pi_ref differs: the KL term is live
    assert _grad_err(ref["weights"], reference["gspo"]["weights"], init) > 100 * GRAD_TOL
