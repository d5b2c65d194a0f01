"""The engine's routed experts in the packed layout (`rl.routing_replay`): every packed token
position gets the experts the engine routed THAT token to, whatever the CP shard and padding;
the routes survive the rank broadcast bit for bit."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.megatron.packing import TrainSequence, pack
from megatron_gspo.megatron.transfer import pack_sequences, unpack_sequences

L, K, E = 3, 2, 8


def _seqs(with_routes: list[bool], seed: int = 0) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, has in enumerate(with_routes):
        p, r = 1 + i % 3, 2 + (3 * i) % 5
        routes = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range((p + r - 1) * L)])
        out.append(
            TrainSequence(
                seq_id=i,
                prompt_ids=torch.randint(1, 50, (p,), generator=g).tolist(),
                response_ids=torch.randint(1, 50, (r,), generator=g).tolist(),
                old_logp=[-1.0] * r,
                advantage=float(i),
                routed_experts=routes.view(p + r - 1, L, K).to(torch.int32) if has else None,
            )
        )
    return out


@pytest.mark.parametrize("cp", [1, 2])
def test_each_packed_position_gets_its_tokens_routes(cp: int) -> None:
    seqs = _seqs([True] * 5)
    for rank in range(cp):
        mb = pack(seqs, multiple=4 * cp, cp_size=cp, cp_rank=rank)
        assert mb.routed_experts is not None and mb.routed_experts.shape[1:] == (L, K)
        for t in range(mb.input_ids.shape[1]):
            s = seqs[int(mb.seq_index[t])]
            pos = int(mb.position_ids[0, t])  # the token's place in its own sequence
            got = mb.routed_experts[t]
            if pos < s.length - 1:  # the engine fed this token: its routes, in order
                assert torch.equal(got, s.routed_experts[pos].long()), (rank, t)
            else:  # last token, padding: the engine routed nothing
                assert (got == -1).all(), (rank, t)


def test_no_routes_no_replay_and_no_mixing() -> None:
    assert pack(_seqs([False] * 3), multiple=1).routed_experts is None
    with pytest.raises(ValueError, match="no routed_experts"):
        pack(_seqs([True, False]), multiple=1)
    with pytest.raises(ValueError, match="rows"):
        TrainSequence(
            seq_id=0, prompt_ids=[1, 2], response_ids=[3], old_logp=[0.0], advantage=0.0,
            routed_experts=torch.zeros(3, L, K),
        )  # fmt: skip


def test_routes_survive_the_rank_broadcast() -> None:
    seqs = _seqs([True, False, True, True])
    back = unpack_sequences(pack_sequences(seqs))
    for a, b in zip(seqs, back, strict=True):
        if a.routed_experts is None:
            assert b.routed_experts is None
        else:
            assert b.routed_experts is not None
            assert torch.equal(a.routed_experts, b.routed_experts.to(a.routed_experts.dtype))
    assert all(s.routed_experts is None for s in unpack_sequences(pack_sequences(_seqs([False]))))
