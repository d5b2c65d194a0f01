"""Fixtures for the rollout tests: tiny HF checkpoints and in-process embedded engines.

Engines are session-scoped (starting one costs the SGLang import once, then ~1 s) and every
fixture stops what it started.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.testing.tiny import save_tiny_hf_checkpoint


@pytest.fixture(scope="session")
def ckpt_a(tmp_path_factory) -> str:
    """Tiny Qwen3-MoE checkpoint, seed 0 (the engine's initial weights)."""
    return str(save_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt_a"), seed=0))


@pytest.fixture(scope="session")
def ckpt_b(tmp_path_factory) -> str:
    """Tiny Qwen3-MoE checkpoint, seed 1 (the "trained" weights pushed by updates)."""
    return str(save_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt_b"), seed=1))


@pytest.fixture(scope="session")
def weights_a(ckpt_a) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{ckpt_a}/model.safetensors")


@pytest.fixture(scope="session")
def weights_b(ckpt_b) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{ckpt_b}/model.safetensors")


def _start(path: str):
    from megatron_gspo.rollout.embedded import EmbeddedServer

    return EmbeddedServer(path).start()


@pytest.fixture(scope="session")
def engine_a(ckpt_a):
    """An embedded engine on 127.0.0.1 serving `ckpt_a` (weights may be changed by tests
    that restore them afterwards)."""
    srv = _start(ckpt_a)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def engine_b(ckpt_a):
    """A second embedded engine with the same initial weights."""
    srv = _start(ckpt_a)
    yield srv
    srv.stop()


@pytest.fixture
def client_a(engine_a):
    from megatron_gspo.rollout.sglang_client import ClientConfig, SGLangClient

    c = SGLangClient(ClientConfig(engine_urls=[engine_a.url], validate_requests=True))
    yield c
    c.close()
