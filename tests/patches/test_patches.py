"""The runtime patches: each applies on the pinned versions, does what it claims, and its
self-check fails loudly when upstream changes under it.

The checks run in a fresh subprocess: the CPU runtime is process-global by design and must not
leak into the pytest process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _checks() -> None:  # runs in the subprocess
    import dataclasses
    import inspect

    import numpy as np
    import torch

    from megatron_gspo.patches import (
        ALL_PATCHES,
        PatchError,
        apply_bridge_imports,
        apply_cpu_runtime,
    )

    assert apply_cpu_runtime() is True
    apply_bridge_imports()
    from megatron_gspo.patches import P2P_ORDER_PATCH

    P2P_ORDER_PATCH.apply()  # behaviour: tests/patches/test_pipeline_patch.py
    from megatron_gspo.patches.optimizer import resume_hooks

    resume_hooks()  # what the checkpoint code calls; behaviour: tests/megatron/test_checkpoint.py
    assert all(p.applied for p in ALL_PATCHES), [p.name for p in ALL_PATCHES if not p.applied]
    _ep_gather_checks()
    _optimizer_checks()

    # device rewriting, .type() strings, streams
    t = torch.ones(3, device="cuda")
    assert t.device.type == "cpu" and t.cuda() is t and t.type() == "torch.cuda.FloatTensor"
    assert t.to("cuda:0").device.type == "cpu"
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.synchronize()

    # RNG tracker forks a seeded CPU generator and restores the outer state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("x", 123)
    outer = torch.get_rng_state()
    with tracker.fork("x"):
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outer)
    assert torch.equal(a, torch.rand(4, generator=torch.Generator().manual_seed(123)))

    # local-spec norm accepts sequence parallelism and tags its parameters
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        normalization="RMSNorm",
        tensor_model_parallel_size=1,
    )
    cfg_sp = dataclasses.replace(cfg)
    object.__setattr__(cfg_sp, "sequence_parallel", True)
    norm = WrappedTorchNorm(cfg_sp, 8)
    assert isinstance(norm, torch.nn.RMSNorm) and all(
        p.sequence_parallel for p in norm.parameters()
    )
    assert not getattr(WrappedTorchNorm(cfg, 8).weight, "sequence_parallel", False)

    # alltoall split sizes become numpy on CPU
    from megatron.core.transformer.moe import moe_utils

    assert isinstance(
        moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True), np.ndarray
    )

    # the fake TE was served to the bridge's lora module only
    import megatron.core.transformer.attention as attention

    assert attention.HAVE_TE is False
    assert "transformer_engine" not in sys.modules

    # self-checks: a pinned-version mismatch and a changed upstream function both fail loudly
    patch = next(p for p in ALL_PATCHES if p.name == "mcore-alltoall-splits")
    bad = dataclasses.replace(patch, versions=("0.0.0",))
    try:
        bad.check()
        raise AssertionError("version mismatch not detected")
    except PatchError:
        pass
    original = moe_utils.maybe_move_tensor_to_cpu
    src = inspect.getsource(patch.check_fn)
    assert "tensor.is_cuda" in src
    moe_utils.maybe_move_tensor_to_cpu = lambda tensor, as_numpy=False, record_stream=False: tensor
    try:
        patch.check_fn()
        raise AssertionError("changed upstream function not detected")
    except PatchError:
        pass
    finally:
        moe_utils.maybe_move_tensor_to_cpu = original
    print("PATCH-CHECKS-OK")


class _FakeExpertMapping:
    """What the bridge's gather_from_ep_ranks reads from `self`: EP=2, local expert 1 of 2."""

    ep_size = 2
    ep_group = "ep-group"
    megatron_param = "decoder.layers.0.mlp.experts.linear_fc2.weight1"

    def __init__(self, ep_rank: int) -> None:
        self.ep_rank = ep_rank

    def _get_config(self, _module: object) -> object:
        return type("Cfg", (), {"num_moe_experts": 4})()

    def broadcast_obj_from_pp_rank(self, obj: object, _key: str) -> object:
        return obj


def _ep_gather_checks() -> None:  # runs in the subprocess, after apply_bridge_imports()
    import torch
    import torch.distributed as dist
    from megatron.bridge.models.conversion import param_mapping as pm

    from megatron_gspo.patches import PatchError, bridge
    from megatron_gspo.weights.stream import experts_to_ep_rank0

    # The apply installed our method (a no-op apply_fn leaves the bridge's own one here).
    assert pm.MegatronParamMapping.gather_from_ep_ranks is bridge.gather_from_ep_ranks
    calls: list[str] = []
    saved = dist.all_gather, dist.gather, dist.get_global_rank

    def all_gather(out: list, t: torch.Tensor, group: object = None) -> None:
        calls.append("all_gather")
        for o in out:
            o.copy_(t)

    def gather(t: torch.Tensor, out: list | None, dst: int, group: object = None) -> None:
        calls.append(f"gather->{dst}")
        for o in out or []:
            o.copy_(t)

    dist.all_gather, dist.gather = all_gather, gather
    dist.get_global_rank = lambda group, rank: 0
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    w = torch.ones(2, 2)
    try:
        method = pm.MegatronParamMapping.gather_from_ep_ranks
        # Outside the scope: the bridge's own all-gather, every EP rank gets every expert.
        got = method(_FakeExpertMapping(1), w, object(), name)
        assert calls == ["all_gather"] and sorted(got) == [name, name.replace(".1.", ".3.")]
        calls.clear()
        with experts_to_ep_rank0():
            on_first = method(_FakeExpertMapping(0), w, object(), name)
            on_other = method(_FakeExpertMapping(1), w, object(), name)
        assert calls == ["gather->0", "gather->0"], calls
        assert sorted(on_first) == [name, name.replace(".1.", ".3.")] and on_other == {}
        calls.clear()
        method(_FakeExpertMapping(1), w, object(), name)  # the scope ended: all-gather again
        assert calls == ["all_gather"]
    finally:
        dist.all_gather, dist.gather, dist.get_global_rank = saved

    # A changed upstream signature fails the check even after the patch replaced the method.
    original = bridge._ep_original["fn"]
    bridge._ep_original["fn"] = lambda self, weights, module: {}
    try:
        bridge.EP_GATHER_PATCH.check()
        raise AssertionError("changed gather_from_ep_ranks not detected")
    except PatchError:
        pass
    finally:
        bridge._ep_original["fn"] = original


def _optimizer_checks() -> None:  # runs in the subprocess
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_gspo.patches import OPTIMIZER_STATE_PATCH, PatchError

    name = "_init_optimizer_states_with_dummy_values"
    original_init = getattr(DistributedOptimizer, name)
    original_load = DistributedOptimizer.load_state_dict
    changes = [
        (name, lambda self, force: None),  # the private method now takes an argument
        (name, None),  # ... or is gone
        ("load_state_dict", lambda self, state_dict: None),  # no shared step any more
    ]
    try:
        for attr, value in changes:
            if value is None:
                delattr(DistributedOptimizer, attr)
            else:
                setattr(DistributedOptimizer, attr, value)
            try:
                OPTIMIZER_STATE_PATCH.check()
                raise AssertionError(f"changed DistributedOptimizer.{attr} not detected")
            except PatchError:
                pass
            setattr(DistributedOptimizer, name, original_init)
            DistributedOptimizer.load_state_dict = original_load
    finally:
        setattr(DistributedOptimizer, name, original_init)
        DistributedOptimizer.load_state_dict = original_load
    OPTIMIZER_STATE_PATCH.check()


def test_adam_steps_restored_one_tensor_per_parameter() -> None:
    """What megatron-core's load leaves (one step tensor shared by all parameters) is replaced by
    the saved per-parameter steps, each in its own tensor."""
    import types

    import torch

    from megatron_gspo.patches.optimizer import adam_steps, restore_adam_steps

    a, b, fresh = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    adam = torch.optim.Adam([a, b, fresh])
    for steps in (2, 1):  # a steps twice, b once: uneven steps
        for p in (a, b)[:steps]:
            p.grad = torch.ones(2)
        adam.step()
        adam.zero_grad(set_to_none=True)
    opt = types.SimpleNamespace(optimizer=adam)  # a megatron-core optimizer wraps torch's
    saved = adam_steps(opt)
    assert saved == [[2.0, 1.0, None]]
    shared = torch.tensor(7.0)
    for p in (a, b):
        adam.state[p]["step"] = shared
    restore_adam_steps(types.SimpleNamespace(chained_optimizers=[opt]), saved)
    sa, sb = adam.state[a]["step"], adam.state[b]["step"]
    assert (float(sa), float(sb)) == (2.0, 1.0) and sa is not sb and fresh not in adam.state


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU runtime is CPU-only")
def test_cpu_runtime_patches_in_subprocess() -> None:
    code = "import tests.patches.test_patches as t; t._checks()"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and "PATCH-CHECKS-OK" in proc.stdout, proc.stderr[-4000:]


def test_import_has_no_side_effects() -> None:
    code = (
        "import torch, megatron_gspo, megatron_gspo.patches as p; "
        "assert not p.cpu_runtime_active(); "
        "assert torch.cuda.current_device.__module__ == 'torch.cuda'; print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
