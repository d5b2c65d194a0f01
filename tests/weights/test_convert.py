"""Checkpoint conversion HF <-> Megatron torch_dist on 2 gloo ranks (TP2, EP2, PP2).

Round trips are bitwise, a checkpoint written at one layout loads at another with logits
identical to the same layout built straight from HF, and the error paths say what is wrong.
"""

from __future__ import annotations

import pytest

from megatron_gspo.testing.harness import launch
from megatron_gspo.testing.tiny import save_tiny_hf_checkpoint
from tests.weights import convert_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("convert")
    save_tiny_hf_checkpoint(root / "hf", seed=3)
    return launch(convert_ranks.main, 2, str(root))


@pytest.mark.parametrize("src,dst", convert_ranks.EXPORTS)
def test_round_trip_and_reshard_bitwise(results: list[dict], src: str, dst: str) -> None:
    info = results[0][f"export_{src}_{dst}"]
    assert info["missing"] == [] and info["extra"] == [] and info["unequal"] == [], info
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(
        info["files"]
    )


@pytest.mark.parametrize("src,dst", convert_ranks.LOGITS)
def test_resharded_logits_identical(results: list[dict], src: str, dst: str) -> None:
    for rank in (0, 1):
        info = results[rank][f"logits_{src}_{dst}"]
        assert info["equal"], info
        assert info["shape"] == (2, 16, 128)


def test_refuses_to_overwrite(results: list[dict]) -> None:
    for r in results:
        assert r["overwrite"].startswith("ConversionError") and "--force" in r["overwrite"]
    assert "model-00000.safetensors" in results[0]["forced"]


def test_layout_that_does_not_fit(results: list[dict]) -> None:
    for r in results:
        msg = r["bad_layout"]
        assert msg.startswith("ConversionError"), msg
        assert "--ep 3 does not divide num_experts=4" in msg


def test_missing_tensor_is_named(results: list[dict]) -> None:
    for r in results:
        msg = r["missing_tensor"]
        assert msg.startswith("ConversionError"), msg
        assert convert_ranks.DROPPED in msg
