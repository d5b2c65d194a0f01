"""Foundation: the tiny MoE built by megatron-bridge runs identically on every parallel layout.

One single-rank launch is the reference; one 2-rank launch runs every layout. For each layout:
full logits (gathered over TP vocab shards, CP chunks, PP stages, DP ranks) and the weight
delta of one Adam step with lr = eps >> |g| (= minus the data-parallel-averaged gradient,
gathered to full HF tensors by the bridge export) must equal the reference to fp32 precision.
A planted wrong shard must fail.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.testing.harness import spawn_ranks
from tests.megatron import foundation_ranks

pytestmark = pytest.mark.multirank

LAYOUTS = {
    "tp2": dict(tp=2),
    "ep2": dict(ep=2),
    "pp2": dict(pp=2),
    "cp2": dict(cp=2),
    "tp2ep2": dict(tp=2, ep=2, etp=1),
}
DISTOPT = ["tp2", "ep2", "tp2ep2"]
PLANTED = "tp2-planted"  # rank-local roll of one TP shard of linear_fc1 of the first expert


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf", seed=0))


@pytest.fixture(scope="module")
def reference(hf_dir: str) -> dict:
    cases = [dict(name="single", layout={}, with_hf=True)]
    return spawn_ranks(foundation_ranks.main, 1, hf_dir, cases)[0]


@pytest.fixture(scope="module")
def parallel(hf_dir: str) -> dict:
    cases = [dict(name=n, layout=lay) for n, lay in LAYOUTS.items()]
    cases += [dict(name=f"{n}-distopt", layout=LAYOUTS[n], distopt=True) for n in DISTOPT]
    cases.append(
        dict(name=PLANTED, layout=LAYOUTS["tp2"], plant="experts.local_experts.0.linear_fc1")
    )
    return spawn_ranks(foundation_ranks.main, 2, hf_dir, cases)


def _initial(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{hf_dir}/model.safetensors")


def _compare(case: dict, ref: dict, init: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(max logit error, worst relative error of the weight deltas = gradients)."""
    logit_err = (case["logits"] - ref["logits"]).abs().max().item()
    worst = 0.0
    assert set(case["weights"]) == set(ref["weights"])
    for name, w in case["weights"].items():
        d, d_ref = w - init[name], ref["weights"][name] - init[name]
        scale = d_ref.abs().max().item() or 1.0
        worst = max(worst, (d - d_ref).abs().max().item() / scale)
    return logit_err, worst


def _last_stage(results: list[dict], name: str) -> dict:
    r = dict(results[0][name])
    if r["logits"] is None:  # PP: the last stage holds logits and loss
        r["logits"], r["loss"] = results[1][name]["logits"], results[1][name]["loss"]
    return r


def test_bridge_logits_equal_hf(reference: dict) -> None:
    err = (reference["single"]["logits"] - reference["hf_logits"]).abs().max().item()
    assert err < 1e-5, err


@pytest.mark.parametrize("name", [*LAYOUTS, *(f"{n}-distopt" for n in DISTOPT)])
def test_layout_matches_single_rank(name: str, parallel: list, reference: dict, hf_dir: str):
    ref = reference["single"]
    case = _last_stage(parallel, name)
    logit_err, grad_err = _compare(case, ref, _initial(hf_dir))
    assert logit_err < 1e-5, f"{name}: logits differ by {logit_err}"
    assert grad_err < 1e-4, f"{name}: gradient (weight delta) relative error {grad_err}"
    assert case["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    # Each rank reports the loss of its own micro-batches; DP/CP ranks average to the global one.
    losses = [r[name]["loss"] for r in parallel if r[name]["loss"] is not None]
    assert sum(losses) / len(losses) == pytest.approx(ref["loss"], rel=1e-5)


def test_planted_wrong_shard_is_caught(parallel: list, reference: dict, hf_dir: str) -> None:
    logit_err, grad_err = _compare(
        _last_stage(parallel, PLANTED), reference["single"], _initial(hf_dir)
    )
    assert logit_err > 1e-3 or grad_err > 1e-2, (logit_err, grad_err)
