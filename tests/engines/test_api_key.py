"""`rollout.launch.api_key` / `rollout.client.api_key` end to end.

The key reaches both backends' command lines (parsed by SGLang's and the embedded engine's own
parsers); the embedded engine then refuses every request without `Bearer <key>` with SGLang's
401, weight pushes included, while health probes stay open (SGLang's rule); the client that
sends the key generates and pushes weights.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from megatron_gspo.engines.client import ClientConfig, SGLangClient
from megatron_gspo.engines.embedded.cli import parser
from megatron_gspo.engines.embedded.server import EmbeddedServer
from megatron_gspo.engines.launch import LaunchConfig, engine_command
from megatron_gspo.engines.protocols import EngineError
from megatron_gspo.engines.types import SamplingParams

KEY = "s3cret-key"


def test_launch_passes_the_key_to_both_backends(tmp_path) -> None:
    from sglang.srt.server_args import prepare_server_args

    sg = LaunchConfig(model_path=str(tmp_path), backend="sglang", api_key=KEY)
    assert prepare_server_args(engine_command(sg, 0, python="python")[3:]).api_key == KEY
    emb = LaunchConfig(model_path=str(tmp_path), backend="embedded", api_key=KEY)
    assert parser().parse_args(engine_command(emb, 0)[3:]).api_key == KEY
    # Without the key neither command carries one.
    plain = LaunchConfig(model_path=str(tmp_path), backend="sglang")
    assert prepare_server_args(engine_command(plain, 0, python="python")[3:]).api_key is None
    assert "--api-key" not in engine_command(LaunchConfig(model_path="m"), 0)


def _post(url: str, body: dict | None, key: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(
        url, data=json.dumps(body or {}).encode(), method="POST",
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {key}"} if key else {})},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def keyed_engine(ckpt_a):
    srv = EmbeddedServer(ckpt_a, api_key=KEY).start()
    yield srv
    srv.stop()


def test_embedded_engine_refuses_requests_without_the_key(keyed_engine, weights_a) -> None:
    url = keyed_engine.url
    for route in ("/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update",
                  "/init_weights_update_group", "/update_weights_from_disk", "/generate",
                  "/model_info", "/weights_checker", "/pause_generation"):  # fmt: skip
        for key in (None, "wrong"):
            status, body = _post(url + route, {}, key)
            assert (status, json.loads(body)) == (401, {"error": "Unauthorized"}), (route, key)
    with urllib.request.urlopen(url + "/health", timeout=30) as r:  # probes stay open
        assert r.status == 200
    # The same client without the key is refused by name; with it, it pushes and generates.
    bare = SGLangClient(ClientConfig(engine_urls=[url]))
    with pytest.raises(EngineError, match="HTTP 401"):
        bare.begin_weight_update()
    bare.close()
    client = SGLangClient(ClientConfig(engine_urls=[url], api_key=KEY))
    try:
        name = "model.norm.weight"
        new = torch.full_like(weights_a[name], 0.5)
        with client.weight_update_session("v-key"):
            client.update_weights_from_tensor([(name, new)])
        assert client.weight_version() == {url: "v-key"}
        held = dict(keyed_engine.policy.model.named_parameters())[name].detach()
        assert torch.equal(held.to(new.dtype), new)
        res = client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=1))
        assert len(res.samples) == 1 and res.samples[0].weight_version == "v-key"
    finally:
        with client.weight_update_session():
            client.update_weights_from_tensor([(name, weights_a[name])])
        client.close()
