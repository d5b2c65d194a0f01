"""When a weight push is verified: the first push, every `weights.verify_every`-th, and every
push that an engine re-joins (restarted, or back from a hang), whatever the schedule.

One in-process receiver (`FakeEngine`, SGLang's payload path) with the real `EnginePool`
bookkeeping of two engine ids in front of it; the bridge is `HFBridge` (fixed HF tensors).
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.engines.pool import EnginePool
from megatron_gspo.weights.checksum import WeightIntegrityError
from megatron_gspo.weights.config import WeightSyncConfig
from megatron_gspo.weights.sync import WeightSync
from megatron_gspo.weights.verify import verification_due
from tests.engines.helpers import HFBridge
from tests.weights.fake_engine import FakeEngine

WEIGHTS = {
    "model.embed_tokens.weight": torch.randn(16, 8, generator=torch.Generator().manual_seed(0)),
    "model.norm.weight": torch.ones(8),
    "lm_head.weight": torch.randn(16, 8, generator=torch.Generator().manual_seed(1)),
}


class PooledEngine(FakeEngine):
    """Two engine ids behind one receiver; `EnginePool` decides who is dead / joining / live,
    and counts the checksum requests (what a verified push asks of the engines)."""

    def __init__(self) -> None:
        super().__init__("a", tp_size=1)
        self.pool = EnginePool(["a", "b"], dead_after_failures=1, cooldown_s=0.0)
        self.answering: set[str] = set()
        self.checksum_calls = 0

    def prepare_sync(self) -> list[str]:
        self.pool.probe_dead(lambda urls: {u for u in urls if u in self.answering})
        return sorted(self.pool.joining)

    def commit_sync(self, weight_version: str) -> None:
        self.pool.commit(weight_version)

    def weights_checksum(self) -> dict:
        self.checksum_calls += 1
        return super().weights_checksum()


def _sync(engine: PooledEngine, verify_every: int) -> WeightSync:
    cfg = WeightSyncConfig(transport="tensor", experts_to_first=False, verify_every=verify_every)
    return WeightSync(HFBridge(WEIGHTS), [engine], cfg)


def test_schedule_is_the_first_push_and_every_nth() -> None:
    """Against the schedule written out: versions 1, N, 2N, ... and nothing else."""
    for n in (1, 3, 4):
        engine = PooledEngine()
        sync = _sync(engine, n)
        got = [v for v in range(1, 13) if sync.push([]).verified]
        assert got == [1] + [v for v in range(2, 13) if v % n == 0], n
        assert engine.checksum_calls == len(got)
        assert got == [v for v in range(1, 13) if verification_due(v, n, verified_before=v > 1)]
    never = _sync(PooledEngine(), 0)
    assert not any(never.push([]).verified for _ in range(3))


def test_a_rejoined_engine_is_verified_on_its_next_push() -> None:
    """Engine b dies after push 1 and answers again before push 3 (not due with N=10): push 3
    is verified, so b's bad tensor (a restart that loaded it wrongly) fails the sync and b
    does not serve; push 4 is verified again (b still joining) and brings b back."""
    engine = PooledEngine()
    sync = _sync(engine, verify_every=10)
    assert sync.push([]).verified  # v1: the first push
    engine.pool.drop("b", "killed")
    assert not sync.push([]).verified  # v2: not due, nobody joining
    engine.answering.add("b")
    engine.corrupt_name = "lm_head.weight"  # what the restarted engine holds is wrong
    with pytest.raises(WeightIntegrityError, match="lm_head.weight"):
        sync.push([])  # v3: b joins -> verified, though 3 % 10 != 0
    assert engine.pool.joining == {"b"} and engine.pool.live() == ["a"]
    engine.corrupt_name = None
    report = sync.push([])  # v4: b still joining -> verified again
    assert report.verified and report.version == 4
    assert engine.pool.live() == ["a", "b"] and not engine.pool.joining
    assert not sync.push([]).verified  # v5: back to the schedule
    assert engine.checksum_calls == 3  # v1, v3, v4


def test_default_schedule_is_sparse_but_starts_verified() -> None:
    """The default (`WeightSyncConfig().verify_every`) verifies the first push, not the next."""
    n = WeightSyncConfig().verify_every
    assert n > 1
    engine = PooledEngine()
    cfg = WeightSyncConfig(transport="tensor", experts_to_first=False)
    sync = WeightSync(HFBridge(WEIGHTS), [engine], cfg)
    assert [sync.push([]).verified for _ in range(n)] == [True] + [False] * (n - 2) + [True]


def test_engine_tp_sizes_come_from_the_receiver_protocol() -> None:
    """What the sender shards its checksums for is what each receiver declares
    (`WeightReceiver.engine_tp_sizes`), not an attribute it happens to have."""
    from megatron_gspo.engines.client import ClientConfig, SGLangClient
    from megatron_gspo.engines.protocols import WeightReceiver
    from megatron_gspo.weights.sync import engine_tp_sizes

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    client = SGLangClient(ClientConfig(engine_urls=urls, engine_tp_sizes=[2, 4]))
    try:
        assert isinstance(client, WeightReceiver) and isinstance(FakeEngine(), WeightReceiver)
        assert client.engine_tp_sizes() == [2, 4]
        assert engine_tp_sizes([client, FakeEngine()]) == [1, 2, 4]
        assert engine_tp_sizes([FakeEngine()]) == [1]
    finally:
        client.close()
