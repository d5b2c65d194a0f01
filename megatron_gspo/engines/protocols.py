"""The `RolloutEngine` interface: what the trainer may ask of a rollout engine.

Other packages talk to this interface only; SGLang specifics stay in `sglang_client.py`.
Weight updates always happen inside a weight-update session (SGLang >= 0.5.23 rejects
tensor/distributed updates outside one), so the interface exposes the session as a context
manager:

    with engine.weight_update_session():
        engine.update_weights_from_tensor(named_tensors, weight_version="step-3")
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from megatron_gspo.engines.types import RolloutResult, SamplingParams


class EngineError(RuntimeError):
    """A rollout engine refused a request (HTTP 4xx) or stayed unreachable after retries."""

    def __init__(self, message: str, *, status: int | None = None, url: str | None = None):
        super().__init__(message)
        self.status = status
        self.url = url


class NoEnginesLeft(RuntimeError):
    """Every engine was dropped (dead, hung or answering garbage) and none came back.

    Raised only when no engine is left to generate or to receive weights; `train` checkpoints
    the last sound state and stops with this one-line message.
    """


class RolloutEngine(abc.ABC):
    """A pool of one or more inference engines serving one policy."""

    # ---- generation -------------------------------------------------------------------
    @abc.abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        n: int = 1,
    ) -> RolloutResult:
        """Generate `n` responses per prompt (token ids in, token ids + log-probs out).

        Every returned sample keeps its `prompt_index` and `sample_index`; samples come back
        sorted by (prompt_index, sample_index), exactly `len(prompts) * n` of them minus the
        ones rejected for inconsistent ids/log-probs (counted in `stats.num_rejected`).
        """

    # ---- weights ----------------------------------------------------------------------
    @abc.abstractmethod
    def begin_weight_update(self) -> None:
        """Open a weight-update session on every engine."""

    @abc.abstractmethod
    def end_weight_update(self) -> None:
        """Close the session on every engine (runs post-load processing, e.g. FP8 repack)."""

    @contextlib.contextmanager
    def weight_update_session(self, weight_version: str | None = None) -> Iterator[None]:
        """`begin_weight_update` ... `end_weight_update`, closing the session on errors too.

        With `weight_version`, every engine reports that version once the session closed
        cleanly (one version per sync, however many buckets it took).
        """
        self.begin_weight_update()
        try:
            yield
        finally:
            self.end_weight_update()
        if weight_version is not None:
            self.set_weight_version(weight_version)

    @abc.abstractmethod
    def set_weight_version(self, weight_version: str) -> None:
        """Set the version every engine stamps on its responses (no request is aborted)."""

    @abc.abstractmethod
    def update_weights_from_tensor(
        self,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """Push HF-named tensors to every engine (one flattened bucket; same node only).

        `weight_version=None` leaves the version alone (set it per session instead).
        """

    @abc.abstractmethod
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> Future[None]:
        """Ask every engine to join a process group where the trainer is rank 0.

        Returns a future: the trainer must join the same group (world size
        `1 + total_engine_ranks`) while the engines connect, then wait on it.
        """

    @abc.abstractmethod
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
        """Announce a broadcast; the caller broadcasts on the group, then waits on the future.

        With `flattened_bucket`, the caller broadcasts ONE uint8 buffer, the bytes of SGLang's
        `FlattenedTensorBucket(named_tensors)` (`dist_group.flatten_for_broadcast` builds it
        without SGLang); otherwise one broadcast per tensor, in `names` order.
        """

    @abc.abstractmethod
    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Leave the weight-update process group on every engine."""

    @abc.abstractmethod
    def update_weights_from_disk(self, path: str, *, weight_version: str | None = None) -> None:
        """Reload weights from a HF checkpoint directory on every engine."""

    @abc.abstractmethod
    def weight_version(self) -> dict[str, str]:
        """The current weight version of every engine, keyed by engine id."""

    @abc.abstractmethod
    def weights_checksum(self) -> dict[str, dict[str, Any]]:
        """Per-engine weight checksums (`per_engine_checksum` and per-tensor `checksums`)."""

    def prepare_sync(self) -> None:
        """Before a weight sync (sender only): engines that were dropped and answer again join
        this sync; they receive the full weights and serve only after `commit_sync`."""
        return None

    def commit_sync(self, weight_version: str) -> None:
        """After a sync that was verified on every engine: engines that joined it serve again."""
        return None

    # ---- memory, cache, scheduling ---------------------------------------------------
    @abc.abstractmethod
    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory (`weights`, `kv_cache`, `cuda_graph`; None = all) when colocated."""

    @abc.abstractmethod
    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what `release_memory` freed."""

    @abc.abstractmethod
    def flush_cache(self) -> None:
        """Drop the prefix (radix) cache; fails while requests are running."""

    @abc.abstractmethod
    def pause_generation(self, mode: str = "abort") -> None:
        """Pause: `abort` running requests, `retract` them, or freeze them `in_place`."""

    @abc.abstractmethod
    def continue_generation(self) -> None:
        """Resume after `pause_generation`."""

    @abc.abstractmethod
    def abort(self, rid: str | None = None) -> None:
        """Abort one request id, or every request when `rid` is None."""

    @abc.abstractmethod
    def health(self) -> dict[str, bool]:
        """Whether each engine answers `/health_generate`, keyed by engine id."""
