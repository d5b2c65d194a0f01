"""Double-buffered sending: the next bucket is exported while the current one is sent.

`SendPipeline` runs, on ONE worker thread and in bucket order, what the sender does with a
finished bucket: feed the integrity checksums
(`engines.weight_shards.EngineChecksums.add_bucket`: SGLang's own hash on the engines'
device, sha256 on the host for CPU engines, its Triton kernel on the GPU for CUDA ones) and
hand it to the transport. The caller's thread meanwhile runs the bridge's export of the next
bucket (its collectives must stay on the caller's thread: every rank issues them in the same
order). At most one bucket is in flight: `submit` first waits for
the previous one, so the sender holds the bucket being sent, the one `WeightSync` looks ahead
to (to flag the last bucket) and the one being filled, i.e. up to 3 x `weights.bucket_mb`.

Why a thread is enough: the transports spend their time in calls that release the GIL (HTTP
and the engine's answer, gloo / nccl broadcasts on the weight-update group, file writes,
hashlib's sha256 on large buffers), and the export in torch ops and collectives that do too.
The weight-update group is not a group the export uses, so its broadcasts never interleave
with the export's collectives.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megatron_gspo.engines.weight_layout import RankChecksums
from megatron_gspo.engines.weight_shards import EngineChecksums
from megatron_gspo.weights.stream import Bucket, StreamStats
from megatron_gspo.weights.transports import Transport


class SendPipeline:
    """Checksum + send buckets in order on a worker thread, one in flight (`overlap=True`), or
    inline on the caller's thread (`overlap=False`). The first error stops further sends and is
    kept in `error`; `close()` waits for the last send and adds the worker's phase seconds
    (checksum, send) to `stats`."""

    def __init__(
        self,
        transport: Transport,
        *,
        sums: EngineChecksums | RankChecksums | None,
        stats: StreamStats,
        overlap: bool = True,
    ) -> None:
        self.transport = transport
        self.sums = sums
        self.stats = stats
        self.error: BaseException | None = None
        self._seconds: dict[str, float] = {}
        self._pool = None
        if overlap:
            # The current CUDA device is per thread: the worker uses the caller's (a transport's
            # "cuda" buffers, the allocator release), not device 0.
            device = torch.cuda.current_device() if torch.cuda.is_available() else None

            def on_callers_device() -> None:
                if device is not None:
                    torch.cuda.set_device(device)

            self._pool = ThreadPoolExecutor(
                1, thread_name_prefix="weight-send", initializer=on_callers_device
            )
        self._inflight: Future[None] | None = None

    def _run(self, bucket: Bucket, version: str, last: bool) -> None:
        t0 = time.perf_counter()
        if self.sums is not None:
            self.sums.add_bucket(bucket.tensors)
        t1 = time.perf_counter()
        self.transport.send(bucket, version=version, last=last)
        t2 = time.perf_counter()
        self._seconds["checksum"] = self._seconds.get("checksum", 0.0) + t1 - t0
        self._seconds["send"] = self._seconds.get("send", 0.0) + t2 - t1

    def _wait(self) -> None:
        if self._inflight is None:
            return
        try:
            self._inflight.result()
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = self.error or e
        finally:
            self._inflight = None

    def submit(self, bucket: Bucket, *, version: str, last: bool) -> None:
        """Send `bucket` after the previous one has been sent (no-op once one failed)."""
        self._wait()
        if self.error is not None:
            return
        if self._pool is None:
            try:
                self._run(bucket, version, last)
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                self.error = e
            return
        self._inflight = self._pool.submit(self._run, bucket, version, last)

    def close(self) -> None:
        """Wait for the bucket in flight ("drain" seconds), stop the worker, report seconds."""
        t0 = time.perf_counter()
        self._wait()
        self.stats.add_seconds("drain", time.perf_counter() - t0)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for phase, sec in self._seconds.items():
            self.stats.add_seconds(phase, sec)
        self._seconds = {}
