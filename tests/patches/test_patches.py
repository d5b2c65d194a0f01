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
    assert all(p.applied for p in ALL_PATCHES), [p.name for p in ALL_PATCHES if not p.applied]

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
