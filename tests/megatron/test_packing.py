"""THD packing, the DP split and padding micro-batches, checked against direct construction."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_gspo.algo import PolicyLossConfig, PolicyLossInputs, policy_loss
from megatron_gspo.megatron.packing import (
    PAD_ID,
    TrainSequence,
    pack,
    pad_multiple,
    plan_micro_batches,
)


def _seq(i: int, p: int, r: int, per_token: bool = False) -> TrainSequence:
    g = random.Random(i)
    return TrainSequence(
        seq_id=i,
        prompt_ids=[g.randrange(1, 50) for _ in range(p)],
        response_ids=[g.randrange(1, 50) for _ in range(r)],
        old_logp=[-g.random() for _ in range(r)],
        advantage=[g.uniform(-1, 1) for _ in range(r)] if per_token else g.uniform(-1, 1),
    )


def test_pack_places_response_targets_after_their_prompt() -> None:
    seqs = [_seq(0, 3, 4), _seq(1, 1, 2), _seq(2, 5, 1)]
    mb = pack(seqs, multiple=4)
    assert mb.cu_seqlens.tolist() == [0, 8, 12, 20]  # lengths 7, 3, 6 padded to 4
    for k, s in enumerate(seqs):
        start = int(mb.cu_seqlens[k])
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids = mb.input_ids[0, start : start + s.length].tolist()
        assert ids == [*s.prompt_ids, *s.response_ids]
        span = slice(start + p - 1, start + p - 1 + r)  # positions predicting the response
        assert mb.labels[span].tolist() == list(s.response_ids)
        assert torch.allclose(mb.old_logp[span], torch.tensor(s.old_logp))
        assert mb.mask[span].tolist() == [1.0] * r
        assert mb.token_pos[span].tolist() == list(range(r))
        assert (mb.seq_index[start : int(mb.cu_seqlens[k + 1])] == k).all()
    assert int(mb.mask.sum()) == sum(len(s.response_ids) for s in seqs)
    assert mb.position_ids[0, 8:12].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_shards_partition_each_sequence(cp: int) -> None:
    seqs = [_seq(0, 3, 6), _seq(1, 2, 9)]
    multiple = pad_multiple(tp=1, cp=cp, sequence_parallel=False)
    full = pack(seqs, multiple=multiple)
    shards = [pack(seqs, multiple=multiple, cp_size=cp, cp_rank=r) for r in range(cp)]
    for k in range(len(seqs)):
        lo, hi = int(full.cu_seqlens[k]), int(full.cu_seqlens[k + 1])
        got = torch.cat([sh.position_ids[0][sh.seq_index == k] for sh in shards]).sort().values
        assert got.tolist() == list(range(hi - lo))  # every position on exactly one rank
        for sh in shards:
            pos = sh.position_ids[0][sh.seq_index == k]
            assert torch.equal(sh.labels[sh.seq_index == k], full.labels[lo + pos])


@pytest.mark.parametrize("dp,count_multiple", [(1, 1), (2, 1), (3, 2), (2, 4)])
def test_plan_gives_every_rank_the_same_count_and_each_sequence_once(dp, count_multiple) -> None:
    g = random.Random(dp)
    seqs = [_seq(i, g.randint(1, 6), g.randint(1, 12)) for i in range(11)]
    plans = [
        plan_micro_batches(
            seqs, dp_size=dp, dp_rank=r, max_tokens=24, multiple=2, count_multiple=count_multiple
        )
        for r in range(dp)
    ]
    counts = {len(p) for p in plans}
    assert len(counts) == 1 and counts.pop() % count_multiple == 0
    ids = sorted(i for p in plans for mb in p for i in mb.seq_ids if i >= 0)
    assert ids == list(range(len(seqs)))
    for p in plans:
        for mb in p:
            assert mb.input_ids.size(1) <= 24 or mb.num_seqs == 1


@pytest.mark.parametrize("kind", ["gspo", "gspo_token", "grpo"])
def test_padding_micro_batch_contributes_nothing(kind: str) -> None:
    # one token, one sequence: S == T, which the loss cannot tell apart without the flag
    mb = pack([], multiple=1)
    assert mb.seq_ids == [-1] and mb.input_ids.tolist() == [[PAD_ID]] and mb.mask.sum() == 0
    logp = torch.zeros(1, requires_grad=True)
    batch = PolicyLossInputs(
        logp=logp,
        old_logp=mb.old_logp,
        advantages=mb.advantages,
        advantages_per_token=mb.advantages_per_token,
        seq_index=mb.seq_index,
        mask=mb.mask,
        num_seqs=mb.num_seqs,
    )
    loss, _ = policy_loss(batch, PolicyLossConfig(kind=kind), denominator=1.0)
    loss.backward()
    assert loss.item() == 0.0 and logp.grad is not None and logp.grad.abs().sum() == 0


def test_per_token_advantages_are_flagged() -> None:
    mb = pack([_seq(0, 1, 1, per_token=True)], multiple=1)
    assert mb.advantages_per_token and mb.advantages.shape == mb.mask.shape
    assert not pack([_seq(0, 1, 1)], multiple=1).advantages_per_token
