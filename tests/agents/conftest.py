"""The agent tests' shared stack: a memorised tiny model on the embedded engine, a recording
proxy in front of it, and the endpoint (built once for the package: the memorising costs
seconds of CPU, ~20 s on 2 loaded cores: every test that uses it is in the slow tier)."""

from __future__ import annotations

import pytest

from megatron_gspo.agents.config import AgentEndpointConfig
from megatron_gspo.agents.server import AgentEndpoint
from megatron_gspo.data.chat_toy import build_chat_toy_tokenizer
from tests.agents.fixtures import RecordingProxy, memorised_checkpoint


@pytest.fixture(scope="package")
def stack(tmp_path_factory):
    from megatron_gspo.engines.client import ClientConfig, SGLangClient
    from megatron_gspo.engines.embedded.server import EmbeddedServer

    ckpt = memorised_checkpoint(tmp_path_factory.mktemp("agent_ckpt"))
    engine = EmbeddedServer(ckpt).start()
    proxy = RecordingProxy(engine.url)
    client = SGLangClient(ClientConfig(engine_urls=[proxy.url], validate_requests=True))
    tok = build_chat_toy_tokenizer()
    endpoint = AgentEndpoint(client, tok, AgentEndpointConfig())
    endpoint.start()
    yield endpoint, proxy, tok
    endpoint.stop()
    client.close()
    proxy.stop()
    engine.stop()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "stack" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
