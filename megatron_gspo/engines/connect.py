"""Start (or connect to) the engines a run uses, and hand back one `SGLangClient` over them.

The one place that wires `launch` (servers we start) to `client` (the HTTP client): the
client's pool restarts engines we launched when they are dropped (`rollout.launch.
max_restarts`), and multi-turn episodes get per-engine clients that share its pool.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_gspo.engines.client import SGLangClient
from megatron_gspo.engines.client_config import ClientConfig
from megatron_gspo.engines.launch import LaunchConfig, ServerGroup
from megatron_gspo.engines.nodes import LaunchedEngines, start_node_engines

__all__ = ["connect", "per_engine_clients", "sender_client"]


def connect(
    launch_cfg: LaunchConfig | None,
    client: ClientConfig,
    *,
    log_dir: str | Path,
    launched: LaunchedEngines | None = None,
) -> tuple[SGLangClient, ServerGroup | None]:
    """Rank 0: the client over the job's engines and this process's server group (or None).
    `launched`: the engines `nodes.start_node_engines` started on every node (train.main);
    None with `launch_cfg` set: start them here (a one-process job); `launch_cfg` None:
    `client.engine_urls` are already serving."""
    servers = None
    if launch_cfg is not None:
        if launched is None:
            launched = start_node_engines(launch_cfg, client, log_dir)
        servers = launched.servers
        # device=cpu: ServerGroup adds the CPU engine's env (launch.cpu_engine_env).
        client = dataclasses.replace(
            client,
            engine_urls=launched.urls,
            engine_gpu_ids=launched.gpu_ids or None,
            router_url=client.router_url or launched.router_url,
            engine_tp_sizes=launched.tp_sizes,
            api_key=launched.api_key,
        )
    engine = SGLangClient(client)
    if servers is not None:  # engines we launched are restarted when dropped (max_restarts)
        engine.pool.restart = servers.restart_engine
    return engine, servers


def per_engine_clients(client: object) -> tuple[SGLangClient, ...]:
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
    gpus = cfg.engine_gpu_ids
    clients = tuple(
        SGLangClient(
            dataclasses.replace(
                cfg,
                engine_urls=urls[i:] + urls[:i],
                engine_tp_sizes=tps[i:] + tps[:i],
                engine_gpu_ids=None if gpus is None else gpus[i:] + gpus[:i],
            ),
            in_order=True,
        )
        for i in range(len(urls))
    )
    for c in clients:  # one view of dead / rejoining engines: no turn goes to an engine the
        c.pool = client.pool  # weight sync has dropped or not yet re-admitted
    return clients


def sender_client(
    client: ClientConfig, launched: LaunchedEngines | None, *, node: int | None
) -> SGLangClient | None:
    """Any rank: a client over the engines this rank pushes weights to as one of several
    senders (`weights.senders=owners`): node `node`'s engines (`launched.per_node`; the CUDA-IPC
    transport), or every engine with `node` None; engines started outside the job
    (`launched` None) count as on every node. None when there is none to push to."""
    urls, tps = list(client.engine_urls), list(client.engine_tp_sizes or [])
    api_key, gpus = client.api_key, client.engine_gpu_ids
    if launched is not None:
        urls, tps, api_key = list(launched.urls), list(launched.tp_sizes), launched.api_key
        gpus = list(launched.gpu_ids) or None
        if node is not None and launched.per_node:
            first = sum(launched.per_node[:node])
            count = launched.per_node[node] if node < len(launched.per_node) else 0
            urls, tps = urls[first : first + count], tps[first : first + count]
            gpus = gpus[first : first + count] if gpus else None
    if not urls:
        return None
    # Weights only: no router (it routes generation), one TP size per engine.
    cfg = dataclasses.replace(
        client,
        engine_urls=urls,
        engine_tp_sizes=tps or [1] * len(urls),
        # Where each engine rank runs: the colocated push feeds it from that GPU's trainer rank.
        engine_gpu_ids=gpus if node is not None else None,
        router_url=None,
        api_key=api_key,
    )
    return SGLangClient(cfg)
