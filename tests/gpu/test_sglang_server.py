"""GPU smoke test: a real SGLang 0.5.23 server on a tiny Qwen3-MoE, driven by `SGLangClient`.

Skipped without CUDA or without an importable `sglang`. Run on a GPU machine with

    pytest -q -s tests/gpu/test_sglang_server.py

It checks, against the real engine: generation with engine log-probs, their agreement with a
trainer-style rescoring (`log_softmax(logits / T)` from a full HF forward in the same dtype),
`mismatch/abs_logp_diff` reporting, a weight push through `update_weights_from_tensor`
(CUDA IPC, flattened bucket) inside a session with a version bump, `/weights_checker`,
`update_weights_from_disk`, pause/continue and health. Budget: ~3-5 min (server start
dominates), one GPU.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang"),
]

# Big enough for SGLang's GPU kernels (head_dim 64, hidden 256), still tiny.
GPU_TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
T = 0.8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint

    a = save_tiny_hf_checkpoint(tmp_path_factory.mktemp("gpu_a"), seed=0, **GPU_TINY)
    b = save_tiny_hf_checkpoint(tmp_path_factory.mktemp("gpu_b"), seed=1, **GPU_TINY)
    return str(a), str(b)


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    from megatron_gspo.dist import free_port
    from megatron_gspo.engines.launch import LaunchConfig, ServerGroup
    from megatron_gspo.testing.sglang_server import GPU_TINY_ENGINE_ARGS

    cfg = LaunchConfig(
        model_path=ckpts[0],
        backend="sglang",
        base_port=free_port(),
        dtype="bfloat16",
        mem_fraction_static=0.3,
        startup_timeout_s=600,
        log_dir=str(tmp_path_factory.mktemp("sglang_logs")),
        extra_args=GPU_TINY_ENGINE_ARGS,
    )
    group = ServerGroup(cfg)
    try:
        group.start()
        yield cfg
    finally:
        group.shutdown()
        log = os.path.join(cfg.log_dir, "engine0.log")
        if os.path.exists(log):
            print(open(log).read()[-4000:])


@pytest.fixture(scope="module")
def client(server):
    from megatron_gspo.engines.client import ClientConfig, SGLangClient

    c = SGLangClient(ClientConfig(engine_urls=server.engine_urls, validate_requests=True))
    yield c
    c.close()


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()


@torch.no_grad()
def _rescore(model, samples, temperature):
    rows = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")
        logits = model(input_ids=ids).logits[0].float()
        n_p, n_r = len(s.prompt_ids), len(s.response_ids)
        lp = torch.log_softmax(logits[n_p - 1 : n_p + n_r - 1] / temperature, -1)
        rows.append(lp[torch.arange(n_r), torch.tensor(s.response_ids, device="cuda")].tolist())
    return rows


def _check_logprobs(client, model, tag):
    from megatron_gspo.engines.types import SamplingParams, mismatch_metrics

    prompts = [[1, 5 + i, 17, 33] for i in range(8)]
    res = client.generate(prompts, SamplingParams(max_new_tokens=32, temperature=T), n=4)
    assert [s.key for s in res.samples] == [(i, j) for i in range(8) for j in range(4)]
    assert res.stats.num_rejected == 0 and res.stats.num_masked_logprobs == 0
    m = mismatch_metrics(res.samples, _rescore(model, res.samples, T))
    print(tag, m, res.stats.as_metrics())
    # bf16 engine vs bf16 HF forward: small per-token differences, never systematic.
    assert m["mismatch/abs_logp_diff"] < 0.05, m
    return res


def test_generation_and_logprobs_match_trainer_rescoring(client, ckpts):
    res = _check_logprobs(client, _hf(ckpts[0]), "initial")
    assert {s.weight_version for s in res.samples} == {"default"}
    assert all(client.health().values())


def test_weight_push_changes_policy_and_version(client, ckpts):
    from safetensors.torch import load_file

    weights = load_file(os.path.join(ckpts[1], "model.safetensors"))
    named = [(k, v.to(torch.bfloat16).cuda()) for k, v in sorted(weights.items())]
    before = next(iter(client.weights_checksum().values()))
    client.pause_generation("retract")
    with client.weight_update_session():
        client.update_weights_from_tensor(named, weight_version="gpu-1")
    client.continue_generation()
    assert set(client.weight_version().values()) == {"gpu-1"}
    after = next(iter(client.weights_checksum().values()))
    assert after["success"] and after["per_engine_checksum"] != before["per_engine_checksum"]
    res = _check_logprobs(client, _hf(ckpts[1]), "after tensor push")
    assert {s.weight_version for s in res.samples} == {"gpu-1"}

    client.update_weights_from_disk(ckpts[0], weight_version="gpu-2")
    _check_logprobs(client, _hf(ckpts[0]), "after disk reload")
