"""Expert tensors gathered to EP rank 0 in batches: one collective per batch, not per tensor.

megatron-bridge's export gathers each expert tensor over the expert-parallel group on its own
(`MegatronParamMapping.gather_from_ep_ranks`): for Qwen3-235B-A22B that is ~36k expert tensors,
so ~36k serial collectives per sync, each far too small to use the link. Inside
`patches.bridge.ep_local_experts()` the bridge does no EP collective and every EP rank yields
its OWN experts (the same slot of every layer, in the same order on every EP rank, since their
conversion tasks are built from identically shaped local parameters). `batched_expert_gather`
collects those, and when a batch holds `batch_bytes` (the same point on every EP rank: equal
shapes, equal order), flattens it into one uint8 buffer and does ONE `gather` to EP rank 0,
which slices every rank's buffer back into tensors (views, no extra copy) and yields them in
the order the bridge would have (per slot: EP rank 0's expert, then rank 1's, ...).

The bytes are the bytes the per-tensor path moves, so what reaches the sender is bitwise the
same (tests/weights/test_sync.py compares against the bridge's own export). Everything else the
bridge does per tensor is unchanged: TP gathers (attention / dense weights, expert TP) and PP
broadcasts still run one per tensor inside the bridge.

Memory: each EP rank holds one batch of its own experts (references, then one flat copy) of
`batch_bytes / EP`; EP rank 0 receives `batch_bytes` (the sender's bucket size).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed import ProcessGroup


def _gather(
    batch: list[tuple[str, torch.Tensor, list[str]]], group: ProcessGroup
) -> Iterator[tuple[str, torch.Tensor]]:
    dist = torch.distributed
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t, _ in batch])
    dst = dist.get_global_rank(group, 0)
    if dist.get_rank(group) != 0:
        dist.gather(flat, None, dst=dst, group=group)
        return
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.gather(flat, parts, dst=dst, group=group)
    offset = 0
    for _, t, names in batch:
        n = t.numel() * t.element_size()
        for name, part in zip(names, parts, strict=True):
            yield name, part[offset : offset + n].view(t.dtype).view(t.shape)
        offset += n


def batched_expert_gather(
    tensors: Iterator[tuple[str, torch.Tensor]],
    local: dict[str, tuple[list[str], ProcessGroup]],
    *,
    batch_bytes: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass non-expert tensors through; gather the expert tensors the bridge yields under
    `ep_local_experts()` (`local`: name -> (the slot's names on every EP rank, EP group)) to EP
    rank 0 one batch at a time, a batch being what makes EP rank 0 receive `batch_bytes`.
    Collective over every EP group: every rank must exhaust it."""
    batch: list[tuple[str, torch.Tensor, list[str]]] = []
    group: ProcessGroup | None = None
    nbytes = 0
    for name, tensor in tensors:
        entry = local.pop(name, None)
        if entry is None:
            yield name, tensor
            continue
        names, group = entry
        batch.append((name, tensor, names))
        nbytes += tensor.numel() * tensor.element_size()
        if nbytes * len(names) >= batch_bytes:  # EP rank 0 receives len(names) x nbytes
            yield from _gather(batch, group)
            batch, nbytes = [], 0
    if batch:
        assert group is not None  # set with the batch's first entry
        yield from _gather(batch, group)
    if local:  # an export hook renamed an expert: it would have reached the sender incomplete
        raise RuntimeError(
            f"experts {sorted(local)[:3]} were exported under other names; set "
            "weights.batch_expert_gathers=false for this model"
        )
