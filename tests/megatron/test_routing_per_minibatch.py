"""`moe/routing_flip_rate_mb/<k>` (train.routing_flip_per_minibatch) from `Policy.update`
equals the flip rate computed independently from Hugging Face router logits: the probed
sequences' top-k experts under the initial checkpoint against those under the weights exported
after k - 1 optimizer steps (and, for `moe/routing_flip_rate`, after all of them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.testing.harness import spawn_ranks
from tests.megatron import flip_mb_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def _topk(model: torch.nn.Module, raw: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence: [layers, tokens, k] sorted top-k expert ids from the HF router logits."""
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = []
        for ids in raw:
            logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
            out.append(torch.stack([lg.topk(k, dim=-1).indices.sort(-1).values for lg in logits]))
    return out


def _flip(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    flips = sum(int((x != y).any(-1).sum()) for x, y in zip(a, b, strict=True))
    return flips / sum(x.shape[0] * x.shape[1] for x in a)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict:
    hf = str(save_tiny_hf_checkpoint(tmp_path_factory.mktemp("flipmb") / "hf", seed=0))
    g = torch.Generator().manual_seed(3)
    raw = [
        torch.randint(3, 128, (int(torch.randint(8, 20, (1,), generator=g)),), generator=g).tolist()
        for _ in range(9)
    ]
    (res,) = spawn_ranks(flip_mb_ranks.main, 1, hf, raw)
    return {"hf": hf, "raw": raw, **res}


def _load(hf: str, weights: dict[str, torch.Tensor] | None, tmp: Path) -> torch.nn.Module:
    """The HF model of checkpoint `hf`, or of its config with the exported `weights` (saved as
    a checkpoint: transformers maps per-expert names onto its fused expert tensors)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if weights is not None:
        tmp.mkdir()
        shutil.copy(Path(hf) / "config.json", tmp / "config.json")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf = str(tmp)
    return AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()


def test_per_minibatch_flip_rate_matches_hf_reference(case: dict, tmp_path: Path) -> None:
    n = flip_mb_ranks.MINI_BATCHES
    probed = [case["raw"][i] for i in case["probed"]]
    rollout = _topk(_load(case["hf"], None, tmp_path), probed)
    assert len(case["weights"]) == n
    want = {}
    for k in range(2, n + 2):  # k = n + 1: after the last update (moe/routing_flip_rate)
        model = _load(case["hf"], case["weights"][k - 2], tmp_path / f"after{k - 1}")
        want[k] = _flip(rollout, _topk(model, probed))
    got = case["metrics"]
    assert 0.05 < want[n + 1] < 0.95, want  # the updates moved the routing: informative
    for k in range(2, n + 1):
        assert got[f"moe/routing_flip_rate_mb/{k}"] == pytest.approx(want[k], abs=1e-12)
    assert got["moe/routing_flip_rate"] == pytest.approx(want[n + 1], abs=1e-12)
    assert "moe/routing_flip_rate_mb/1" not in got
