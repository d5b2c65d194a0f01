"""Rank program of tests/engines/test_node_engines.py: each gloo rank plays one node of a job
(torchrun's GROUP_RANK / LOCAL_RANK / LOCAL_WORLD_SIZE as on 2 nodes x 1 process)."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from megatron_gspo.engines.client_config import ClientConfig
from megatron_gspo.engines.launch import LaunchConfig
from megatron_gspo.engines.nodes import start_node_engines


class _Servers:
    """Listens on the engines' ports (SO_REUSEADDR, as uvicorn does) until shut down."""

    def __init__(self, host: str, ports: range) -> None:
        self.socks = []
        for port in ports:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.listen()
            self.socks.append(s)

    def shutdown(self) -> None:
        for s in self.socks:
            s.close()


def _taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def main(rank: int, world: int, num_engines: int, log_dir: str) -> dict[str, Any]:
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    launched: list[dict[str, Any]] = []

    def fake_launch(cfg: LaunchConfig) -> _Servers:
        ports = range(cfg.base_port, cfg.base_port + cfg.num_engines)
        launched.append(
            {
                "host": cfg.host,
                "num_engines": cfg.num_engines,
                "urls": cfg.engine_urls,
                "held_while_starting": [_taken(cfg.host, p) for p in ports],
                "log_dir": cfg.log_dir,
            }
        )
        return _Servers(cfg.host, ports)

    def start(n: int):  # noqa: ANN202
        launch = LaunchConfig(backend="embedded", num_engines=n, base_port=0)
        return start_node_engines(launch, ClientConfig(), log_dir, launch_fn=fake_launch)

    out = start(num_engines)
    result = {
        "launched": list(launched),
        "urls": out.urls,
        "per_node": out.per_node,
        "mine": out.servers is not None,
    }
    torch.distributed.barrier()  # both nodes' engines up before either shuts down
    out.servers.shutdown()
    launched.clear()
    # a count that does not split evenly: the first nodes take one more
    uneven = start(num_engines + 1)
    result["uneven_urls"], result["uneven_per_node"] = uneven.urls, uneven.per_node
    result["uneven_launched"] = [c["num_engines"] for c in launched]
    torch.distributed.barrier()
    uneven.servers.shutdown()
    return result
