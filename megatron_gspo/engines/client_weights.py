"""The weight-receiver half of `SGLangClient`: weight-update sessions, the three transports'
calls, versions, checksums (the `engines.protocols.WeightReceiver` protocol), over the
client's control plane (`client_control.ControlPlane`: `_control`, `_in_thread`, `pool`)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Self, cast

import torch

from megatron_gspo.engines import wire as proto
from megatron_gspo.engines.client_control import ControlPlane
from megatron_gspo.engines.protocols import WeightReceiver, weight_update_session
from megatron_gspo.engines.sglang_loader import LOADER, is_slice_name
from megatron_gspo.engines.weight_layout import (
    Sendable,
    engine_layout,
    rank_pieces,
    tensors_only,
)
from megatron_gspo.engines.weight_shards import EngineLayout

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

__all__ = ["WeightCalls"]


def _lists_our_loader(raw: bytes) -> bool:
    try:
        loaders = json.loads(raw).get("custom_weight_loader") or []
    except (ValueError, AttributeError):
        return False
    return LOADER in loaders


class WeightCalls(ControlPlane):
    """`WeightReceiver` over SGLang's HTTP control routes (a base class of `SGLangClient`)."""

    @property
    def engine_gpu_ids(self) -> list[list[int]] | None:
        """Per engine (`engine_urls` order), the GPU of each TP rank on its node, when known
        (`rollout.client.engine_gpu_ids`; launched engines: `engines.connect.sender_client`);
        None: unknown. Colocated pushes feed each engine rank from the trainer rank on that
        GPU (`weights.owners_home`)."""
        return self.config.engine_gpu_ids

    def one_engine(self, i: int) -> Self:
        """A client of the same kind over engine `i` alone, for weights (no router), sharing
        this one's pool (the engines rank 0 dropped or re-admits)."""
        gpus = self.config.engine_gpu_ids
        cfg = dataclasses.replace(
            self.config,
            engine_urls=[self.config.engine_urls[i]],
            engine_tp_sizes=[self.engine_tp_sizes()[i]],
            engine_gpu_ids=None if gpus is None else [gpus[i]],
            router_url=None,
        )
        one = type(self)(cfg)  # type: ignore[call-arg]  # SGLangClient(config)
        one.pool = self.pool
        return one

    def set_weight_version(self, weight_version: str) -> None:
        # abort_all_requests defaults to True in SGLang: a version stamp must not kill rollouts.
        body = {"new_version": str(weight_version), "abort_all_requests": False}
        self._control("/update_weight_version", body)

    def begin_weight_update(self) -> None:
        self._control("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self._control("/end_weight_update", {})

    def update_weights_from_tensor(
        self,
        named_tensors: Sequence[tuple[str, Sendable]],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        layout: EngineLayout | None = None,
    ) -> None:
        if layout is not None:
            self._update_weights_direct(
                named_tensors, layout, weight_version=weight_version, flush_cache=flush_cache
            )
            return
        # One flattened copy for all engines, one payload per TP rank of each engine (SGLang's
        # rank r reads entry r: an engine given fewer entries than ranks fails its update).
        bucket = proto.flatten_bucket(tensors_only(named_tensors))
        bodies = {
            url: {
                "serialized_named_tensors": proto.bucket_payloads(bucket, tp),
                "load_format": "flattened_bucket",
                "flush_cache": flush_cache,
                "weight_version": weight_version,
            }
            for url, tp in zip(self.config.engine_urls, self.engine_tp_sizes(), strict=True)
            if url in self.pool.require_targets()
        }
        # The payloads are handles onto `bucket`'s memory: keep it alive until every engine
        # answered (result() below), as SGLang requires.
        self._in_thread("/update_weights_from_tensor", bodies).result()
        del bucket

    def _update_weights_direct(
        self,
        named_tensors: Sequence[tuple[str, Sendable]],
        layout: EngineLayout,
        *,
        weight_version: str | None,
        flush_cache: bool,
    ) -> None:
        """SGLang-named whole tensors, each engine rank sent its own part
        (`load_format="direct"`: the engine copies each into the parameter of that name)."""
        targets = self.pool.require_targets()
        by_tp: dict[int, list[str]] = {}
        for url, tp in zip(self.config.engine_urls, self.engine_tp_sizes(), strict=True):
            if url in targets:
                by_tp.setdefault(tp, []).append(url)
        # Host payload buffers reused across calls, per TP size (this call waits for every
        # engine's answer before returning, so the next call may overwrite them).
        held: dict[int, dict[int, torch.Tensor]] = self.__dict__.setdefault("_direct_bufs", {})
        keep, bodies = [], {}
        for tp, urls in by_tp.items():
            lay = engine_layout(layout, tp)
            # Each rank's buffer is written once, straight from the sender's tensors, and
            # shared by the engines of this TP size (each its own serialisation of it).
            per_rank = [rank_pieces(named_tensors, r, lay) for r in range(tp)]
            payloads, bufs = proto.direct_payloads_for_engines(
                per_rank, len(urls), held.setdefault(tp, {})
            )
            keep.append(bufs)
            # Expert slices (several senders per engine rank) need our loader; else SGLang's.
            sliced = any(is_slice_name(p.name) for pieces in per_rank for p in pieces)
            for url, payload in zip(urls, payloads, strict=True):
                bodies[url] = {
                    "serialized_named_tensors": payload,
                    "load_format": LOADER if sliced else "direct",
                    "flush_cache": flush_cache,
                    "weight_version": weight_version,
                }
        # The payloads are handles onto the buffers: kept until every engine answered.
        self._in_thread("/update_weights_from_tensor", bodies).result()
        del keep

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> Future[None]:
        world = 1 + sum(self.engine_tp_sizes())
        offsets = itertools.accumulate([1] + self.engine_tp_sizes()[:-1])
        bodies = {
            url: {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": off,
                "world_size": world,
                "group_name": group_name,
                "backend": backend,
            }
            for url, off in zip(self.config.engine_urls, offsets)
        }
        return self._in_thread("/init_weights_update_group", bodies)

    def engine_hosts(self) -> list[str]:
        """Host names of the engines' servers (from `engine_urls`)."""
        hosts = (urllib.parse.urlsplit(u).hostname for u in self.config.engine_urls)
        return [h for h in hosts if h]

    def engine_tp_sizes(self) -> list[int]:
        """TP size of each engine (`rollout.client.engine_tp_sizes`), in `engine_urls` order."""
        return list(self.config.engine_tp_sizes or [1] * len(self.config.engine_urls))

    def takes_expert_slices(self) -> bool:
        """Whether every engine loads expert slices: its `/server_info` lists our loader in
        `custom_weight_loader` (`engines.sglang_loader`; the launcher passes it). Asked once
        per engine URL."""
        known: dict[str, bool] = self.__dict__.setdefault("_slices", {})
        live = self.pool.control_targets()  # a dropped engine gets no push: not asked
        urls = [u for u in live if u not in known]
        if urls:
            # Not `_control`: an engine without the route (another server, an older SGLang)
            # takes whole parameters, it is not a failed engine; one that did not answer is
            # asked again next push.
            got = asyncio.run(self._acall("/server_info", dict.fromkeys(urls), method="GET"))
            for url, (status, raw) in got.items():
                if status < 500:
                    known[url] = status == 200 and _lists_our_loader(raw)
        return bool(live) and all(known.get(u, False) for u in live)

    def weight_update_session(
        self, weight_version: str | None = None
    ) -> AbstractContextManager[None]:
        """`protocols.weight_update_session` on this client (a context manager)."""
        return weight_update_session(cast(WeightReceiver, self), weight_version)  # SGLangClient

    @property
    def weight_update_world_size(self) -> int:
        """World size of the weight-update group (trainer + every engine rank)."""
        return 1 + sum(self.engine_tp_sizes())

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype | str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        flattened_bucket: bool = True,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> Future[None]:
        body = {
            "names": list(names),
            "dtypes": [proto.dtype_name(d) for d in dtypes],
            "shapes": [list(map(int, s)) for s in shapes],
            "group_name": group_name,
            "load_format": "flattened_bucket" if flattened_bucket else None,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        return self._in_thread(
            "/update_weights_from_distributed", {u: body for u in self.config.engine_urls}
        )

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._control("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_disk(self, path: str, *, weight_version: str | None = None) -> None:
        body = {"model_path": str(path), "weight_version": weight_version}
        self._control("/update_weights_from_disk", body)

    def weight_version(self) -> dict[str, str]:
        res = self._control("/model_info", method="GET", retries=2)
        return {u: json.loads(raw)["weight_version"] for u, (_, raw) in res.items()}

    def model_paths(self) -> dict[str, str]:
        """Each engine's `model_path` (its `/model_info`): what it was started from."""
        res = self._control("/model_info", method="GET", retries=2)
        return {u: str(json.loads(raw).get("model_path")) for u, (_, raw) in res.items()}

    def weights_checksum(self) -> dict[str, dict[str, Any]]:
        res = self._control("/weights_checker", {"action": "checksum"})
        return {u: json.loads(raw) for u, (_, raw) in res.items()}

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> dict[str, Any]:
        """SGLang's `/get_weights_by_name` on every engine (fp32 nested lists, truncated)."""
        body = {"name": name, "truncate_size": truncate_size}
        res = self._control("/get_weights_by_name", body)
        return {u: json.loads(raw) for u, (_, raw) in res.items()}
