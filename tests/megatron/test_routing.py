"""`moe/routing_flip_rate` measured on megatron-core's routers equals the rate computed from the
Hugging Face model's router logits (one unpadded sequence at a time), for every layout.

Checkpoint B is checkpoint A with noise on the router weights, sized so that some but not all
(token, layer) top-k sets change. Snapshots of identical weights must give exactly 0.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.testing.harness import spawn_ranks
from tests.megatron import routing_ranks

pytestmark = pytest.mark.multirank

LAYOUTS = {
    "dp2": dict(),
    "tp2-sp": dict(tp=2),
    "ep2": dict(ep=2),
    "pp2": dict(pp=2),
    "cp2": dict(cp=2),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("routing")
    hf_a = save_tiny_hf_checkpoint(root / "a", seed=0)
    hf_b = save_tiny_hf_checkpoint(root / "b", seed=0)
    weights = load_file(f"{hf_b}/model.safetensors")
    g = torch.Generator().manual_seed(1)
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):
            w += 0.5 * w.std() * torch.randn(w.shape, generator=g)
    save_file(weights, f"{hf_b}/model.safetensors", metadata={"format": "pt"})
    g = torch.Generator().manual_seed(2)
    raw = [
        torch.randint(3, 128, (int(torch.randint(3, 15, (1,), generator=g)),), generator=g).tolist()
        for _ in range(9)
    ]
    return {"a": str(hf_a), "b": str(hf_b), "raw": raw}


def _hf_topk(path: str, raw: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    out = []
    with torch.no_grad():
        for ids in raw:
            logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
            out.append(torch.stack([lg.topk(k, dim=-1).indices.sort(-1).values for lg in logits]))
    return out  # per sequence: [layers, tokens, k]


@pytest.fixture(scope="module")
def reference(setup: dict) -> float:
    a, b = _hf_topk(setup["a"], setup["raw"]), _hf_topk(setup["b"], setup["raw"])
    flips = sum((x != y).any(-1).sum().item() for x, y in zip(a, b, strict=True))
    total = sum(x.shape[0] * x.shape[1] for x in a)
    return flips / total


@pytest.fixture(scope="module")
def results(setup: dict) -> list[dict]:
    return spawn_ranks(routing_ranks.main, 2, setup["a"], setup["b"], setup["raw"], LAYOUTS)


def test_reference_is_informative(reference: float) -> None:
    assert 0.05 < reference < 0.95, reference


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_flip_rate_matches_hf_reference(
    name: str, results: list[dict], reference: float, setup: dict
) -> None:
    total = 2 * sum(len(ids) for ids in setup["raw"])  # 2 MoE layers, padding excluded
    for res in results:
        got = res[name]
        assert got["self"]["moe/routing_flip_rate"] == 0.0
        assert got["flips"]["moe/routed_token_layers"] == total
        assert got["flips"]["moe/routing_flip_rate"] == pytest.approx(reference, abs=1e-12)
