"""Rank program of tests/weights/test_owners_sglang_tp2.py: pushes from 2 gloo trainer ranks
(EP 2) into REAL TP-2 SGLang 0.5.23 CPU servers, one per engine layout (engine EP 1 and 2).

Per server, each push into a server reset to another checkpoint first (`/update_weights_from
_disk`), in this order:

* `ref`: one sender, HF names (`senders=one`, `layout=hf`): the reference the others are read
  back against (SGLang maps every HF tensor itself);
* `one`: one sender in SGLang's own layout (`load_format="direct"`, each engine rank its part);
* `owners`: every rank sends its shard, per-parameter senders (engine GPUs unknown);
* `home`: the colocated home path (`engine_gpu_ids` [[0, 1]]: engine rank r on the "GPU" of
  trainer rank r), each trainer rank feeding only its engine rank.

Each push is verified by WeightSync itself (the senders' hashes against the server's
`/weights_checker`) and, independently, by SGLang's checksums of the bridge's whole export
(`verify_engines` over `EngineChecksums`); the server's per-rank checksums after it are read
back against `ref`'s. `one`, `owners` and `home` also push once (before their clean push)
with one engine rank's expert slice corrupted on the sender after it was hashed
(`corrupt_wire`): every check must fail. The last push (`home`, clean) leaves the trainer's
weights on each server.
Rank 0 returns checksums and error strings, never tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from megatron_gspo.engines import wire
from megatron_gspo.engines.client import ClientConfig, SGLangClient
from megatron_gspo.engines.weight_layout import engine_layout, rank_pieces
from megatron_gspo.engines.weight_shards import EngineChecksums, EngineLayout
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
from megatron_gspo.weights.verify import verify_engines
from tests.weights.owners_ranks import CollectiveBytes

BUCKET_MB = 64 / 1024  # 64 KiB: several requests per sender
PATHS: dict[str, dict[str, Any]] = {
    "ref": {"senders": "one", "layout": "hf"},
    "one": {"senders": "one"},
    "owners": {"senders": "owners"},
    # unverified: each rank's experts as slices where an engine rank's span both trainer ranks
    "slices": {"senders": "owners", "verify_every": 0},
    "home": {"senders": "owners"},  # with engine_gpu_ids: the colocated home path
}
CORRUPT = (1, "model.layers.1.mlp.experts.w2_weight")
"""(engine rank, SGLang parameter) whose slice the corrupted pushes alter on the sender."""


class RecordingClient(SGLangClient):
    """An `SGLangClient` that records, per `direct` request this process posts, which engine
    ranks got a non-empty entry (the home path fills only its own rank's)."""

    ranks_written: set[int] = set()  # class-level: `one_engine` builds new instances
    names: set[str] = set()  # the pieces' names (expert slices: `<param>@experts=<i>`)

    def update_weights_from_tensor(self, named_tensors: Any, **kw: Any) -> None:
        layout = kw.get("layout")
        if layout is not None:
            (tp,) = self.engine_tp_sizes()
            lay = engine_layout(layout, tp)
            for r in range(tp):
                if pieces := rank_pieces(named_tensors, r, lay):
                    RecordingClient.ranks_written.add(r)
                    RecordingClient.names.update(p.name for p in pieces)
        super().update_weights_from_tensor(named_tensors, **kw)


@contextmanager
def corrupt_wire(target: tuple[int, str]) -> Iterator[list[int]]:
    """Alter the first element of engine rank `target[0]`'s part of `target[1]` as it is
    written into that rank's payload buffer, after the sender hashed it: a silent error on
    the way to the engine (test-only: wraps `wire.direct_payloads_for_engines`). Yields a
    list that counts the corrupted pieces."""
    original = wire.direct_payloads_for_engines
    hits: list[int] = []

    def corrupted(per_rank: Any, engines: int, buffers: Any = None) -> Any:
        per_rank = [list(p) for p in per_rank]
        rank, name = target
        for i, piece in enumerate(per_rank[rank] if rank < len(per_rank) else []):
            if piece.name == name:
                first = piece.sources[0].clone()
                first.view(-1)[0] += 1
                per_rank[rank][i] = dataclasses.replace(
                    piece, sources=[first, *piece.sources[1:]]
                )
                hits.append(1)
        return original(per_rank, engines, buffers)

    wire.direct_payloads_for_engines = corrupted
    try:
        yield hits
    finally:
        wire.direct_payloads_for_engines = original


def _rank_sums(client: SGLangClient) -> list[dict[str, str]]:
    (info,) = client.weights_checksum().values()
    return [r["checksums"] for r in info["ranks"]]


def _differs(a: list[dict[str, str]], b: list[dict[str, str]]) -> list[str]:
    """`r<rank>/<name>` of every parameter whose checksum differs (or is missing on a side)."""
    out = []
    for r, (x, y) in enumerate(zip(a, b, strict=True)):
        out += [f"r{r}/{n}" for n in sorted(set(x) | set(y)) if x.get(n) != y.get(n)]
    return out


def _push(sync: WeightSync, model: Any, report: list[Any]) -> None:
    report.append(sync.push(model))


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the outcome is the result
        return f"{type(e).__name__}: {e}"
    return ""


def one_server(
    rank: int, bridge: Any, model: Any, export: dict[str, torch.Tensor], server: dict[str, Any]
) -> dict[str, Any]:
    """Every path into one TP-2 server (`server`: url, ep, hf_dir, other)."""
    from transformers import AutoConfig

    url, ep = server["url"], server["ep"]
    lay = EngineLayout.of(AutoConfig.from_pretrained(server["hf_dir"]), 2, ep)
    predicted = EngineChecksums([lay])  # SGLang's checksums of the whole export, per rank
    for n, t in sorted(export.items()):
        predicted.add(n, t.to(torch.bfloat16).contiguous())
    out: dict[str, Any] = {}
    for path, kw in PATHS.items():
        gpus = [[0, 1]] if path == "home" else None
        cfg = ClientConfig(engine_urls=[url], engine_tp_sizes=[2], engine_gpu_ids=gpus)
        every = SGLangClient(cfg) if rank == 0 else None
        mine = RecordingClient(cfg)
        # The corrupted push first: the clean one leaves the trainer's weights on the server.
        for corrupt in (True, False) if path not in ("ref", "slices") else (False,):
            if every is not None:
                every.update_weights_from_disk(server["other"], weight_version="reset")
                if path == "ref":
                    out["reset_sums"] = _rank_sums(every)  # what a push that wrote nothing leaves
            torch.distributed.barrier()
            RecordingClient.ranks_written, RecordingClient.names = set(), set()
            base = dict(
                transport="tensor", bucket_mb=BUCKET_MB, verify_every=1, dtype="bfloat16",
                engine_ep_size=ep,
            )  # fmt: skip
            sync_cfg = WeightSyncConfig(**{**base, **kw})
            sync = WeightSync(bridge, [every] if every else [], sync_cfg, send_engines=[mine])
            hits: list[int] = []
            report: list[Any] = []
            try:
                with CollectiveBytes() as counted:
                    if corrupt:
                        with corrupt_wire(CORRUPT) as hits:
                            err = _error(partial(_push, sync, model, report))
                    else:
                        err = _error(partial(_push, sync, model, report))
            finally:
                sync.close()
            torch.distributed.barrier()
            key = f"{path}_corrupt" if corrupt else path
            info: dict[str, Any] = {
                "push_error": err,
                "verified": bool(report and report[0].verified),
                "ranks_written": sorted(RecordingClient.ranks_written),
                "slice_names": sorted(n for n in RecordingClient.names if "@experts=" in n),
                "corrupted_pieces": len(hits),
                "direct": sync.local_stats.direct_experts,
                "received": counted.received,  # bytes over collectives and point to point
                "sent": sync.local_stats.bytes_sent,  # bytes this rank sent to the server
                "tensors": report[0].stats.tensors if report else 0,
            }
            if every is not None:
                info["sums"] = _rank_sums(every)
                info["version"] = every.weight_version()[url]
                info["independent"] = _error(partial(verify_engines, [every], predicted))
            out[key] = info
        mine.close()
        if every is not None:
            every.close()
    if rank == 0:
        ref = out["ref"].pop("sums")
        out["ref"]["reset_vs_ref"] = _differs(ref, out.pop("reset_sums"))
        for key, info in out.items():
            if key != "ref":
                info["vs_ref"] = _differs(ref, info.pop("sums"))
        out["ref"]["params_per_rank"] = [len(r) for r in ref]
    return out


def main(rank: int, world: int, hf_dir: str, servers: list[dict[str, Any]]) -> dict[str, Any]:
    quiet_megatron()
    bridge = load_bridge(hf_dir)
    layout = Layout(ep=2)
    init_megatron(layout)
    model = build_model(make_provider(bridge, layout), load_from=bridge)
    export = hf_state(bridge, model)
    out: dict[str, Any] = {"rank": rank}
    for server in servers:
        out[f"ep{server['ep']}"] = one_server(rank, bridge, model, export, server)
    return out
