"""Stream a (sharded) Megatron model as HF-named tensors in size-bounded buckets.

The gather engine is megatron-bridge's `AutoBridge.export_hf_weights`, which walks the model's
conversion tasks one HF tensor at a time and, for each, does the following on EVERY rank:

* tensor-parallel weights: an all-gather over the TP group (expert weights: over the expert-TP
  group), then the mapping's merge/split (e.g. Megatron's fused qkv -> q/k/v, fc1 -> gate/up);
* pipeline stages: a broadcast from the owning PP stage to all PP ranks (plus a small
  all_gather_object of the tensor spec, cached after the first tensor);
* experts: an all-gather over the EXPERT-PARALLEL group of the local expert slot, so every EP
  rank receives the same-slot expert of every other EP rank. **So experts are all-gathered to
  every rank, not sent from their EP owners.** It is one expert slot (EP tensors) at a time,
  never all experts at once, and DP replicas do the same work redundantly.

The result: every rank sees every full tensor once, transiently. Only the sender (global rank
0 by default) keeps them, in a bucket of at most `bucket_bytes`; the others drop each tensor
as soon as the bridge yields it, but must still iterate (the gathers are collectives). Peak
memory on the sender is one bucket plus one tensor (times EP while it is gathered), never a
full model copy. Sending experts straight from their owners (per-EP-rank senders) would need
the bridge's per-task mappings without its EP gather; that is left for later (see the report).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_gspo.weights import fp8

DEFAULT_BUCKET_BYTES = 512 * 1024**2


@dataclass(slots=True)
class Bucket:
    """HF-named tensors to send together (one flattened buffer on the wire)."""

    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0
    index: int = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
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
    fp8_tensors: int = 0
    fp8_worst_error_ratio: float = 0.0
    """max over blocks of |deq - x| / e4m3 bound (<= 1 by construction; checked if asked)."""


def is_sender(sender_rank: int = 0) -> bool:
    """Whether this process keeps and sends the exported tensors."""
    if not torch.distributed.is_initialized():
        return True
    return torch.distributed.get_rank() == sender_rank


def hf_tensors(
    bridge: Any, model: list[torch.nn.Module], *, cpu: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors, one at a time, on every rank (collective: all ranks iterate)."""
    for name, tensor in bridge.export_hf_weights(model, cpu=cpu, show_progress=False):
        yield name, tensor.detach()


def convert_for_send(
    name: str,
    tensor: torch.Tensor,
    *,
    dtype: torch.dtype | None,
    use_fp8: bool,
    fp8_check: bool,
    stats: StreamStats,
) -> list[tuple[str, torch.Tensor]]:
    """Cast to the rollout dtype, or quantise a decoder linear weight to block FP8 + scale."""
    if not use_fp8:
        return [(name, tensor if dtype is None else tensor.to(dtype))]
    if not fp8.is_quantised_name(name, tensor):
        return [(name, tensor.to(dtype or torch.bfloat16))]
    q, s = fp8.quantise_blockwise(tensor)
    stats.fp8_tensors += 1
    if fp8_check:
        worst = fp8.check_dequantised(name, tensor, q, s)
        stats.fp8_worst_error_ratio = max(stats.fp8_worst_error_ratio, worst)
    return [(name, q), (fp8.scale_name(name), s)]


def iter_buckets(
    tensors: Iterator[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    keep: bool = True,
    dtype: torch.dtype | None = None,
    use_fp8: bool = False,
    fp8_check: bool = False,
    stats: StreamStats | None = None,
    on_tensor: Callable[[str, torch.Tensor], None] | None = None,
) -> Iterator[Bucket]:
    """Group a tensor stream into buckets of at most `bucket_bytes` (one bigger tensor gets a
    bucket of its own). With `keep=False` (non-sender ranks) the stream is only drained.

    dtype: cast every tensor to this dtype before sending (None = as exported);
    use_fp8: decoder linear weights become e4m3 + `_scale_inv`, the rest `dtype` or bf16.
    on_tensor: called with every tensor as sent (e.g. to checksum it).
    """
    stats = stats if stats is not None else StreamStats()
    bucket = Bucket()
    for name, tensor in tensors:
        if not keep:
            continue
        stats.bytes_exported += tensor.numel() * tensor.element_size()
        for sent_name, sent in convert_for_send(
            name, tensor, dtype=dtype, use_fp8=use_fp8, fp8_check=fp8_check, stats=stats
        ):
            size = sent.numel() * sent.element_size()
            # SGLang's receiving `FlattenedTensorBucket.empty` rejects a tensor whose byte
            # offset is not a multiple of its itemsize (an odd-sized fp8 weight before an fp32
            # scale), so such a tensor opens a new bucket.
            misaligned = bucket.nbytes % sent.element_size() != 0
            if bucket.tensors and (bucket.nbytes + size > bucket_bytes or misaligned):
                stats.buckets += 1
                yield bucket
                bucket = Bucket(index=bucket.index + 1)
            bucket.add(sent_name, sent)
            stats.tensors += 1
            stats.bytes_sent += size
            if on_tensor is not None:
                on_tensor(sent_name, sent)
    if bucket.tensors:
        stats.buckets += 1
        yield bucket


def model_buckets(
    bridge: Any,
    model: list[torch.nn.Module],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    sender_rank: int = 0,
    cpu: bool = True,
    **kwargs: Any,
) -> Iterator[Bucket]:
    """`iter_buckets(hf_tensors(...))`: buckets on the sender rank, nothing elsewhere.

    Every rank must exhaust this iterator (the bridge's gathers are collectives).
    """
    keep = is_sender(sender_rank)
    yield from iter_buckets(
        hf_tensors(bridge, model, cpu=cpu), bucket_bytes=bucket_bytes, keep=keep, **kwargs
    )
