"""Engines the trainer launches (`rollout.launch`): on every node of the job, per-job ports.

    launched = start_node_engines(cfg.rollout.launch, cfg.rollout.client, log_dir)  # every rank

Each node's local rank 0 starts that node's share of the engines (`num_engines / nodes`, on
the node's own GPUs, as a colocated job places them); the other ranks start nothing. The
engine URLs are then all-gathered (node order) so rank 0's client reaches every engine, and a
node whose launch failed makes every rank raise the same error instead of leaving the others
waiting in a collective.

Ports are per job: engine i of a node listens on base + i, where base is the first run of
`num_engines` consecutive ports at or above `rollout.launch.base_port` (0: 30000) that no one
holds; the ports stay reserved (`dist.free_ports`) until the engines answer, so two jobs on
one node, or anything else asking the OS for a port meanwhile, cannot take them.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_gspo import dist
from megatron_gspo.config_io import ConfigError
from megatron_gspo.engines.client_config import ClientConfig
from megatron_gspo.engines.interpreter import sglang_python
from megatron_gspo.engines.launch import LaunchConfig, ServerGroup, engine_gpu_ids
from megatron_gspo.engines.launch import launch as start_servers

DEFAULT_BASE_PORT = 30000


@dataclass
class LaunchedEngines:
    """What `start_node_engines` returns on every rank."""

    urls: list[str]
    """Every engine of the job, node by node."""
    tp_sizes: list[int]
    api_key: str | None
    router_url: str | None = None
    servers: ServerGroup | None = None
    """This process's `ServerGroup` (each node's local rank 0), else None."""
    per_node: list[int] = field(default_factory=list)
    """Engines each node started."""
    gpu_ids: list[list[int]] = field(default_factory=list)
    """Per engine (`urls` order), the GPU of each TP rank on its node: engine i of a node
    starts at `rollout.launch.base_gpu_id` + i x tp x dp, its ranks one GPU apart (on CPU the
    slot it would take on a GPU node); empty when unknown."""


def node_of_this_rank() -> tuple[int, int, bool]:
    """(node index, number of nodes, whether this is the node's local rank 0), from torchrun's
    environment (GROUP_RANK, WORLD_SIZE / LOCAL_WORLD_SIZE, LOCAL_RANK)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    node = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    return node, max(1, world // max(1, local_world)), int(os.environ.get("LOCAL_RANK", "0")) == 0


def _node_address(host: str, nodes: int) -> str:
    """The address this node's engines bind to and are reached at: `host`, unless the job has
    several nodes and `host` is a loopback address (rank 0 on another node could not reach
    it); then the address this node routes to the job's master with."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if nodes == 1 or not loopback:
        return host
    return dist.routable_address([os.environ.get("MASTER_ADDR", "")])


def engines_on_node(num_engines: int, node: int, nodes: int) -> int:
    """Node `node`'s share of `num_engines` over `nodes` nodes: as even as it goes, the first
    nodes taking one more (1 engine on 2 nodes: node 0 starts it, node 1 none)."""
    return num_engines // nodes + (1 if node < num_engines % nodes else 0)


def node_launch_config(
    launch: LaunchConfig, client: ClientConfig, log_dir: str | Path, node: int, nodes: int
) -> LaunchConfig | None:
    """This node's `LaunchConfig`: its share of the engines (`engines_on_node`), its address,
    reserved ports; None when this node starts no engine."""
    if nodes > 1 and launch.router:
        raise ConfigError(
            f"rollout.launch.router=true with engines on {nodes} nodes: the router would see "
            "one node's engines only; set rollout.launch.router=false (the client balances)"
        )
    per_node = engines_on_node(launch.num_engines, node, nodes)
    if per_node == 0:
        return None
    host = _node_address(launch.host, nodes)
    start = launch.base_port or DEFAULT_BASE_PORT
    base = dist.free_ports(host, per_node, start)
    out = dataclasses.replace(launch, num_engines=per_node, host=host, base_port=base)
    if out.router:
        out = dataclasses.replace(out, router_port=dist.free_ports(host, 1, launch.router_port))
        metrics = dist.free_ports(host, 1, launch.router_metrics_port)
        out = dataclasses.replace(out, router_metrics_port=metrics)
    if out.log_dir is None:  # one directory per node when there are several
        logs = Path(log_dir) / f"node{node}" if nodes > 1 else Path(log_dir)
        out = dataclasses.replace(out, log_dir=str(logs))
    # One key: the engines we start demand the one our client sends.
    out = dataclasses.replace(out, api_key=launch.api_key or client.api_key)
    if out.backend == "sglang" and out.python is None:
        out = dataclasses.replace(out, python=sglang_python())  # preflight checked it resolves
    return out


def _release(launch_cfg: LaunchConfig) -> None:
    for port in range(launch_cfg.base_port, launch_cfg.base_port + launch_cfg.num_engines):
        dist.release_port(launch_cfg.host, port)
    if launch_cfg.router:
        dist.release_port(launch_cfg.host, launch_cfg.router_port)
        dist.release_port(launch_cfg.host, launch_cfg.router_metrics_port)


def start_node_engines(
    launch: LaunchConfig,
    client: ClientConfig,
    log_dir: str | Path,
    launch_fn: Callable[[LaunchConfig], ServerGroup] | None = None,
) -> LaunchedEngines:
    """Collective: every node's local rank 0 starts its engines; every rank returns all of the
    job's engine URLs once every engine can generate. `begin_node_engines(...).wait()`."""
    return begin_node_engines(launch, client, log_dir, launch_fn).wait()


def begin_node_engines(
    launch: LaunchConfig,
    client: ClientConfig,
    log_dir: str | Path,
    launch_fn: Callable[[LaunchConfig], ServerGroup] | None = None,
) -> PendingEngines:
    """Not collective: this node's local rank 0 spawns its engines and returns at once, so the
    trainer builds its model while the engines import SGLang and load theirs (on 2 CPU cores
    this saves ~10 s of a ~30 s start). `PendingEngines.wait` (collective) finishes.
    `launch_fn(LaunchConfig)` spawns a node's engines (default: `engines.launch.launch` without
    waiting); what it returns is waited on through its `wait_ready()` when it has one, and
    shut down with `shutdown()`."""
    node, nodes, first = node_of_this_rank()
    pending = PendingEngines(launch=launch, client=client, node=node)
    if first:
        try:
            pending.local = node_launch_config(launch, client, log_dir, node, nodes)
            if pending.local is not None:
                spawn = launch_fn or (lambda cfg: start_servers(cfg, wait=False))
                try:
                    pending.servers = spawn(pending.local)
                except BaseException:
                    _release(pending.local)
                    raise
        except Exception as e:  # noqa: BLE001 - every rank raises it in `wait`
            pending.error = f"{type(e).__name__}: {e}"
    return pending


@dataclass
class PendingEngines:
    """Engines `begin_node_engines` spawned on this node (if any), not yet known to serve."""

    launch: LaunchConfig
    client: ClientConfig
    node: int
    local: LaunchConfig | None = None
    servers: ServerGroup | None = None
    error: str | None = None

    def wait(self) -> LaunchedEngines:
        """Collective: wait until this node's engines can generate, then all-gather every
        node's URLs; a node whose engines failed makes every rank raise the same error."""
        mine: dict[str, Any] = {"node": self.node, "urls": [], "router": None, "error": None}
        mine["error"] = self.error
        if self.local is not None and self.servers is not None and self.error is None:
            try:
                if (ready := getattr(self.servers, "wait_ready", None)) is not None:
                    ready()
                mine |= {"urls": self.local.engine_urls, "router": self.local.router_url}
            except Exception as e:  # noqa: BLE001 - every rank raises it below
                mine["error"] = f"{type(e).__name__}: {e}"
            finally:
                _release(self.local)  # the servers hold their ports now (or failed to)
        everyone: list[Any] = [mine]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            everyone = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, mine)
        failed = [f"node {m['node']}: {m['error']}" for m in everyone if m["error"]]
        if failed:
            self.shutdown()
            err = "; ".join(failed)
            raise (ConfigError if "ConfigError" in err else RuntimeError)(
                f"engines did not start: {err}"
            )
        launchers = sorted((m for m in everyone if m["urls"]), key=lambda m: m["node"])
        urls = [u for m in launchers for u in m["urls"]]
        launch = self.launch
        return LaunchedEngines(
            urls=urls,
            tp_sizes=[launch.tp_size] * len(urls),
            api_key=launch.api_key or self.client.api_key,
            router_url=next((m["router"] for m in launchers if m["router"]), None),
            servers=self.servers,
            per_node=[len(m["urls"]) for m in launchers],
            gpu_ids=engine_gpu_ids(launch, [len(m["urls"]) for m in launchers]),
        )

    def shutdown(self) -> None:
        """Stop this node's engines (a start abandoned before `wait`, or a failed one)."""
        if self.servers is not None:
            self.servers.shutdown()
            self.servers = None
