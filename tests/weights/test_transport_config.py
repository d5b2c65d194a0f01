"""The distributed transport's rendezvous keys (`weights.master_address`, `weights.master_port`)
and the per-TP-rank tensor payloads, without engines (fast)."""

from __future__ import annotations

import ipaddress
import socket
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from megatron_gspo.config_io import ConfigError
from megatron_gspo.dist import free_port
from megatron_gspo.engines.client import ClientConfig, SGLangClient
from megatron_gspo.engines.wire import (
    deserialize_named_tensors,
    serialize_flattened_bucket,
)
from megatron_gspo.weights.sync import WeightSync, WeightSyncConfig
from megatron_gspo.weights.transports import routable_address


class _AloneEngine:
    """An engine pool with no ranks of its own: the group is the trainer alone (size 1)."""

    weight_update_world_size = 1

    def __init__(self) -> None:
        self.told: list[tuple[str, int]] = []

    def init_weights_update_group(self, address: str, port: int, **_: Any) -> Future[None]:
        self.told.append((address, port))
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def destroy_weights_update_group(self, group_name: str = "") -> None:
        return None


def _setup(**cfg: Any) -> tuple[str, int]:
    engine = _AloneEngine()
    sync = WeightSync(None, [engine], WeightSyncConfig(transport="distributed", **cfg))
    sync.transport.setup()
    sync.transport.close()
    (told,) = engine.told
    return told


def test_master_port_is_the_rendezvous_port() -> None:
    port = free_port()
    assert _setup(backend="gloo", master_address="127.0.0.1", master_port=port) == (
        "127.0.0.1",
        port,
    )
    # 0 picks a free port per group.
    addr, picked = _setup(backend="gloo", master_address="127.0.0.1", master_port=0)
    assert picked > 0 and (addr, picked) != ("127.0.0.1", port)
    with pytest.raises(ConfigError, match="master_port"):
        WeightSyncConfig(master_port=70000)


def test_default_master_address_routes_to_the_engines() -> None:
    local = SGLangClient(ClientConfig(engine_urls=["http://127.0.0.1:1"]))
    sync = WeightSync(None, local, WeightSyncConfig(transport="distributed", backend="gloo"))
    assert sync.transport.master_address == "127.0.0.1"
    local.close()
    assert routable_address([]) == socket.getfqdn()
    # An engine off this host wins over a local one: its route's source address.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("203.0.113.7", 9))  # TEST-NET-3: only the route is looked up
            own = s.getsockname()[0]
    except OSError:
        pytest.skip("no route off this host")
    assert routable_address(["127.0.0.1", "203.0.113.7"]) == own
    assert not ipaddress.ip_address(own).is_loopback


def test_one_payload_per_tp_rank_each_decodes_alone() -> None:
    named = [("a.weight", torch.arange(6.0).view(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16))]
    payloads, _bucket = serialize_flattened_bucket(named, tp_size=3)
    assert len(payloads) == 3
    for p in payloads:
        got = deserialize_named_tensors(p)
        assert [n for n, _ in got] == ["a.weight", "b"]
        assert all(torch.equal(t, ref) for (_, t), (_, ref) in zip(got, named, strict=True))
    with pytest.raises(ValueError, match="tp_size"):
        serialize_flattened_bucket(named, tp_size=0)
