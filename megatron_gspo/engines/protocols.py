"""What the rest of the package may ask of rollout engines: small protocols.

* `Sampler` (evaluation, multi-turn episodes, the agent endpoint): `agenerate` only.
* `Generator` (the scheduler): a `Sampler` whose requests the caller can abort; pause and
  continue generation around a weight push.
* `WeightReceiver` (`weights/`): weight-update sessions, the three transports' calls, versions
  and checksums for verification.
* `MemoryControl` (the colocated loop in `train.py`): release and resume engine memory.

`RolloutEngine` is all three plus the blocking `generate` and `health`; `engines.client.
SGLangClient` implements it over SGLang's HTTP API. Other packages depend on the smallest
protocol they use; SGLang specifics stay in this package. Weight updates always happen inside a
weight-update session (SGLang >= 0.5.23 rejects tensor/distributed updates outside one):

    with engine.weight_update_session(weight_version="3"):
        engine.update_weights_from_tensor(named_tensors)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from megatron_gspo.engines.types import RolloutResult, SamplingParams

if TYPE_CHECKING:  # annotations only: the engines' API loads without torch (the planner)
    import torch

    from megatron_gspo.engines.weight_layout import Sendable
    from megatron_gspo.engines.weight_shards import EngineLayout


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


@runtime_checkable
class Sampler(Protocol):
    """Token-in/token-out generation over one or more engines, nothing else (what evaluation,
    multi-turn episodes and the agent endpoint use)."""

    async def agenerate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        n: int = 1,
        rid_prefix: str | None = None,
    ) -> RolloutResult:
        """Generate `n` responses per prompt (token ids in, token ids + log-probs out).

        Every returned sample keeps its `prompt_index` and `sample_index`; samples come back
        sorted by (prompt_index, sample_index), exactly `len(prompts) * n` of them minus the
        ones rejected for inconsistent ids/log-probs (counted in `stats.num_rejected`).
        Request ids are `{rid_prefix}-p{i}-s{j}`, so a caller that names the prefix can
        `abort` exactly its own requests.
        """
        ...


@runtime_checkable
class Generator(Sampler, Protocol):
    """A `Sampler` whose requests the caller can abort, paused around a weight push (what the
    scheduler uses)."""

    def abort(self, rid: str | None = None) -> None:
        """Abort one request id, or every request when `rid` is None."""
        ...

    async def aabort(self, rids: Sequence[str]) -> None:
        """Abort `rids` together, each with every request it became (a re-sent request's rid
        is its original's plus a suffix), on the engines that run them; never drops an engine."""
        ...

    def pause_generation(self, mode: str = "abort") -> None:
        """Pause: `abort` running requests, `retract` them, or freeze them `in_place`."""
        ...

    def continue_generation(self) -> None:
        """Resume after `pause_generation`."""
        ...


@runtime_checkable
class WeightReceiver(Protocol):
    """Engines that receive the trainer's weights (what `weights/` uses)."""

    @property
    def weight_update_world_size(self) -> int:
        """World size of the weight-update group: trainer rank 0 + every engine rank."""
        ...

    def engine_hosts(self) -> list[str]:
        """Host names of the engines' servers (empty when unknown)."""
        ...

    def begin_weight_update(self) -> None:
        """Open a weight-update session on every engine."""
        ...

    def end_weight_update(self) -> None:
        """Close the session on every engine (runs post-load processing, e.g. FP8 repack)."""
        ...

    def set_weight_version(self, weight_version: str) -> None:
        """Set the version every engine stamps on its responses (no request is aborted)."""
        ...

    def update_weights_from_tensor(
        self,
        named_tensors: Sequence[tuple[str, Sendable]],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        layout: EngineLayout | None = None,
    ) -> None:
        """Push tensors to every engine (same node only). Without `layout`: HF-named tensors
        in one flattened bucket, mapped by the engine's `load_weights`. With `layout` (an
        `engines.weight_shards.EngineLayout` of the model): SGLang's fused parameters, whole
        tensors or their members (`engines.weight_layout.FusedParts`), each engine rank sent
        its own part, loaded by name (`load_format="direct"`).

        `weight_version=None` leaves the version alone (set it per session instead).
        """
        ...

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> Future[None]:
        """Ask every engine to join a process group where the trainer is rank 0.

        Returns a future: the trainer must join the same group (`weight_update_world_size`)
        while the engines connect, then wait on it.
        """
        ...

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
        `FlattenedTensorBucket(named_tensors)` (`engines.weight_group.flatten_for_broadcast`
        builds it without SGLang); otherwise one broadcast per tensor, in `names` order.
        """
        ...

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Leave the weight-update process group on every engine."""
        ...

    def update_weights_from_disk(self, path: str, *, weight_version: str | None = None) -> None:
        """Reload weights from a HF checkpoint directory on every engine."""
        ...

    def weight_version(self) -> dict[str, str]:
        """The current weight version of every engine, keyed by engine id."""
        ...

    def weights_checksum(self) -> dict[str, dict[str, Any]]:
        """Per-engine weight checksums (`per_engine_checksum` and per-tensor `checksums`)."""
        ...

    def prepare_sync(self) -> list[str]:
        """Before a weight sync (sender only): engines that were dropped and answer again join
        this sync; they receive the full weights and serve only after `commit_sync`. Returns
        the ids of every engine still joining (this sync must be verified for them)."""
        ...

    def commit_sync(self, weight_version: str) -> None:
        """After a sync that was verified on every engine: engines that joined it serve again."""
        ...

    def takes_expert_slices(self) -> bool:
        """Whether every engine loads one stacked expert parameter in slices from several
        senders (`<param>@experts=<i>`: SGLang started with our `--custom-weight-loader`,
        `engines.sglang_loader`); False: whole parameters only (`load_format="direct"`)."""
        ...

    def engine_tp_sizes(self) -> list[int]:
        """TP size of each engine, in engine order: over how many ranks each reports its
        checksums (SGLang's `/weights_checker`: one entry per TP rank); 1 for an engine that
        reports whole HF tensors."""
        ...


@runtime_checkable
class MemoryControl(Protocol):
    """Engines colocated with the trainer give their accelerator memory back between rollouts."""

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory (`weights`, `kv_cache`, `cuda_graph`; None = all) when colocated."""
        ...

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what `release_memory` freed."""
        ...

    def flush_cache(self) -> None:
        """Drop the prefix (radix) cache; fails while requests are running."""
        ...


@contextlib.contextmanager
def weight_update_session(
    engine: WeightReceiver, weight_version: str | None = None
) -> Iterator[None]:
    """`begin_weight_update` ... `end_weight_update`, closing the session on errors too.

    With `weight_version`, every engine reports that version once the session closed
    cleanly (one version per sync, however many buckets it took).
    """
    engine.begin_weight_update()
    try:
        yield
    finally:
        engine.end_weight_update()
    if weight_version is not None:
        engine.set_weight_version(weight_version)


@runtime_checkable
class RolloutEngine(Generator, WeightReceiver, MemoryControl, Protocol):
    """A pool of one or more inference engines serving one policy: every protocol above, plus
    blocking generation and health probes (the HTTP client implements it)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        n: int = 1,
    ) -> RolloutResult:
        """`agenerate`, blocking."""
        ...

    def health(self) -> dict[str, bool]:
        """Whether each engine answers `/health_generate`, keyed by engine id."""
        ...
