"""Two embedded engines behind the real `sglang-router` (Rust binary, CPU) serve one batch."""

from __future__ import annotations

import pytest

from megatron_gspo.dist import free_port
from megatron_gspo.engines.client import ClientConfig, SGLangClient
from megatron_gspo.engines.launch import LaunchConfig, ServerGroup
from megatron_gspo.engines.types import SamplingParams

pytestmark = pytest.mark.timeout(240)  # a hung server must fail, not stall CI

pytest.importorskip("sglang_router")


@pytest.fixture
def router(engine_a, engine_b, ckpt_a, tmp_path):
    cfg = LaunchConfig(
        model_path=ckpt_a, backend="embedded", router_port=free_port(), log_dir=str(tmp_path)
    )
    group = ServerGroup(cfg)
    try:
        url = group.start_router([engine_a.url, engine_b.url])
        yield url
    finally:
        group.shutdown()
    assert group.router.poll() is not None


def test_router_round_robins_a_batch_over_two_engines(router, engine_a, engine_b):
    before = (engine_a.tm.num_requests_served, engine_b.tm.num_requests_served)
    client = SGLangClient(
        ClientConfig(
            engine_urls=[engine_a.url, engine_b.url],
            router_url=router,
            max_batch_per_request=2,
            validate_requests=True,
        )
    )
    res = client.generate([[1, i + 3] for i in range(6)], SamplingParams(max_new_tokens=3), n=2)
    assert [s.key for s in res.samples] == [(i, j) for i in range(6) for j in range(2)]
    assert set(res.stats.requests_per_engine) == {router}
    served_a = engine_a.tm.num_requests_served - before[0]
    served_b = engine_b.tm.num_requests_served - before[1]
    assert served_a >= 1 and served_b >= 1 and served_a + served_b >= 6
    # Control calls still go to each engine directly.
    assert client.health() == {engine_a.url: True, engine_b.url: True}
