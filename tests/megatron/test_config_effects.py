"""Each model / optim / train key changes behaviour (issue: eight keys were validated and
documented but never read). One 2-rank launch (EP=2) builds policies through `Policy.build`;
references are independent: the schedule's closed form in float64, SGD's update rule, layer
call counts, megatron-core's dispatcher classes."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo import dist
from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.testing.harness import spawn_ranks
from tests.megatron import config_effects_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    hf = save_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf", seed=0)
    out = spawn_ranks(config_effects_ranks.main, 2, str(hf))
    return out[0] | {"rank1": out[1]}


def reference_lr(schedule: str, k: int, lr=1e-2, min_lr=1e-3, warmup=2, total=6) -> float:
    """megatron-core's documented schedule, written out: linear warmup from 0, then decay."""
    if k < warmup:
        return lr * k / warmup
    if schedule == "constant":
        return lr
    ratio = (k - warmup) / (total - warmup)
    coeff = 1 - ratio if schedule == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
    return min_lr + coeff * (lr - min_lr)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_schedule_and_warmup(results: dict, schedule: str) -> None:
    got = results["lr"][schedule]
    want = [reference_lr(schedule, k) for k in range(6)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert results["rank1"]["lr"][schedule] == got


def test_schedules_differ(results: dict) -> None:
    lr = results["lr"]
    assert lr["constant"][-1] == 1e-2 and lr["cosine"][-1] < lr["linear"][-1] < 1e-2


def test_optimizer_choice(results: dict) -> None:
    sgd, adam = results["optimizer"]["sgd"], results["optimizer"]["adam"]
    moved = 0
    for name, (delta, grad) in sgd.items():
        torch.testing.assert_close(delta, -1e-2 * grad, rtol=1e-4, atol=1e-7, msg=name)
        moved += int(bool(grad.abs().max() > 0))
    assert moved > 10  # most tensors got a gradient
    # Adam's first step is lr * g / (|g| + eps), not lr * g: the choice changed the update.
    differs = [
        not torch.allclose(adam[n][0], -1e-2 * adam[n][1], rtol=1e-2, atol=1e-6) for n in adam
    ]
    assert sum(differs) > 10


def test_activation_recompute(results: dict) -> None:
    r = results["recompute"]
    n = r["none"]["micro_batches"]
    assert r["none"]["layer"] == n and r["none"]["attn"] == n
    assert r["full"]["layer"] == 2 * n  # every layer's forward runs again in backward
    assert r["selective"]["attn"] == 2 * n and r["selective"]["layer"] == n
    for mode in ("selective", "full"):  # recompute changes memory, not the math
        assert r[mode]["loss"] == pytest.approx(r["none"]["loss"], rel=1e-6)
        assert r[mode]["grad_norm"] == pytest.approx(r["none"]["grad_norm"], rel=1e-5)


def test_token_dispatcher(results: dict) -> None:
    d = results["dispatcher"]
    assert d["alltoall"]["cls"] == "MoEAlltoAllTokenDispatcher"
    assert d["allgather"]["cls"] == "MoEAllGatherTokenDispatcher"
    assert d["allgather"]["loss"] == pytest.approx(d["alltoall"]["loss"], rel=1e-6)


def test_unsupported_options_are_refused_clearly(results: dict) -> None:
    r = results["refused"]
    assert (
        "model.moe_grouped_gemm=true needs Transformer Engine" in r["model.moe_grouped_gemm=true"]
    )
    assert "flex needs DeepEP" in r["model.moe_token_dispatcher=flex"]
    assert "use alltoall (or parallel.ep=1)" in r["model.moe_token_dispatcher=allgather"]
    assert "model.dtype=fp16 on CPU" in r["model.dtype=fp16"]


def test_planted_nan_skips_every_update(results: dict) -> None:
    nan = results["nan"]
    m = nan["metrics"]
    assert m["train/skipped_updates"] == 2  # both mini-batches
    assert math.isnan(m["loss"]) and math.isnan(m["grad_norm"])  # logged, not dropped
    assert nan["unchanged"] and nan["finite_after"] and not nan["scheduler_advanced"]


def test_train_device_decides_the_device() -> None:
    assert dist.resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert dist.resolve_device("auto") == torch.device("cpu")
        with pytest.raises(RuntimeError, match="train.device=cuda"):
            dist.resolve_device("cuda")
