"""Weight sync: what the engines receive equals the bridge's HF export of the same model.

One 2-rank launch covers TP=2, EP=2, PP=2 and TP=2 x EP=2 (expert TP 1); for each, every
transport (tensor, distributed over gloo with SGLang's own receiver code, disk), a bf16 send,
FP8 quantise-on-send, the version counter and a receiver-side corruption that the checksum must
catch by name; then the rollout package's embedded engine, by tensor and disk.
"""

from __future__ import annotations

import pytest

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.testing.harness import spawn_ranks
from megatron_gspo.weights import fp8
from tests.weights import sync_ranks

pytestmark = pytest.mark.multirank

LAYOUTS = {
    "tp2": dict(tp=2),
    "ep2": dict(ep=2),
    "pp2": dict(pp=2),
    "tp2ep2": dict(tp=2, ep=2, etp=1),
}
BITWISE = [
    "tensor",
    "tensor_hf",
    "tensor_per_tensor_gathers",
    "tensor_bf16",
    "distributed",
    "disk_bf16",
]
HF_TENSORS = 45
"""Tensors of the tiny checkpoint under HF names."""
SGLANG_TENSORS = 3 + 2 * (7 + 2)
"""The same in SGLang's own layout (`weights.layout=engine`): embed, norm, lm_head, and
per layer (2) q/k/v in one qkv_proj with o_proj, the norms and the router (7), and the 4
experts' 12 tensors stacked in w13_weight and w2_weight (2)."""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("sync")
    hf_dir = str(save_tiny_hf_checkpoint(root / "hf", seed=0))
    return spawn_ranks(sync_ranks.main, 2, hf_dir, str(root), LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("transport", BITWISE)
def test_engine_holds_the_export_bitwise(results: list[dict], layout: str, transport: str):
    info = results[0][layout][transport]
    assert info["diff"] == {"missing": [], "extra": [], "unequal": []}, info["diff"]
    # auto is SGLang's layout for the tensor transport without FP8 (the tensor_* rows), hf
    # for the other transports
    hf = transport in ("tensor_hf", "distributed", "disk_bf16")
    assert info["layout"] == ("hf" if hf else "engine")
    assert info["tensors"] == (HF_TENSORS if hf else SGLANG_TENSORS) and info["buckets"] > 1
    assert info["verified"]
    version = str(list(LAYOUTS).index(layout) + 1)  # one sync per layout, same WeightSync
    assert info["version"] == int(version)
    assert set(info["engine_version"].values()) == {version}
    # Every rank returns the sender's report.
    assert results[1][layout][transport]["version"] == info["version"]
    if transport.startswith("disk"):
        assert info["calls"] == ["disk"]
        assert info["disk_config"]["dtype"] == "bfloat16"
        assert "quantization_config" not in info["disk_config"]
    else:
        kind = transport.split("_")[0]
        # One session per sync; the version is stamped once, after the session closed.
        assert info["calls"][0] == "begin" and info["calls"][-2:] == ["end", "version"]
        assert info["calls"].count(kind) == info["buckets"]


def test_experts_reach_only_ep_rank0(results: list[dict]) -> None:
    """EP2: rank 1 owns experts 2-3 and sends them, but receives none of experts 0-1."""
    n_expert_tensors = 2 * 4 * 3  # layers x experts x (gate, up, down)
    assert results[0]["ep2"]["tensor"]["seen_here"] == 45
    assert results[1]["ep2"]["tensor"]["seen_here"] == 45 - n_expert_tensors
    assert results[1]["tp2ep2"]["tensor"]["seen_here"] == 45 - n_expert_tensors
    for layout in ("tp2", "pp2"):  # no EP: TP gathers / PP broadcasts reach every rank
        assert results[1][layout]["tensor"]["seen_here"] == 45


@pytest.mark.parametrize("layout", ["ep2", "tp2ep2"])
def test_expert_gathers_are_batched(results: list[dict], layout: str) -> None:
    """The bridge gathers each expert slot on its own (2 layers x 2 local experts x 3 = 12
    gathers per rank); batched, about one per bucket, with the same bytes arriving (the
    bitwise comparison above covers both paths)."""
    per_tensor = results[0][layout]["tensor_per_tensor_gathers"]
    batched = results[0][layout]["tensor"]
    for rank in (0, 1):
        assert results[rank][layout]["tensor_per_tensor_gathers"]["ep_gathers"] == 12
        assert 0 < results[rank][layout]["tensor"]["ep_gathers"] < 12
    assert results[0][layout]["tensor"]["ep_gathers"] <= batched["buckets"]
    assert per_tensor["tensors"] == batched["tensors"] == SGLANG_TENSORS  # auto: engine


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_within_e4m3_bound(results: list[dict], layout: str):
    info = results[0][layout]["fp8"]["fp8"]
    assert info["name_diff"] == [] and info["bad"] == []
    # q/k/v/o of 2 layers + 3 projections x 4 experts x 2 layers; norms/router/embed/head not.
    assert len(info["quantised"]) == 2 * 4 + 2 * 4 * 3
    assert not any(n.endswith(("norm.weight", "mlp.gate.weight")) for n in info["quantised"])
    assert "lm_head.weight" not in info["quantised"]
    assert "model.embed_tokens.weight" not in info["quantised"]
    assert 0 < info["worst_ratio"] <= 1.0
    assert info["worst_rel"] <= fp8.REL_BOUND


@pytest.mark.parametrize("layout", LAYOUTS)
def test_corrupted_tensor_is_named(results: list[dict], layout: str):
    for rank in (0, 1):  # the failure reaches every trainer rank
        msg = results[rank][layout]["corrupt"]
        assert msg.startswith("WeightIntegrityError"), msg
        assert sync_ranks.CORRUPT in msg


@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_embedded_engine_serves_the_pushed_weights(results: list[dict], transport: str):
    info = results[0]["embedded"][transport]
    assert not info["equal_before"]  # the engine started from other weights
    assert info["equal_after"], info["max_diff"]  # logits bitwise equal to HF on the source
    assert set(info["version"].values()) == {"1"}
    assert info["verified"]


def test_vpp_and_distributed_optimizer(results: list[dict]) -> None:
    info = results[0]["vpp_distopt"]
    assert info["chunks"] == 2  # two virtual pipeline chunks per rank
    assert info["diff"] == {"missing": [], "extra": [], "unequal": []}, info["diff"]
    # SGLang's own layout (weights.layout=engine): 4 layers of 9 tensors (HF: 21), 3 outside
    assert info["tensors"] == 4 * 9 + 3 and info["verified"]


GROUPED = {"tp2": "expert tensor parallel 2", "ep2": "", "pp2": "pipeline parallel", "tp2ep2": ""}
"""Per layout, why `weights.grouped` leaves the experts to the bridge ("": it takes them)."""


@pytest.mark.parametrize("layout", LAYOUTS)
def test_experts_straight_from_the_megatron_parameters(results: list[dict], layout: str) -> None:
    """`weights.grouped_export=auto` (issue 36): with expert-TP 1 and one pipeline stage each
    rank's expert members come straight from its Megatron parameters, bitwise what the
    bridge's export yields for them (names, bytes, EP registry: `grouped_ranks`) and what
    its all-gathered export holds; the bridge then walks no expert tensor (its remaining
    tasks yield the 21 others) and the push's engine holds the export bitwise (above).
    Expert TP 2 and PP 2 fall back to the bridge's experts, naming why."""
    n_local = 2 * 2 * 3  # layers x local experts x (gate, up, down)
    for rank in (0, 1):
        info = results[rank][layout]
        g = info["grouped"]
        assert GROUPED[layout] in g["why"] and bool(g["why"]) == bool(GROUPED[layout]), g["why"]
        direct = 0 if GROUPED[layout] else n_local
        # The one-sender push in SGLang's layout (batched gathers) took them; the other pushes
        # (HF names, per-tensor gathers, FP8, the other transports) walked the bridge's.
        assert info["tensor"]["direct"] == info["tensor_bf16"]["direct"] == direct
        for other in ("tensor_hf", "tensor_per_tensor_gathers", "distributed", "fp8"):
            assert info[other]["direct"] == 0, other
        if GROUPED[layout]:
            continue
        assert g["members"] == g["registered"] == n_local  # each with its EP registry entry
        for key in ("names_differ", "unequal", "unequal_to_export", "stale"):
            assert g[key] == [], (key, g[key][:5])
        assert g["rest_experts"] == [] and g["rest"] == HF_TENSORS - 2 * 4 * 3
        assert g["covered"] == []  # every HF tensor: the bridge's rest or some EP rank's
