"""The rollout broadcast and the pi_old=recompute gather as tensors (issue 20, defect 6):
the same sequences and log-probs as torch's object collectives and the old Python loop."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.megatron.packing import TrainSequence, pack
from megatron_gspo.megatron.transfer import (
    logprobs_by_sequence,
    pack_sequences,
    unpack_sequences,
)
from megatron_gspo.testing.harness import spawn_ranks
from tests.megatron.transfer_ranks import (
    as_lists,
    check_transfer,
    old_logprobs,
    random_sequences,
    rows_for,
)


def test_pack_unpack_gives_back_the_same_sequences():
    seqs = random_sequences(17, seed=3)
    odd = TrainSequence(  # per-token advantages, ids beyond int32, an empty response
        seq_id=7, prompt_ids=[2**40, 3], response_ids=[], old_logp=[], advantage=[],
    )  # fmt: skip
    tok = TrainSequence(
        seq_id=8, prompt_ids=[1], response_ids=[5, 6], old_logp=[-0.1, -1e-300],
        advantage=[0.25, -1.5],
    )  # fmt: skip
    for batch in (seqs, [odd, tok]):
        back = unpack_sequences(pack_sequences(batch))
        assert as_lists(back) == as_lists(batch)
    packed = pack_sequences(seqs)
    assert packed["prompt_ids"].dtype == torch.int32  # vocab ids: 4 bytes, not 8
    assert packed["loss_mask"].dtype == torch.uint8


def test_received_sequences_pack_into_the_same_micro_batch():
    """What the training step sees: `pack` of the received tensor views equals `pack` of the
    sender's lists, field by field."""
    seqs = random_sequences(9, seed=4)
    same = [s for s in seqs if (s.loss_mask is None) == (seqs[0].loss_mask is None)]
    same = [s for s in same if (s.rollout_logp is None) == (same[0].rollout_logp is None)]
    same = [s for s in same if (s.ref_logp is None) == (same[0].ref_logp is None)]
    back = unpack_sequences(pack_sequences(same))
    want, got = pack(same, multiple=4), pack(back, multiple=4)
    for name, value in vars(want).items():
        other = getattr(got, name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), name
        else:
            assert value == other, name


def test_logprobs_by_sequence_matches_the_row_loop():
    seqs = random_sequences(11, seed=5)
    parts = [rows_for(0, seqs), rows_for(1, seqs)]
    got = logprobs_by_sequence(torch.cat(parts))
    want = old_logprobs(parts)
    assert list(got) == list(want)
    for sid in want:
        assert torch.equal(got[sid], want[sid])
    with pytest.raises(RuntimeError, match="missing or repeated"):
        logprobs_by_sequence(parts[0])  # every other token only


@pytest.mark.multirank
@pytest.mark.slow  # ~10-20 s: two spawned ranks
def test_two_ranks_tensor_paths_equal_the_object_collectives():
    r0, r1 = spawn_ranks(check_transfer, 2)
    for r in (r0, r1):
        assert r["new"] == r["old"] == r["sent"]
        assert r["extra"][0] == r["extra"][1]
        assert r["none"] == (None, "stop")
        assert list(r["fresh"]) == list(r["fresh_old"])
        for sid, want in r["fresh_old"].items():
            assert torch.equal(r["fresh"][sid], want)
        assert r["dup_rows"] == r["rows"][0]  # rank 1's duplicate left out
