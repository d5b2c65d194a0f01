"""Pack RL sequences into THD micro-batches for megatron-core, split over DP and CP ranks.

Shape legend: `S` sequences in a micro-batch, `T` packed token positions on this CP shard,
`L` one sequence's length padded to the layout's multiple.

A sequence is prompt + response tokens. Position j of the packed input predicts token j+1, so
the per-token training tensors (labels, pi_old log-probs, mask) live at positions
P-1 .. P+R-2 of a sequence with P prompt and R response tokens; everything else is masked.
Sequences are padded (inside their own cu_seqlens span) to a multiple of 2*cp (zig-zag CP
chunks) times tp (sequence parallelism splits the packed tokens over TP ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megatron_gspo.algo.sequences import TrainSequence

PAD_ID = 0

__all__ = ["PAD_ID", "TrainSequence"]


@dataclass(kw_only=True)
class PackedMicroBatch:
    """One THD micro-batch as seen by one CP shard. Built on the host by `pack`; the training
    code receives it on the job's device (`megatron.step.plan_for_this_rank` calls `.to`)."""

    input_ids: Tensor  # [1, T]
    position_ids: Tensor  # [1, T]
    labels: Tensor  # [T] next-token ids (PAD_ID where masked)
    old_logp: Tensor  # [T]
    rollout_logp: Tensor | None  # [T]
    ref_logp: Tensor | None  # [T] reference-model log-probs (KL), or None
    trainer_old_logp: Tensor | None  # [T] trainer's at the rollout weights (mismatch masks)
    mask: Tensor  # [T] float 0/1
    valid: Tensor  # [T] bool, a real token (prompt or response), not padding
    seq_index: Tensor  # [T] long, 0..S-1
    token_pos: Tensor  # [T] long, index of the predicted response token (-1 where masked)
    advantages: Tensor  # [S] or [T] (per-token)
    advantages_per_token: bool
    seq_ids: list[int]  # [S] global sequence ids (-1 for a padding micro-batch)
    cu_seqlens: Tensor  # [S+1] int32 over the full padded sequences
    max_seqlen: int
    routed_experts: Tensor | None = None
    """[T, L, K] long: the engine's expert ids per packed position (`rl.routing_replay`), -1
    where the engine routed nothing (last token of a sequence, padding); None: no replay."""
    num_seqs: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_seqs = len(self.seq_ids)

    def to(self, device: torch.device | str) -> PackedMicroBatch:
        """Every tensor field on `device` (in place; returns self for chaining)."""
        for name, value in vars(self).items():
            if isinstance(value, Tensor):
                setattr(self, name, value.to(device))
        return self

    def packed_seq_params(self, cp_group: object | None = None) -> object:
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens,
            cu_seqlens_kv_padded=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
            cp_group=cp_group,
        )


def pad_multiple(tp: int, cp: int, sequence_parallel: bool) -> int:
    return (2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1)


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _as(values: Sequence[int] | Sequence[float] | Tensor, dtype: torch.dtype) -> Tensor:
    """A field as a `dtype` tensor: lists (rank 0's rollout) or tensor views (what the other
    ranks receive, megatron/transfer.py) give the same values."""
    if isinstance(values, Tensor):
        return values.to(dtype)
    return torch.tensor(list(values), dtype=dtype)


def pack(
    seqs: Sequence[TrainSequence], *, multiple: int, cp_size: int = 1, cp_rank: int = 0
) -> PackedMicroBatch:
    """Pack `seqs` into one THD micro-batch and keep this CP rank's zig-zag shard."""
    # Imported here: megatron-core (via cpu_attention) costs seconds, and ranks that only
    # receive or build `TrainSequence`s (megatron/transfer.py) need none of it.
    from megatron_gspo.megatron.cpu_attention import zigzag_indices

    if not seqs:  # a padding micro-batch: one fully masked sequence, contributes nothing
        seqs = [
            TrainSequence(
                seq_id=-1, prompt_ids=[PAD_ID], response_ids=[], old_logp=[], advantage=0.0
            )
        ]
    per_token_adv = not isinstance(seqs[0].advantage, float | int)
    cols: dict[str, list[Tensor]] = {
        k: [] for k in "ids pos labels old roll ref trn mask valid sidx tpos adv routes".split()
    }
    replay = any(s.routed_experts is not None for s in seqs)
    lengths = []
    for i, s in enumerate(seqs):
        p, r = len(s.prompt_ids), len(s.response_ids)
        n = _padded(s.length, multiple)
        lengths.append(n)
        ids = torch.full((n,), PAD_ID, dtype=torch.long)
        ids[:p] = _as(s.prompt_ids, torch.long)
        ids[p : s.length] = _as(s.response_ids, torch.long)
        labels = torch.full((n,), PAD_ID, dtype=torch.long)
        labels[: s.length - 1] = ids[1 : s.length]
        span = slice(p - 1, p - 1 + r)  # positions that predict the response tokens
        old, roll, ref, trn, mask, adv = (torch.zeros(n) for _ in range(6))
        tpos = torch.full((n,), -1, dtype=torch.long)
        old[span] = _as(s.old_logp, torch.float32)
        if s.rollout_logp is not None:
            roll[span] = _as(s.rollout_logp, torch.float32)
        if s.ref_logp is not None:
            ref[span] = _as(s.ref_logp, torch.float32)
        if s.trainer_old_logp is not None:
            trn[span] = _as(s.trainer_old_logp, torch.float32)
        mask[span] = _as(s.loss_mask, torch.float32) if s.loss_mask is not None else 1.0
        tpos[span] = torch.arange(r)
        if per_token_adv:
            adv[span] = _as(s.advantage, torch.float32)  # type: ignore[arg-type]  # per token
        keep = zigzag_indices(n, cp_size, cp_rank)
        cols["ids"].append(ids[keep])
        cols["pos"].append(torch.arange(n)[keep])
        cols["labels"].append(labels[keep])
        cols["old"].append(old[keep])
        cols["roll"].append(roll[keep])
        cols["ref"].append(ref[keep])
        cols["trn"].append(trn[keep])
        cols["mask"].append(mask[keep])
        real = s.length if s.seq_id >= 0 else 0  # a padding micro-batch's token is not real
        cols["valid"].append((torch.arange(n) < real)[keep])
        cols["sidx"].append(torch.full((keep.numel(),), i, dtype=torch.long))
        cols["tpos"].append(tpos[keep])
        cols["adv"].append(adv[keep])
        if replay:
            cols["routes"].append(packed_routes(s, n)[keep])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    advantages = (
        torch.cat(cols["adv"])
        if per_token_adv
        else torch.tensor([float(s.advantage) for s in seqs], dtype=torch.float32)  # type: ignore[arg-type]
    )
    return PackedMicroBatch(
        input_ids=torch.cat(cols["ids"])[None],
        position_ids=torch.cat(cols["pos"])[None],
        labels=torch.cat(cols["labels"]),
        old_logp=torch.cat(cols["old"]),
        rollout_logp=torch.cat(cols["roll"]) if seqs[0].rollout_logp is not None else None,
        ref_logp=torch.cat(cols["ref"]) if seqs[0].ref_logp is not None else None,
        trainer_old_logp=torch.cat(cols["trn"]) if seqs[0].trainer_old_logp is not None else None,
        mask=torch.cat(cols["mask"]),
        valid=torch.cat(cols["valid"]),
        seq_index=torch.cat(cols["sidx"]),
        token_pos=torch.cat(cols["tpos"]),
        advantages=advantages,
        advantages_per_token=per_token_adv,
        seq_ids=[s.seq_id for s in seqs],
        cu_seqlens=cu,
        max_seqlen=max(lengths),
        routed_experts=torch.cat(cols["routes"]) if replay else None,
    )


def packed_routes(s: TrainSequence, n: int) -> Tensor:
    """`s.routed_experts` at the sequence's `n` padded positions ([n, L, K] long): row j is
    what the engine routed input token j to; -1 rows where it routed nothing."""
    routes = s.routed_experts
    if routes is None:
        raise ValueError(
            f"sequence {s.seq_id} has no routed_experts while others in its micro-batch do"
        )
    rows = torch.full((n, *routes.shape[1:]), -1, dtype=torch.long)
    rows[: len(routes)] = _as(routes, torch.long)
    return rows


def split_by_tokens(seqs: Sequence[TrainSequence], parts: int) -> list[list[TrainSequence]]:
    """Balance sequences over `parts` ranks by token count (longest first onto the lightest
    rank); each part keeps the original order. Deterministic."""
    load = [0] * parts
    owner: dict[int, int] = {}
    for idx in sorted(range(len(seqs)), key=lambda i: (-seqs[i].length, i)):
        r = min(range(parts), key=lambda p: (load[p], p))
        owner[idx] = r
        load[r] += seqs[idx].length
    return [[s for i, s in enumerate(seqs) if owner[i] == r] for r in range(parts)]


def group_by_budget(
    seqs: Sequence[TrainSequence], max_tokens: int, multiple: int = 1
) -> list[list[TrainSequence]]:
    """Consecutive sequences into micro-batches of at most `max_tokens` padded tokens
    (a longer sequence gets a micro-batch of its own)."""
    groups: list[list[TrainSequence]] = []
    used = 0
    for s in seqs:
        n = _padded(s.length, multiple)
        if not groups or used + n > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(s)
        used += n
    return groups


def plan_micro_batches(
    seqs: Sequence[TrainSequence],
    *,
    dp_size: int,
    dp_rank: int,
    max_tokens: int,
    multiple: int,
    cp_size: int = 1,
    cp_rank: int = 0,
    count_multiple: int = 1,
) -> list[PackedMicroBatch]:
    """This rank's packed micro-batches of a mini-batch that every rank knows whole.

    Every data-parallel rank gets the same NUMBER of micro-batches (expert-parallel all-to-alls
    and pipeline schedules need it), rounded up to a multiple of `count_multiple` (the
    interleaved pipeline schedule wants a multiple of the pipeline size): the missing ones are
    fully masked padding micro-batches, which add nothing to the loss or the gradients.
    """
    per_rank = [
        group_by_budget(part, max_tokens, multiple) for part in split_by_tokens(seqs, dp_size)
    ]
    n = max(1, max(len(g) for g in per_rank))
    n = -(-n // count_multiple) * count_multiple
    mine = per_rank[dp_rank] + [[]] * (n - len(per_rank[dp_rank]))
    return [pack(g, multiple=multiple, cp_size=cp_size, cp_rank=cp_rank) for g in mine]
