"""Issue 12: no tensor on the wrong device anywhere in the training step, checked on CPU.

The job's device is a simulated accelerator (`megatron_gspo.testing.device_audit`): on a GPU,
a micro-batch left on the host, a host tensor handed to an NCCL collective, or a host/device mix
in the loss fails the first step; here each of them is a recorded violation. One 2-rank launch
runs a whole `Policy.update` (forward, loss, backward, optimizer, pi_old recompute, routing
probe, metric reduction), forward-only log-probs, the checkpoint's collective and a weight
export at two layouts, plus a planted regression (the pre-fix code path) the audit must catch.
"""

from __future__ import annotations

import math

import pytest

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.testing.harness import spawn_ranks
from tests.megatron import devices_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    hf = save_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf", seed=0)
    return spawn_ranks(devices_ranks.main, 2, str(hf))


@pytest.mark.parametrize("layout", sorted(devices_ranks.LAYOUTS))
def test_whole_step_on_the_job_device(results: list[dict], layout: str) -> None:
    for rank, out in enumerate(results):
        got = out[layout]
        assert not got["violations"], f"rank {rank}:\n" + "\n".join(got["violations"])
        # The audit saw the step: collectives, model calls, object collectives all happened.
        assert got["counts"]["collectives"] > 10 and got["counts"]["model_calls"] >= 6
        assert got["counts"]["object_collectives"] > 0
        m = got["metrics"]
        assert math.isfinite(m["loss"]) and m["train/skipped_updates"] == 0
        assert "moe/routing_flip_rate" in m
        assert got["logprobs"] == 10 and got["stepped"]
        assert got["exported"] == (45 if rank == 0 else 0)  # the sender keeps every HF tensor


def test_audit_catches_the_pre_fix_code_path(results: list[dict]) -> None:
    for out in results:
        planted = "\n".join(out["planted"])
        assert "model input" in planted and "on the host, parameters on the device" in planted
        assert "torch.distributed.all_reduce got a host tensor (2,)" in planted
        assert "mixes device and host tensors" in planted  # the loss's inputs vs the logits


def test_report_times(results: list[dict]) -> None:
    """Not a check: the audit's cost, shown with `pytest -s`."""
    for layout in sorted(devices_ranks.LAYOUTS):
        r = results[0][layout]
        print(layout, {k: round(v, 1) for k, v in r["seconds"].items()}, r["counts"])
