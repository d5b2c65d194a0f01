"""Start (or connect to) the engines a run uses, and hand back one `SGLangClient` over them.

The one place that wires `launch` (servers we start) to `client` (the HTTP client): the
client's pool restarts engines we launched when they are dropped (`rollout.launch.
max_restarts`), and multi-turn episodes get per-engine clients that share its pool.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from megatron_gspo.dist import free_port
from megatron_gspo.engines.client import SGLangClient
from megatron_gspo.engines.client_config import ClientConfig
from megatron_gspo.engines.interpreter import sglang_python
from megatron_gspo.engines.launch import LaunchConfig, ServerGroup, launch

__all__ = ["connect", "per_engine_clients"]


def connect(
    launch_cfg: LaunchConfig | None, client: ClientConfig, *, log_dir: str | Path
) -> tuple[SGLangClient, ServerGroup | None]:
    """Rank 0: launch the engines `launch_cfg` describes (None: `client.engine_urls` are
    already serving) and return the client over them with the server group (or None)."""
    servers = None
    if launch_cfg is not None:
        if launch_cfg.base_port == 0:
            launch_cfg = dataclasses.replace(launch_cfg, base_port=free_port(launch_cfg.host))
        if launch_cfg.log_dir is None:
            launch_cfg = dataclasses.replace(launch_cfg, log_dir=str(log_dir))
        # One key: the engines we start demand the one our client sends.
        api_key = launch_cfg.api_key or client.api_key
        launch_cfg = dataclasses.replace(launch_cfg, api_key=api_key)
        if launch_cfg.backend == "sglang" and launch_cfg.python is None:
            # preflight has checked on every rank that this resolves
            launch_cfg = dataclasses.replace(launch_cfg, python=sglang_python())
        # device=cpu: ServerGroup adds the CPU engine's env (launch.cpu_engine_env).
        servers = launch(launch_cfg)
        client = dataclasses.replace(
            client,
            engine_urls=launch_cfg.engine_urls,
            router_url=client.router_url or launch_cfg.router_url,
            engine_tp_sizes=[launch_cfg.tp_size] * launch_cfg.num_engines,
            api_key=api_key,
        )
    engine = SGLangClient(client)
    if servers is not None:  # engines we launched are restarted when dropped (max_restarts)
        engine.pool.restart = servers.restart_engine
    return engine, servers


def per_engine_clients(client: Any) -> tuple[Any, ...]:
    """For an `SGLangClient` over several engines without a router: one generation-only client
    per engine, engine i listed first in client i and picked first (`in_order`), so an episode's
    turns stay on one engine (its prefix cache) and fail over to the next only when it is down;
    the clients share the parent's engine pool (dead / rejoining engines). Otherwise ()."""
    cfg = getattr(client, "config", None)
    if not isinstance(client, SGLangClient) or cfg is None or cfg.router_url:
        return ()
    urls, tps = list(cfg.engine_urls), list(cfg.engine_tp_sizes or [1] * len(cfg.engine_urls))
    if len(urls) < 2:
        return ()
    clients = tuple(
        SGLangClient(
            dataclasses.replace(
                cfg, engine_urls=urls[i:] + urls[:i], engine_tp_sizes=tps[i:] + tps[:i]
            ),
            in_order=True,
        )
        for i in range(len(urls))
    )
    for c in clients:  # one view of dead / rejoining engines: no turn goes to an engine the
        c.pool = client.pool  # weight sync has dropped or not yet re-admitted
    return clients
