"""Checkpointed generators (issue 20, defect 7): megatron-core's tensor-parallel RNG tracker
(and CUDA's, on a GPU) come back with torch's and Python's after a save/load round trip."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_gspo.megatron.rng import rng_state, set_rng_state
from megatron_gspo.patches import apply_cpu_runtime


@pytest.fixture
def tracker():
    apply_cpu_runtime()  # the tracker's generators are CPU ones here (patches/cpu_runtime.py)
    from megatron.core.tensor_parallel import random as mrandom

    t = mrandom.get_cuda_rng_tracker()
    t.reset()
    t.add("model-parallel-rng", 1234)
    t.add("expert-parallel-rng", 99)
    yield t
    t.reset()


def _draw(tracker) -> list[float]:
    """One number from every generator a step uses."""
    out = [torch.rand(1).item(), random.random()]
    for name in ("model-parallel-rng", "expert-parallel-rng"):
        with tracker.fork(name):
            out.append(torch.rand(1).item())
    if torch.cuda.is_available():
        out.append(torch.rand(1, device="cuda").item())
    return out


def test_every_generator_resumes_where_the_checkpoint_left_it(tracker, tmp_path):
    _draw(tracker)
    torch.save(rng_state(), tmp_path / "trainer_rank0.pt")
    want = _draw(tracker)  # what the run draws after the save
    _draw(tracker)
    saved = torch.load(tmp_path / "trainer_rank0.pt", weights_only=True)  # as load_checkpoint
    assert set(saved) >= {"torch_rng", "py_rng", "rng_tracker"}
    set_rng_state(saved)
    assert _draw(tracker) == want


def test_without_the_tracker_state_the_resume_differs(tracker, tmp_path, capsys):
    """What a checkpoint with torch and Python states only (before issue 20) gives: the
    tracker's draws are not the ones after the save; the resume says so on stderr."""
    state = rng_state()
    want = _draw(tracker)
    set_rng_state({k: state[k] for k in ("torch_rng", "py_rng")})
    got = _draw(tracker)
    assert got[:2] == want[:2] and got[2:4] != want[2:4]
    assert "rng_tracker" in capsys.readouterr().err
