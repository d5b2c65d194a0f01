"""Stream a (sharded) Megatron model as HF-named tensors in size-bounded buckets.

The gather engine is megatron-bridge's `AutoBridge.export_hf_weights`, which walks the model's
conversion tasks one HF tensor at a time and, for each, runs on EVERY rank:

* tensor-parallel weights: an all-gather over the TP group (expert weights: over the expert-TP
  group), then the mapping's merge/split (e.g. Megatron's fused qkv -> q/k/v, fc1 -> gate/up);
  so TP ranks all receive the full tensor;
* pipeline stages: a broadcast from the owning PP stage to all PP ranks (plus a small
  all_gather_object of the tensor spec, cached after the first tensor);
* experts: the bridge all-gathers the local expert slot over the EXPERT-PARALLEL group, so
  every EP rank would receive every expert. With `experts_to_first=True` (the default here)
  that one step is replaced, for the duration of our export only, by a `gather` to EP rank 0
  of each EP group (`experts_to_ep_rank0`): expert tensors then travel only from their EP
  owners to the sender's EP group rank 0 (global rank 0 is rank 0 of every group it is in),
  and the other EP ranks never see other ranks' experts. One expert slot (EP tensors) is in
  flight at a time; DP replicas of the EP group repeat the gather towards their own EP rank 0
  (redundant work, not an extra copy to the sender).

Each rank sees each tensor it receives once, transiently. Only the sender (global rank 0)
keeps them, in a bucket of at most `bucket_bytes`; the others drop each tensor as soon as the
bridge yields it, but must still iterate (the gathers are collectives). Peak memory on the
sender is one bucket plus one tensor (times EP while its slot is gathered), never a full model
copy. Attention/dense/embedding weights are still all-gathered to every TP rank (the bridge's
TP gather); that is cheap next to the experts of a MoE model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from megatron_gspo.engines.weight_layout import FusedParts, Sendable, fused_stream
from megatron_gspo.weights import fp8

if TYPE_CHECKING:
    from megatron.bridge import AutoBridge

DEFAULT_BUCKET_BYTES = 512 * 1024**2


@dataclass(slots=True)
class Bucket:
    """HF-named tensors to send together (one flattened buffer on the wire)."""

    tensors: list[tuple[str, Sendable]] = field(default_factory=list)
    """Tensors, or in SGLang's layout fused parameters as their members (`FusedParts`)."""
    nbytes: int = 0
    index: int = 0

    def add(self, name: str, tensor: Sendable) -> None:
        self.tensors.append((name, tensor))
        self.nbytes += tensor.numel() * tensor.element_size()

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.tensors]


@dataclass(slots=True)
class StreamStats:
    """What one export pass produced on the sender."""

    tensors: int = 0
    buckets: int = 0
    bytes_sent: int = 0
    bytes_exported: int = 0
    tensors_seen: int = 0
    """Exported tensors this rank received (non-senders included: the gather traffic)."""
    direct_experts: int = 0
    """Of those, expert tensors taken straight from this rank's Megatron parameters, not
    walked by the bridge (`weights.grouped`, `weights.grouped_export`)."""
    fp8_tensors: int = 0
    fp8_worst_error_ratio: float = 0.0
    """max over blocks of |deq - x| / e4m3 bound (<= 1 by construction; checked if asked)."""
    error: str | None = None
    """Why the sender stopped converting (e.g. an FP8 bound violation naming the tensor)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall seconds per phase on this rank: export (waiting on the bridge: gathers, merges),
    convert (cast / quantise / FP8 bound check), and, filled by `WeightSync.push` on the
    sender, checksum and send (on the send thread, overlapping export), drain (waiting for
    the last send), finish, verify. Overlapped phases add up to more than the push's wall."""

    def add_seconds(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


def is_sender(sender_rank: int = 0) -> bool:
    """Whether this process keeps and sends the exported tensors."""
    if not torch.distributed.is_initialized():
        return True
    return torch.distributed.get_rank() == sender_rank


def experts_to_ep_rank0() -> contextlib.AbstractContextManager[None]:
    """While active, the bridge's expert export gathers to EP rank 0 instead of to all EP ranks.

    The registered patch `bridge-ep-gather-to-rank0` (megatron_gspo/patches/bridge.py) replaces
    `MegatronParamMapping.gather_from_ep_ranks` (megatron-bridge 0.6.2) with a method that, inside
    this scope, does a `torch.distributed.gather` returning the per-expert dict on EP rank 0 and
    `{}` elsewhere, and outside it calls the bridge's own all-gather.
    """
    from megatron_gspo.patches.bridge import ep_gather_to_rank0

    return ep_gather_to_rank0()


def hf_tensors(
    bridge: AutoBridge,
    model: list[torch.nn.Module],
    *,
    cpu: bool = True,
    experts_to_first: bool = True,
    show_progress: bool = False,
    expert_batch_bytes: int = 0,
    grouped: bool = False,
    stats: StreamStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors, one at a time (collective: all ranks iterate).

    experts_to_first: expert tensors reach EP rank 0 only (see `experts_to_ep_rank0`);
    False keeps the bridge's all-gather, so every rank sees every tensor.
    expert_batch_bytes: with experts_to_first, gather experts to EP rank 0 in batches of which
    it receives this many bytes, one collective per batch (`weights.ep_batch`); 0: one
    collective per expert tensor (the bridge's).
    grouped: with batched gathers, the experts straight from the Megatron parameters where
    `weights.grouped` allows (counted in `stats.direct_experts`), not from the bridge's walk.
    """
    if experts_to_first and expert_batch_bytes > 0:
        from megatron_gspo.patches.bridge import ep_local_experts
        from megatron_gspo.patches.cpu_runtime import without_cuda_mode
        from megatron_gspo.weights.ep_batch import batched_expert_gather
        from megatron_gspo.weights.grouped import local_export

        with ep_local_experts() as local:
            # The gathers run on the tensors' device (nccl needs device tensors); the host
            # copy, when asked for, comes after them.
            exported = local_export(
                bridge, model, local, grouped=grouped, stats=stats, show_progress=show_progress
            )
            pairs = ((n, t.detach()) for n, t in exported)
            gathered = batched_expert_gather(pairs, local, batch_bytes=expert_batch_bytes)
            # On the CPU runtime, the export runs without the mode that maps CUDA placements to
            # the CPU (it names no CUDA device; the mode costs ~10 us per torch call).
            for name, tensor in without_cuda_mode(gathered):
                yield name, tensor.cpu() if cpu else tensor
        return
    scope = experts_to_ep_rank0() if experts_to_first else contextlib.nullcontext()
    with scope:
        for name, tensor in bridge.export_hf_weights(model, cpu=cpu, show_progress=show_progress):
            yield name, tensor.detach()


def convert_for_send(
    name: str,
    tensor: Sendable,
    *,
    dtype: torch.dtype | None,
    use_fp8: bool,
    fp8_check: bool,
    stats: StreamStats,
    ratios: list[tuple[str, torch.Tensor]] | None = None,
) -> list[tuple[str, Sendable]]:
    """Cast to the rollout dtype, or quantise a decoder linear weight to block FP8 + scale.

    fp8_check: the worst e4m3 error ratio of the weight is appended to `ratios` as a 0-d
    device tensor (no host sync; `iter_buckets` reads a bucket's worth at once); without
    `ratios` it is checked here (one host read per weight).
    """
    if isinstance(tensor, FusedParts):  # SGLang's layout: cast while written to the payload
        if use_fp8:
            raise ValueError(f"{name}: SGLang's own layout is not sent as FP8")
        return [(name, tensor.cast(dtype))]
    if not use_fp8:
        return [(name, tensor if dtype is None else tensor.to(dtype))]
    if not fp8.is_quantised_name(name, tensor):
        return [(name, tensor.to(dtype or torch.bfloat16))]
    q, s = fp8.quantise_blockwise(tensor)
    stats.fp8_tensors += 1
    if fp8_check:
        ratio = (name, fp8.error_ratio_max(name, tensor, q, s))
        if ratios is None:
            worst = fp8.check_ratios([ratio])
            stats.fp8_worst_error_ratio = max(stats.fp8_worst_error_ratio, worst)
        else:
            ratios.append(ratio)
    return [(name, q), (fp8.scale_name(name), s)]


def _checked(ratios: list[tuple[str, torch.Tensor]], stats: StreamStats) -> bool:
    """Read the pending FP8 bound ratios once (one host sync per bucket); False and
    `stats.error` set when one is out of bound."""
    try:
        worst = fp8.check_ratios(ratios)
    except ValueError as e:
        stats.error = f"{type(e).__name__}: {e}"
        return False
    finally:
        ratios.clear()
    stats.fp8_worst_error_ratio = max(stats.fp8_worst_error_ratio, worst)
    return True


def iter_buckets(
    tensors: Iterator[tuple[str, Sendable]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    keep: bool = True,
    dtype: torch.dtype | None = None,
    use_fp8: bool = False,
    fp8_check: bool = False,
    stats: StreamStats | None = None,
    count_seen: bool = True,
) -> Iterator[Bucket]:
    """Group a tensor stream into buckets of at most `bucket_bytes` (one bigger tensor gets a
    bucket of its own). With `keep=False` (non-sender ranks) the stream is only drained.

    dtype: cast every tensor to this dtype before sending (None = as exported);
    use_fp8: decoder linear weights become e4m3 + `_scale_inv`, the rest `dtype` or bf16;
    fp8_check: the e4m3 bound of every quantised weight is computed on its device and read
    once per bucket, before the bucket is yielded (a bucket out of bound is never sent).
    count_seen: count the stream's tensors in `stats.tensors_seen` (False: counted upstream).
    """
    stats = stats if stats is not None else StreamStats()
    bucket = Bucket()
    ratios: list[tuple[str, torch.Tensor]] = []
    it = iter(tensors)
    while True:
        t0 = time.perf_counter()
        try:
            name, tensor = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        stats.add_seconds("export", t1 - t0)
        stats.tensors_seen += count_seen
        if not keep:
            continue
        stats.bytes_exported += tensor.numel() * tensor.element_size()
        try:
            converted = convert_for_send(
                name,
                tensor,
                dtype=dtype,
                use_fp8=use_fp8,
                fp8_check=fp8_check,
                stats=stats,
                ratios=ratios,
            )
        except Exception as e:  # noqa: BLE001 - recorded; the caller fails the step
            # Stop keeping but keep draining: the other ranks are inside the same collectives.
            stats.error = f"{type(e).__name__}: {e}"
            keep = False
            bucket = Bucket()
            continue
        stats.add_seconds("convert", time.perf_counter() - t1)
        for sent_name, sent in converted:
            size = sent.numel() * sent.element_size()
            # SGLang's receiving `FlattenedTensorBucket.empty` rejects a tensor whose byte
            # offset is not a multiple of its itemsize (an odd-sized fp8 weight before an fp32
            # scale), so such a tensor opens a new bucket.
            misaligned = bucket.nbytes % sent.element_size() != 0
            if bucket.tensors and (bucket.nbytes + size > bucket_bytes or misaligned):
                if not _checked(ratios, stats):
                    keep = False
                    bucket = Bucket()
                    break
                stats.buckets += 1
                yield bucket
                bucket = Bucket(index=bucket.index + 1)
            bucket.add(sent_name, sent)
            stats.tensors += 1
            stats.bytes_sent += size
    if keep and bucket.tensors and _checked(ratios, stats):
        stats.buckets += 1
        yield bucket


def _counted(
    tensors: Iterator[tuple[str, torch.Tensor]], stats: StreamStats
) -> Iterator[tuple[str, torch.Tensor]]:
    for item in tensors:
        stats.tensors_seen += 1
        yield item


def model_buckets(
    bridge: AutoBridge,
    model: list[torch.nn.Module],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    sender_rank: int = 0,
    cpu: bool = True,
    experts_to_first: bool = True,
    expert_batch_bytes: int = 0,
    layout: str = "hf",
    num_experts: int = 0,
    grouped: bool = False,
    **kwargs: Any,
) -> Iterator[Bucket]:
    """`iter_buckets(hf_tensors(...))`: buckets on the sender rank, nothing elsewhere.

    layout: "hf" (HF-named tensors) or "engine": SGLang's fused parameters, one item per fused
    parameter, its members unassembled (`engines.weight_layout.FusedParts`; `num_experts` per
    MoE layer lets a layer's stacked experts leave as soon as the last arrives); grouped: in
    that layout, the experts straight from the Megatron parameters (`hf_tensors`).
    Every rank must exhaust this iterator (the bridge's gathers are collectives).
    """
    if experts_to_first and sender_rank != 0:
        # Global rank 0 is rank 0 of every group it belongs to; another rank may not be.
        raise ValueError("experts_to_first needs sender_rank=0 (or experts_to_first=False)")
    keep = is_sender(sender_rank)
    exported = hf_tensors(
        bridge,
        model,
        cpu=cpu,
        experts_to_first=experts_to_first,
        expert_batch_bytes=expert_batch_bytes,
        grouped=grouped and layout == "engine",
        stats=kwargs.get("stats"),
    )
    tensors: Iterator[tuple[str, Sendable]] = exported
    if layout == "engine" and keep:  # the other ranks only drain the collectives
        if kwargs.get("stats") is None:
            kwargs["stats"] = StreamStats()
        # `tensors_seen` stays what the bridge exported to this rank (HF tensors), not the
        # fewer fused tensors. Lazy: a fused parameter stays its members until the transport
        # writes each engine rank's payload (one pass over the bytes, `weight_layout`).
        tensors = fused_stream(
            _counted(exported, kwargs["stats"]), num_experts=num_experts, lazy=True
        )
        kwargs["count_seen"] = False
    yield from iter_buckets(
        tensors,
        bucket_bytes=bucket_bytes,
        keep=keep,
        **kwargs,
    )
