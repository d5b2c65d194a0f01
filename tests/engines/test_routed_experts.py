"""Engines return the experts they routed each token to (`rl.routing_replay`, a study control).

* The embedded engine, through SGLang's HTTP app and `SGLangClient` (SGLang's own request and
  response validation on): one row per prompt and response token but the last, each equal to
  the top-k of an independent full-forward of the same HF model.
* The wire format is SGLang 0.5.23's (`meta_info.routed_experts`, base64 int32 [N, L, K]),
  read back with SGLang's own decoder.
* Without the engine flag: a one-line error naming it. Switch off: nothing asked, nothing set.
* The real SGLang server on CPU cannot capture routes (strict xfail with the minimal
  reproduction: SGLang pins its capture buffer with cudaHostRegister).
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from megatron_gspo.engines.client import ClientConfig, SGLangClient
from megatron_gspo.engines.routed_experts import (
    SERVER_FLAG,
    RoutedExperts,
    RoutedExpertsMissing,
    ask_for_routes,
    decode,
)
from megatron_gspo.engines.types import SamplingParams

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[1, 17, 33, 9], [1, 5], [1, 99, 98, 97, 96, 3]]


@pytest.fixture
def routing_engine(engine_a):
    """The shared embedded engine with `--enable-return-routed-experts` for one test."""
    engine_a.tm.enable_return_routed_experts = True
    try:
        yield engine_a
    finally:
        engine_a.tm.enable_return_routed_experts = False


def _client(url: str, routes: bool) -> SGLangClient:
    return SGLangClient(
        ClientConfig(
            engine_urls=[url],
            validate_requests=True,  # SGLang's contract gate + GenerateResponse schema
            return_routed_experts=routes,
            num_experts_per_tok=2 if routes else 0,
        )
    )


def _hf_topk(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), L, K] top-k expert sets (sorted) of one full forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    return torch.stack([lg.topk(k, dim=-1).indices for lg in logits], 1).sort(-1).values


def test_embedded_engine_returns_the_routes_of_every_fed_token(routing_engine, ckpt_a):
    from transformers import AutoModelForCausalLM

    client = _client(routing_engine.url, routes=True)
    try:
        res = client.generate(PROMPTS, SamplingParams(max_new_tokens=7, seed=3), n=2)
    finally:
        client.close()
    ref = AutoModelForCausalLM.from_pretrained(ckpt_a, dtype=torch.float32).eval()
    for s in res.samples:
        ids = s.prompt_ids + s.response_ids
        routes = s.routed_experts
        assert isinstance(routes, RoutedExperts) and routes.start == 0
        assert routes.indices.shape == (len(ids) - 1, 2, 2)  # prompt too, not the last token
        want = _hf_topk(ref, ids[:-1])  # the tokens the engine fed, in one forward
        torch.testing.assert_close(routes.indices.long().sort(-1).values, want, rtol=0, atol=0)


def test_missing_routes_is_one_line_naming_the_flag(engine_a):
    client = _client(engine_a.url, routes=True)  # the engine runs without the flag
    try:
        with pytest.raises(RoutedExpertsMissing) as e:
            client.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=1))
    finally:
        client.close()
    msg = str(e.value)
    assert "\n" not in msg and SERVER_FLAG in msg and "rl.routing_replay=false" in msg


def test_switch_off_asks_nothing(routing_engine):
    client = _client(routing_engine.url, routes=False)
    try:
        body = client._body([_entry()], 1)
        res = client.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=1))
    finally:
        client.close()
    assert "return_routed_experts" not in body
    assert res.samples[0].routed_experts is None


def _entry():
    from megatron_gspo.engines.client import _Entry

    return _Entry(0, 0, [1, 2], SamplingParams().to_sglang(), "r")


def test_wire_format_is_sglangs():
    """Our encoding read by SGLang's `extract_routed_experts_from_meta_info`, and the bytes
    SGLang's tokenizer manager writes (int32 tensor -> base64) read by our decoder."""
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 128, (9, 3, 4), generator=g, dtype=torch.int32)
    flat = extract_routed_experts_from_meta_info(
        {"meta_info": {"routed_experts": RoutedExperts(indices=t).encode()}}
    )
    assert flat.tolist() == t.reshape(-1).tolist()
    import pybase64  # what sglang/srt/managers/tokenizer_manager.py does with the tensor

    sent = pybase64.b64encode(t.numpy().tobytes()).decode("utf-8")
    got = decode(sent, topk=4, prompt_len=6, response_len=4)
    assert torch.equal(got.indices, t)
    with pytest.raises(ValueError, match="routed_experts holds"):
        decode(sent, topk=4, prompt_len=6, response_len=5)  # one row short


def test_replay_asks_the_launched_engines_for_routes(ckpt_a):
    from transformers import AutoConfig

    from megatron_gspo.engines.launch import LaunchConfig
    from megatron_gspo.engines.routed_experts import model_topk

    assert model_topk(ckpt_a) == AutoConfig.from_pretrained(ckpt_a).num_experts_per_tok == 2

    launch, client = ask_for_routes(LaunchConfig(extra_args=["--x"]), ClientConfig(), 8)
    assert launch.extra_args == ["--x", SERVER_FLAG] and client.return_routed_experts
    assert client.num_experts_per_tok == 8
    assert ask_for_routes(launch, client, 8)[0].extra_args == ["--x", SERVER_FLAG]


_REPRO = """
import torch
from sglang.srt.state_capturer.base import BaseHostCache
BaseHostCache(16, 2, 2, name="routed_experts", device="cpu")  # RoutedExpertsCapturer's host
print("ok")                                                    # buffer, as sized at startup
"""


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,  # only this failure; any other one fails the test
    reason="SGLang 0.5.23 cannot return routed experts on CPU: --enable-return-routed-experts "
    "makes the server allocate RoutedExpertsCapturer's host buffer with "
    "ALLOC_MEMORY_FUNCS['cpu'] = alloc_with_host_register(pin_memory=True), which calls "
    "torch.cuda.cudart().cudaHostRegister: 'Found no NVIDIA driver' and the scheduler dies at "
    "startup (measured with the real server). Strict: a release that fixes it turns this red.",
)
def test_real_server_capture_buffer_on_cpu(engine_python):
    from megatron_gspo.engines.launch import cpu_engine_env

    env = cpu_engine_env({k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    out = subprocess.run([engine_python, "-c", _REPRO], env=env, capture_output=True, text=True)
    if out.returncode and "Found no NVIDIA driver" in out.stderr and "cudart" in out.stderr:
        raise RuntimeError(out.stderr.strip().splitlines()[-1])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_config_switch_defaults_off_and_refuses_what_it_cannot_serve():
    from megatron_gspo.config import ConfigError, load_config

    base = ["model.hf_path=/m", "data.train_path=/d.jsonl", "rollout.launch.backend=embedded"]
    assert load_config(None, base).rl.routing_replay is False
    assert load_config(None, [*base, "rl.routing_replay=true"]).rl.routing_replay
    for extra, key in [
        (["rollout.launch.backend=sglang", "rollout.launch.device=cpu"], "backend=embedded"),
        (["model.activation_recompute=full"], "model.activation_recompute"),
    ]:
        with pytest.raises(ConfigError, match=key) as e:
            load_config(None, [*base, "rl.routing_replay=true", *extra])
        assert "\n" not in str(e.value) and "rl.routing_replay=false" in str(e.value)
