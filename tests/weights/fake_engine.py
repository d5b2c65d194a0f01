"""An in-process `RolloutEngine` that only receives weights, decoding them as SGLang does.

* tensor: the bucket goes through the rollout package's SGLang payload path
  (`FlattenedTensorBucket` + `MultiprocessingSerializer`, one payload per TP rank) and is
  decoded with SGLang's allow-list unpickler, exactly as the server's `update_weights_from_tensor`;
* distributed: a receiver PROCESS joins the group with SGLang's own `init_custom_process_group`
  and receives each bucket into `FlattenedTensorBucket.empty(names, dtypes, shapes)`, as
  SGLang's `WeightUpdater` does, then ships the tensors back to this object;
* disk: reads the safetensors directory it is pointed at.

It stores what arrived under the HF names, answers `weights_checksum()` from those tensors and
can corrupt one of them (a flipped value) to prove that the integrity check catches it.
"""

from __future__ import annotations

import io
import multiprocessing as mp
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.engines.protocols import weight_update_session
from megatron_gspo.engines.weight_layout import engine_layout, rank_pieces, unfuse_all
from megatron_gspo.engines.wire import (
    deserialize_named_tensors,
    direct_payloads_from_pieces,
    overall_checksum,
    serialize_flattened_bucket,
    tensor_checksum,
)


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _receiver_main(conn: Any, addr: str, port: int, world: int, rank: int, group: str) -> None:
    """SGLang's side of `/init_weights_update_group` + `/update_weights_from_distributed`."""
    torch.set_num_threads(1)
    from sglang.srt.utils import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    pg = init_custom_process_group(
        backend="gloo",
        init_method=f"tcp://{addr}:{port}",
        world_size=world,
        rank=rank,
        group_name=group,
    )
    conn.send("joined")
    while (msg := conn.recv()) is not None:
        names, dtypes, shapes = msg
        bucket = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
        torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
        conn.send_bytes(_dumps([(n, t.clone()) for n, t in bucket.reconstruct_tensors()]))
    torch.distributed.destroy_process_group(pg)


class FakeEngine:
    """A `WeightReceiver` in full: receives weights by every transport; see the module
    docstring."""

    def __init__(self, engine_id: str = "fake0", *, tp_size: int = 2) -> None:
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.state: dict[str, torch.Tensor] = {}
        self.version = "0"
        self.in_session = False
        self.calls: list[str] = []
        self.direct_calls = 0  # update_weights_from_tensor calls in SGLang's own layout
        self.slices = False  # loads expert slices (`takes_expert_slices`), as our loader does
        self.disk_config: dict | None = None
        self.corrupt_name: str | None = None
        self._pool = ThreadPoolExecutor(1)
        self._conn: Any = None
        self._proc: Any = None

    weight_update_world_size = 2  # the trainer + one receiver process

    # ---- helpers ------------------------------------------------------------------------
    def _store(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, t in tensors:
            t = t.clone()
            if name == self.corrupt_name:
                t.view(-1)[t.numel() // 2] += 1  # a silent bit error on the receiving side
            self.state[name] = t

    def _set_version(self, version: str | None) -> None:
        if version is not None:
            self.version = version

    def _need_session(self, what: str) -> None:
        if not self.in_session:
            raise RuntimeError(f"{what} must run between begin_weight_update() and end")

    # ---- weights ------------------------------------------------------------------------
    def begin_weight_update(self) -> None:
        if self.in_session:
            raise RuntimeError("a weight update session is already open")
        self.in_session = True
        self.calls.append("begin")

    def end_weight_update(self) -> None:
        self.in_session = False
        self.calls.append("end")

    def update_weights_from_tensor(
        self, named_tensors, *, weight_version=None, flush_cache=True, layout=None
    ):
        self._need_session("update_weights_from_tensor")
        if layout is not None:  # SGLang's fused names, as one rank decodes them; held as HF
            pieces = rank_pieces(named_tensors, 0, engine_layout(layout, 1))
            payloads, _keep = direct_payloads_from_pieces([pieces])
            decoded = deserialize_named_tensors(payloads[0], "direct")
            self._store(list(unfuse_all(decoded, layout)))
            self._set_version(weight_version)
            self.calls.append("tensor")
            self.direct_calls += 1
            return
        payloads, _keep = serialize_flattened_bucket(list(named_tensors), tp_size=self.tp_size)
        decoded = [deserialize_named_tensors(p) for p in payloads]
        for other in decoded[1:]:  # every TP rank must decode the same bucket
            assert [n for n, _ in other] == [n for n, _ in decoded[0]]
        self._store(decoded[0])
        self._set_version(weight_version)
        self.calls.append("tensor")

    def init_weights_update_group(
        self, master_address, master_port, *, group_name="weight_update_group", backend="nccl"
    ) -> Future[None]:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_receiver_main,
            args=(child, master_address, master_port, self.weight_update_world_size, 1, group_name),
            daemon=True,
        )
        self._proc.start()

        def joined() -> None:
            if not self._conn.poll(300):
                raise TimeoutError("receiver did not join the weight update group")
            assert self._conn.recv() == "joined"

        return self._pool.submit(joined)

    def update_weights_from_distributed(
        self,
        names,
        dtypes,
        shapes,
        *,
        group_name="weight_update_group",
        flattened_bucket=True,
        weight_version=None,
        flush_cache=True,
    ) -> Future[None]:
        self._need_session("update_weights_from_distributed")
        assert flattened_bucket
        dtype_names = [str(d).removeprefix("torch.") for d in dtypes]
        self._conn.send((list(names), dtype_names, [list(s) for s in shapes]))

        def receive() -> None:
            tensors = torch.load(io.BytesIO(self._conn.recv_bytes()), weights_only=True)
            self._store(tensors)
            self._set_version(weight_version)
            self.calls.append("distributed")

        return self._pool.submit(receive)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        if self._conn is not None:
            self._conn.send(None)
            self._proc.join(60)
            self._conn = self._proc = None

    def update_weights_from_disk(self, path: str, *, weight_version: str | None = None) -> None:
        import json

        from megatron_gspo.testing.weights import load_hf_state

        self._store(load_hf_state(path).items())
        self.disk_config = json.loads((Path(path) / "config.json").read_text())
        self._set_version(weight_version)
        self.calls.append("disk")

    def set_weight_version(self, weight_version: str) -> None:
        self.version = weight_version
        self.calls.append("version")

    def weight_version(self) -> dict[str, str]:
        return {self.engine_id: self.version}

    def weights_checksum(self) -> dict[str, dict[str, Any]]:
        sums = {n: tensor_checksum(t) for n, t in self.state.items()}
        return {self.engine_id: {"checksums": sums, "per_engine_checksum": overall_checksum(sums)}}

    def engine_hosts(self) -> list[str]:
        return ["127.0.0.1"]

    def prepare_sync(self) -> list[str]:
        return []

    def takes_expert_slices(self) -> bool:
        return self.slices

    def engine_tp_sizes(self) -> list[int]:
        # It stores and hashes whole HF tensors (one checksum set), whatever `tp_size`
        # payloads it is sent.
        return [1]

    def commit_sync(self, weight_version: str) -> None:
        return None

    def weight_update_session(self, weight_version: str | None = None) -> Any:
        return weight_update_session(self, weight_version)
