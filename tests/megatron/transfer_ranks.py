"""Rank functions of tests/megatron/test_transfer.py (spawned: must be importable)."""

from __future__ import annotations

import random
from typing import Any

import torch

from megatron_gspo.algo.sequences import TrainSequence
from megatron_gspo.megatron.transfer import (
    broadcast_sequences,
    gather_logprob_rows,
    logprobs_by_sequence,
)


def random_sequences(n: int, seed: int, *, vocab: int = 151_936) -> list[TrainSequence]:
    """Sequences with every optional field both present and absent, per-sequence advantages."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(1, 9), rng.randint(0, 12)
        out.append(
            TrainSequence(
                seq_id=100 + i,
                prompt_ids=[rng.randrange(vocab) for _ in range(p)],
                response_ids=[rng.randrange(vocab) for _ in range(r)],
                old_logp=[-rng.expovariate(1.0) for _ in range(r)],
                advantage=rng.gauss(0.0, 1.0),
                loss_mask=[rng.randint(0, 1) for _ in range(r)] if i % 3 else None,
                rollout_logp=[-rng.random() for _ in range(r)] if i % 2 else None,
                ref_logp=[-rng.random() for _ in range(r)] if i % 4 else None,
                reward=rng.random() if i % 5 else None,
                group=i // 3 if i % 5 else None,
            )
        )
    return out


def as_lists(seqs: list[TrainSequence] | None) -> list[dict[str, Any]] | None:
    """Every field of every sequence as Python values (tensor fields via `.tolist()`)."""
    if seqs is None:
        return None
    return [
        {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in vars(s).items()}
        for s in seqs
    ]


def rows_for(rank: int, seqs: list[TrainSequence]) -> torch.Tensor:
    """(seq id, position, log-prob) rows: rank r holds every other token of every sequence
    (context-parallel-like), shuffled, plus a padding row (seq id -1)."""
    rows = [
        (float(s.seq_id), float(j), lp)
        for s in seqs
        for j, lp in enumerate(s.old_logp)
        if j % 2 == rank
    ]
    random.Random(rank).shuffle(rows)
    rows.append((-1.0, 0.0, 0.0))
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)


def old_logprobs(gathered: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """The pre-issue-20 reassembly (a Python loop over every row), as the reference."""
    table: dict[int, dict[int, float]] = {}
    for part in gathered:
        for sid, pos, lp in part.tolist():
            if sid >= 0:
                table.setdefault(int(sid), {})[int(pos)] = lp
    return {
        sid: torch.tensor([d[i] for i in range(len(d))], dtype=torch.float64)
        for sid, d in sorted(table.items())
    }


def check_transfer(rank: int, world: int) -> dict[str, Any]:
    """Rank 0's sequences over the tensor broadcast and over torch's object broadcast; each
    rank's rows over the tensor gather (rank 1 also sends a TP duplicate, left out) and over
    `all_gather_object`. Returns what rank `rank` received by both paths."""
    seqs = random_sequences(13, seed=7)
    mine = seqs if rank == 0 else None
    new, extra = broadcast_sequences(mine, {"reward/mean": 0.5, "lost": None})
    box = [(mine, {"reward/mean": 0.5, "lost": None})]
    torch.distributed.broadcast_object_list(box, src=0)
    old, old_extra = box[0]
    nothing, extra2 = broadcast_sequences(None, "stop")  # rank 0 has no batch: every rank knows
    rows = rows_for(rank, seqs)
    # The tensor path: a TP duplicate of this rank's rows is flagged and must not count.
    gathered = gather_logprob_rows(rows)
    dup = gather_logprob_rows(rows, duplicate=rank == 1)
    ref: list[torch.Tensor] = [None] * world  # type: ignore[list-item]
    torch.distributed.all_gather_object(ref, rows)
    return {
        "new": as_lists(new),
        "old": as_lists(old),
        "extra": (extra, old_extra),
        "none": (nothing, extra2),
        "fresh": logprobs_by_sequence(gathered),
        "fresh_old": old_logprobs(ref),
        "dup_rows": dup.shape[0],
        "rows": [r.shape[0] for r in ref],
        "sent": as_lists(seqs),
    }
