"""Rank program of tests/weights/test_owners.py: `weights.senders=owners` against today's path.

Four gloo ranks, the tiny MoE, real embedded engines (SGLang's HTTP app over an HF model, fed
by `update_weights_from_tensor` shared-memory payloads from whichever process sends), one
scenario per (layout, nodes):

* `ep4`: one node, EP=4: today's push (`senders=one`) and the owners push, each into an engine
  reset to another checkpoint first; every rank counts the bytes it received over collectives
  and the bytes it sent to engines.
* `ep2_2nodes`: two "nodes" of two ranks (GROUP_RANK / LOCAL_WORLD_SIZE as torchrun sets them
  on two hosts), EP=2 inside each node, one engine per node started by the node's local rank
  0; every rank sends through a client that records which engine it wrote to.

Rank 0 returns small summaries (names that differ, counts), never tensors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.engines.client import ClientConfig, SGLangClient
from megatron_gspo.layout import Layout
from megatron_gspo.megatron.model import (
    build_model,
    init_megatron,
    load_bridge,
    make_provider,
    quiet_megatron,
)
from megatron_gspo.testing.weights import hf_state
from megatron_gspo.weights.sync import WeightSync, WeightSyncConfig

BUCKET_MB = 64 / 1024  # 64 KiB: several buckets per sender


class RecordingClient(SGLangClient):
    """An `SGLangClient` that records the engines and bytes of every tensor payload it posts."""

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)
        self.sent: list[tuple[str, int, list[str]]] = []

    def update_weights_from_tensor(self, named_tensors: Any, **kw: Any) -> None:
        nbytes = sum(t.numel() * t.element_size() for _, t in named_tensors)
        for url in self.config.engine_urls:
            self.sent.append((url, nbytes, [n for n, _ in named_tensors]))
        super().update_weights_from_tensor(named_tensors, **kw)


class CollectiveBytes:
    """Bytes this rank RECEIVES through tensor collectives while active (gather on the
    destination, all_gather, broadcast on the receivers)."""

    NAMES = ("gather", "all_gather", "all_gather_into_tensor", "broadcast")

    def __init__(self) -> None:
        self.received = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CollectiveBytes:
        d = torch.distributed
        me = d.get_rank()

        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        def wrap(name: str) -> Any:
            fn = getattr(d, name)

            def counted(*args: Any, **kw: Any) -> Any:
                out = fn(*args, **kw)
                if name == "gather":
                    parts = kw.get("gather_list", args[1] if len(args) > 1 else None)
                    if parts:
                        self.received += sum(size(p) for p in parts) - size(args[0])
                elif name == "all_gather":
                    self.received += sum(size(p) for p in args[0]) - size(args[1])
                elif name == "all_gather_into_tensor":
                    self.received += size(args[0]) - size(args[1])
                else:
                    src = kw.get("src", args[1] if len(args) > 1 else 0)
                    group = kw.get("group")
                    gsrc = src if group is None else d.get_global_rank(group, src)
                    if gsrc != me:
                        self.received += size(args[0])
                return out

            return counted

        for name in self.NAMES:
            self._saved[name] = getattr(d, name)
            setattr(d, name, wrap(name))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._saved.items():
            setattr(torch.distributed, name, fn)


def _engine_state(server: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in server.policy.model.state_dict().items()}


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    keys = set(a) | set(b)
    return sorted(n for n in keys if n not in a or n not in b or not torch.equal(a[n], b[n]))


def scenario(
    rank: int, bridge: Any, other: str, layout: Layout, ranks_per_node: int
) -> dict[str, Any]:
    """Today's push, then the owners push, each into engines reset to `other`."""
    from megatron_gspo.engines.embedded.server import EmbeddedServer

    os.environ["GROUP_RANK"] = str(rank // ranks_per_node)
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    node = rank // ranks_per_node
    init_megatron(layout)
    model = build_model(make_provider(bridge, layout), load_from=bridge)
    ref = hf_state(bridge, model)
    total = sum(t.numel() * t.element_size() for t in ref.values())
    server = EmbeddedServer(other).start() if rank % ranks_per_node == 0 else None
    urls: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(urls, server.url if server else None)
    node_urls = [u for u in urls if u]
    every = SGLangClient(ClientConfig(engine_urls=node_urls)) if rank == 0 else None
    mine = RecordingClient(ClientConfig(engine_urls=[node_urls[node]]))
    out: dict[str, Any] = {"model_bytes": total, "node": node}
    for senders in ("one", "owners"):
        cfg = WeightSyncConfig(
            transport="tensor",
            senders=senders,
            bucket_mb=BUCKET_MB,
            verify_every=1,
            verify_names="common",
        )
        sync = WeightSync(bridge, [every] if every else [], cfg, send_engines=[mine])
        info: dict[str, Any] = {}
        # owners: the first verified push learns the engines' naming through one sender; the
        # second (HF names: the embedded engine) is the owners push measured here.
        for push in (1, 2) if senders == "owners" else (1,):
            if every is not None:
                every.update_weights_from_disk(other, weight_version="reset")
            torch.distributed.barrier()
            mine.sent.clear()
            with CollectiveBytes() as counted:
                report = sync.push(model)
            info = {
                "push": push,
                "version": report.version,
                "verified": report.verified,
                "received": counted.received,
                "sent": sync.local_stats.bytes_sent,
                "bytes_by_rank": report.bytes_by_rank,
                "tensors": report.stats.tensors,
                "records": [(u, n, names) for u, n, names in mine.sent],
            }
        sync.close()
        if every is not None:
            info["engine_version"] = every.weight_version()
        if server is not None:
            info["state"] = _engine_state(server)
        out[senders] = info
    if server is not None:
        one, owners = out["one"].pop("state"), out["owners"].pop("state")
        out["engine_vs_today"] = _diff(one, owners)
        # Every parameter the engine holds under an exported name equals the export.
        out["engine_vs_export"] = sorted(
            n for n in owners if n in ref and not torch.equal(owners[n], ref[n].to(owners[n].dtype))
        )
        out["engine_params"] = len(owners)
        out["engine_params_exported"] = sum(n in ref for n in owners)
    mine.close()
    if every is not None:
        every.close()
    torch.distributed.barrier()
    if server is not None:
        server.stop()
    return out


def main(rank: int, world: int, hf_dir: str, tmp: str) -> dict[str, Any]:
    from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint

    quiet_megatron()
    bridge = load_bridge(hf_dir)
    other = str(Path(tmp) / "hf_other")
    if rank == 0:
        save_tiny_hf_checkpoint(Path(other), seed=7)
    torch.distributed.barrier()
    return {
        "ep4": scenario(rank, bridge, other, Layout(ep=4), ranks_per_node=4),
        "ep2_2nodes": scenario(rank, bridge, other, Layout(ep=2), ranks_per_node=2),
    }
