"""How buckets reach the engines: tensor (colocated), distributed (a process group), disk.

Each transport runs on the sender rank only and talks to engines only through the
`WeightReceiver` interface; `WeightSync` drives `begin -> send* -> finish` once per sync.

* `tensor`: `engine.update_weights_from_tensor(bucket)` inside a weight-update session; the
  engine wraps each bucket in SGLang's `FlattenedTensorBucket` and `MultiprocessingSerializer`
  payload (shared memory on CPU, a CUDA IPC handle on GPU: same node only).
* `distributed`: the trainer is rank 0 of a separate process group per engine pool
  (`init_weights_update_group`), sized 1 + the sum of the pool's engine TP sizes, each engine's
  ranks at their own offset; the rendezvous is at `master_address:master_port` (default: the
  local address that routes to the engines, so engines on other nodes can join); per bucket it
  announces names/dtypes/shapes
  (`update_weights_from_distributed`, flattened-bucket format) and broadcasts ONE uint8 buffer
  laid out exactly like `FlattenedTensorBucket` (tensors' bytes concatenated in order).
  nccl on GPU, gloo on CPU.
* `disk`: a HF checkpoint directory per version (one safetensors shard per bucket, index,
  config.json with the FP8 `quantization_config` when quantised, tokenizer files), then
  `update_weights_from_disk(path)`; older versions beyond `keep` are deleted.
"""

from __future__ import annotations

import abc
import shutil
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_gspo import dist
from megatron_gspo.dist import free_port, routable_address
from megatron_gspo.engines.protocols import WeightReceiver
from megatron_gspo.engines.weight_group import flatten_for_broadcast
from megatron_gspo.engines.weight_layout import tensors_only
from megatron_gspo.engines.weight_shards import EngineLayout
from megatron_gspo.weights import hf_io
from megatron_gspo.weights.stream import Bucket

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Transport(abc.ABC):
    """One way of moving buckets to engines. Methods run on the sender rank only."""

    name: str = ""

    def __init__(self, engines: Sequence[WeightReceiver]) -> None:
        self.engines = list(engines)
        self.stamps_last_bucket = True
        """False for one of several senders (`weights.senders=owners`): its last bucket is not
        the push's, so it must not label the engine's weights (rank 0 stamps them after all)."""

    def setup(self) -> None:
        """One-time connection work (the distributed transport's process groups)."""
        return None

    @abc.abstractmethod
    def begin(self, version: str) -> None:
        """Start a sync that publishes `version`."""

    @abc.abstractmethod
    def send(self, bucket: Bucket, *, version: str, last: bool) -> None:
        """Deliver one bucket; `last` marks the final bucket of this sync."""

    @abc.abstractmethod
    def finish(self, version: str) -> None:
        """Make the new weights live on every engine."""

    def abort(self) -> None:
        """Best-effort cleanup after a failed sync (close open sessions)."""
        for engine in self.engines:
            try:
                engine.end_weight_update()
            except Exception:  # noqa: BLE001 - already failing; the first error is reported
                pass

    def close(self) -> None:
        """Release connections (groups, files)."""
        return None


def _end_session(engines: Sequence[WeightReceiver], version: str) -> None:
    # The version is stamped once per sync, after the last bucket: labelling a bucket would
    # advertise the new version on half-updated weights.
    for engine in engines:
        engine.end_weight_update()
        engine.set_weight_version(version)


class TensorTransport(Transport):
    """Colocated: hand tensors to the engine: HF-named flattened buckets, or, with `layout`
    (the model's `EngineLayout`), SGLang's own fused tensors cut per engine rank and loaded
    by name (`engines.weight_layout`, `load_format="direct"`)."""

    name = "tensor"

    def __init__(
        self, engines: Sequence[WeightReceiver], *, layout: EngineLayout | None = None
    ) -> None:
        super().__init__(engines)
        self.layout = layout

    def begin(self, version: str) -> None:
        for engine in self.engines:
            engine.begin_weight_update()

    def send(self, bucket: Bucket, *, version: str, last: bool) -> None:
        # `bucket` stays referenced here until every engine has answered (the client also
        # keeps its flattened copy until then): SGLang reads it through CUDA IPC handles.
        for engine in self.engines:
            # The prefix cache is flushed once, with the last bucket.
            if self.layout is None:
                engine.update_weights_from_tensor(
                    bucket.tensors, weight_version=None, flush_cache=last
                )
            else:
                engine.update_weights_from_tensor(
                    bucket.tensors, weight_version=None, flush_cache=last, layout=self.layout
                )
        # Confirmed by every engine: blocks the engines let go of return to the allocator and
        # the cache to the driver before the next bucket is built (weights/colocated.py).
        dist.release_device_memory()

    def finish(self, version: str) -> None:
        _end_session(self.engines, version)


def group_world_size(engine: WeightReceiver) -> int:
    """World size of an engine pool's weight-update group (trainer rank 0 + engine ranks)."""
    return int(engine.weight_update_world_size)


def engine_hosts(engine: WeightReceiver) -> list[str]:
    """Host names of an engine pool's servers (empty when it does not know them)."""
    return engine.engine_hosts()


class DistributedTransport(Transport):
    """Trainer rank 0 broadcasts flattened buckets on one process group per engine pool."""

    name = "distributed"

    def __init__(
        self,
        engines: Sequence[WeightReceiver],
        *,
        master_address: str | None = None,
        master_port: int = 0,
        group_name: str = "weight_update_group",
        backend: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(engines)
        self.master_address = master_address or routable_address(
            [h for e in self.engines for h in engine_hosts(e)]
        )
        self.master_port = master_port
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout_s = timeout_s
        self.group_names = [
            group_name if len(self.engines) == 1 else f"{group_name}_{i}"
            for i in range(len(self.engines))
        ]
        self.groups: list[Any] = []

    def setup(self) -> None:
        from megatron_gspo.engines.weight_group import init_weight_update_group

        if self.groups:
            return
        for i, (engine, group_name) in enumerate(zip(self.engines, self.group_names, strict=True)):
            port = self.master_port + i if self.master_port else free_port(self.master_address)
            world = group_world_size(engine)
            joined = engine.init_weights_update_group(
                self.master_address, port, group_name=group_name, backend=self.backend
            )
            # The engines connect while we join: both sides block in the rendezvous.
            try:
                pg = init_weight_update_group(
                    master_address=self.master_address,
                    master_port=port,
                    world_size=world,
                    rank=0,
                    group_name=group_name,
                    backend=self.backend,
                    timeout_s=self.timeout_s,
                )
            except Exception as e:
                # Say what the engines were told: the usual cause is an address they cannot
                # reach (weights.master_address) or a wrong group size (engine TP sizes).
                raise RuntimeError(
                    f"weight-update group {group_name!r} at {self.master_address}:{port} "
                    f"(world size {world}) did not form: {e}; engines: "
                    f"{self._engine_outcome(joined)}"
                ) from e
            joined.result(timeout=self.timeout_s)
            self.groups.append(pg)

    @staticmethod
    def _engine_outcome(joined: Future[None]) -> str:
        try:
            joined.result(timeout=2)  # short: an engine still dialling says so by timing out
        except TimeoutError:
            return "still joining (cannot reach the address, or fewer ranks than the size)"
        except Exception as e:  # noqa: BLE001 - only describing the failure
            return f"{type(e).__name__}: {e}"
        return "joined"

    def begin(self, version: str) -> None:
        for engine in self.engines:
            engine.begin_weight_update()

    def send(self, bucket: Bucket, *, version: str, last: bool) -> None:
        names = bucket.names
        dtypes = [t.dtype for _, t in bucket.tensors]
        shapes = [list(t.shape) for _, t in bucket.tensors]
        device = "cuda" if self.backend == "nccl" else "cpu"
        flat = flatten_for_broadcast(tensors_only(bucket.tensors)).to(device)
        for engine, pg, group_name in zip(self.engines, self.groups, self.group_names, strict=True):
            done = engine.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                group_name=group_name,
                flattened_bucket=True,
                weight_version=version if last and self.stamps_last_bucket else None,
                flush_cache=last,
            )
            torch.distributed.broadcast(flat, src=0, group=pg)
            done.result(timeout=self.timeout_s)

    def finish(self, version: str) -> None:
        _end_session(self.engines, version)

    def close(self) -> None:
        from megatron_gspo.engines.weight_group import destroy_weight_update_group

        for engine, pg, group_name in zip(
            self.engines, self.groups, self.group_names, strict=False
        ):
            engine.destroy_weights_update_group(group_name)
            destroy_weight_update_group(pg)
        self.groups = []


class DiskTransport(Transport):
    """Write a HF checkpoint per version and ask engines to reload it."""

    name = "disk"

    def __init__(
        self,
        engines: Sequence[WeightReceiver],
        *,
        root: str | Path,
        hf_config: PretrainedConfig | Mapping[str, Any],
        source_dir: str | Path | None = None,
        dtype: torch.dtype | None = None,
        quantization_config: dict | None = None,
        keep: int = 2,
    ) -> None:
        super().__init__(engines)
        self.root = Path(root)
        self.hf_config = hf_config
        self.source_dir = source_dir
        self.dtype = dtype
        self.quantization_config = quantization_config
        self.keep = keep
        self._writer: hf_io.ShardWriter | None = None
        self.written: list[Path] = []

    def path_for(self, version: str) -> Path:
        return self.root / f"weights-v{version}"

    def begin(self, version: str) -> None:
        path = self.path_for(version)
        if path.exists():
            shutil.rmtree(path)
        self._writer = hf_io.ShardWriter(path)

    def send(self, bucket: Bucket, *, version: str, last: bool) -> None:
        assert self._writer is not None, "begin() first"
        self._writer.write(tensors_only(bucket.tensors))

    def finish(self, version: str) -> None:
        assert self._writer is not None, "begin() first"
        self._writer.close()
        path = self._writer.out_dir
        hf_io.write_config(
            path, self.hf_config, dtype=self.dtype, quantization_config=self.quantization_config
        )
        hf_io.copy_side_files(self.source_dir, path)
        self._writer = None
        for engine in self.engines:
            engine.update_weights_from_disk(str(path), weight_version=version)
        self.written.append(path)
        while len(self.written) > self.keep:
            shutil.rmtree(self.written.pop(0), ignore_errors=True)

    def abort(self) -> None:
        self._writer = None  # no session to close; a half-written directory is overwritten
