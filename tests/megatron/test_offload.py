"""Colocated memory (megatron/offload.py): while the engines generate, the trainer's
parameters, gradients and optimizer state leave its device and come back unchanged.

The 2-rank test trains the same 3 GSPO steps (2 mini-batches each) with and without an
offload/reload before every update, with the distributed optimizer (fp32 shards are views of
megatron's param buffer: the aliasing megatron's own `offload_to_cpu` would break) and without;
while offloaded, every parameter, grad-buffer and Adam-state storage holds 0 bytes, and the
result is bitwise the run without offload. The single-process tests pin down the storage
mechanics (views, shared step tensors, which device moves, the CUDA call order).
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.megatron.offload import TrainerOffload
from megatron_gspo.testing.harness import spawn_ranks
from tests.megatron import offload_ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    hf = save_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf", seed=0)
    return spawn_ranks(offload_ranks.main, 2, str(hf))


@pytest.mark.multirank
@pytest.mark.parametrize("dist_opt", [True, False])
def test_offload_round_trips_leave_training_bit_identical(results: list[dict], dist_opt: bool):
    for rank, out in enumerate(results):
        plain, off = out[dist_opt][False], out[dist_opt][True]
        assert plain["params"].keys() == off["params"].keys()
        for name, p in plain["params"].items():
            assert torch.equal(p, off["params"][name]), (rank, name)
        assert plain["metrics"] == off["metrics"]
        # The updates did move the weights (the comparison is not of two untouched models).
        assert plain["metrics"][0]["grad_norm"] > 0
        # While offloaded nothing stayed behind: params, grad buffers and Adam state hold 0 B.
        for held in off["while_off"]:
            assert held == {"params": 0, "grads": 0, "optimizer": 0}, (rank, held)
        moved = off["moved"]
        assert all(m["memory/offload_params_gb"] > 0 for m in moved)
        assert all(m["memory/offload_grads_gb"] > 0 for m in moved)
        # Adam's state exists from the first optimizer step on, and then it moves too.
        assert moved[0]["memory/offload_optimizer_gb"] == 0 or not dist_opt
        assert all(m["memory/offload_optimizer_gb"] > 0 for m in moved[1:])


@pytest.mark.multirank
def test_offload_is_off_unless_colocated_and_enabled(results: list[dict]):
    for key, (off, held, back) in results[0]["disabled"].items():
        assert off == {} and back == {}, key
        assert held["params"] > 0 and held["grads"] > 0, key


def _toy() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """Two parameters that are views of one flat buffer (megatron's param buffer layout) and
    Adam with one step tensor shared by both (the state megatron-core's checkpoints restore)."""
    torch.manual_seed(0)
    flat = torch.randn(12)
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(flat[:8].view(2, 4))
    m.b = torch.nn.Parameter(flat[8:])
    m.c = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    (m.a.sum() * 2 + m.b.square().sum() + m.c.sum()).backward()
    opt.step()
    step = opt.state[m.a]["step"]
    opt.state[m.b]["step"] = step
    return m, opt, step


def test_storage_round_trip_keeps_views_values_and_sharing():
    m, opt, step = _toy()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    state = {k: v.clone() for k, v in opt.state[m.c].items()}
    ptr_b = m.b.data_ptr() - m.a.data_ptr()
    mem = TrainerOffload([m], opt, grads=True)
    metrics = mem.offload()
    assert all(p.untyped_storage().nbytes() == 0 for p in m.parameters())
    assert all(t.untyped_storage().nbytes() == 0 for t in opt.state[m.c].values())
    assert all(p.grad.untyped_storage().nbytes() == 0 for p in m.parameters())
    # The shared flat buffer moved once: 12 + 3 floats of params.
    assert mem.moved_bytes["params"] == 15 * 4
    assert metrics["memory/offload_optimizer_gb"] > 0
    mem.reload()
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]), n
    for k, v in opt.state[m.c].items():
        assert torch.equal(v, state[k]), k
    # Views still alias one storage, the step tensor is still shared (same object, one storage).
    assert m.b.data_ptr() - m.a.data_ptr() == ptr_b
    with torch.no_grad():
        m.a.view(-1)[0] = 42.0
    assert m.a.untyped_storage().data_ptr() == m.b.untyped_storage().data_ptr()
    assert opt.state[m.a]["step"] is step and opt.state[m.b]["step"] is step
    with pytest.raises(RuntimeError, match="nothing is offloaded"):
        mem.reload()
    hosts = {k: id(v) for k, v in mem._hosts.items()}
    mem.offload()
    assert {k: id(v) for k, v in mem._hosts.items()} == hosts  # host buffers are reused
    with pytest.raises(RuntimeError, match="already offloaded"):
        mem.offload()
    mem.reload()
    assert m.a.view(-1)[0].item() == 42.0  # a second round trip carries the new value


def test_only_the_home_device_moves_and_cuda_calls_are_ordered(monkeypatch):
    """On a GPU the home device is CUDA: CPU tensors (e.g. Adam's step counters) stay, the host
    copies complete (synchronize) before storages are freed, and freed blocks go back to the
    driver (empty_cache). Here every tensor is on the CPU, so with home=cuda none may move."""
    m, opt, _ = _toy()
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 7 * 1024**3)
    mem = TrainerOffload([m], opt, home=torch.device("cuda", 0))
    metrics = mem.offload()
    assert mem.moved_bytes == {"params": 0, "optimizer": 0, "grads": 0, "kept": 0}
    assert all(p.untyped_storage().nbytes() > 0 for p in m.parameters())
    assert calls == ["sync", "empty_cache"]
    assert metrics["memory/trainer_allocated_gb_before_offload"] == 7.0
    mem.reload()
    assert calls == ["sync", "empty_cache", "sync"]


def test_a_storage_that_cannot_be_resized_stays_and_is_counted():
    """Found by the colocated CPU job: one (vocab, hidden) parameter of the loaded model lives in
    a storage that cannot be resized, and offload failed with 'Trying to resize storage that is
    not resizable'. Such a storage stays where it is, counted as kept; the rest moves."""
    m, opt, _ = _toy()
    m.c.data = torch.frombuffer(bytearray(m.c.detach().numpy().tobytes()), dtype=torch.float32)
    assert not m.c.untyped_storage().resizable()
    c = m.c.detach().clone()
    mem = TrainerOffload([m], opt)
    metrics = mem.offload()
    kept = m.c.untyped_storage().nbytes()
    assert kept == 12 and mem.moved_bytes["kept"] == 12
    assert metrics["memory/offload_kept_gb"] == 12 / 1024**3
    assert m.a.untyped_storage().nbytes() == 0
    mem.reload()
    assert torch.equal(m.c.detach(), c)
