"""SGLang's own layout (`engines/weight_layout.py`) against the materialised reference of
`test_weight_shards.py` (every SGLang parameter of every rank built the way SGLang's weight
loaders fill it from HF names, hashed with SGLang's own function).

The real SGLang server loading these tensors by name is in `test_sglang_server_cpu.py`
(`test_weight_update_transport[tensor-direct]`)."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.engines.weight_layout import (
    FusedParts,
    Fuser,
    fused_stream,
    is_fused_name,
    rank_pieces,
    rank_tensors,
    unfuse_all,
)
from megatron_gspo.engines.weight_shards import EngineChecksums
from megatron_gspo.engines.wire import tensor_checksum
from tests.engines.test_weight_shards import _T, CASES, E, _layout, _reference


def _fused(seed_order: bool = False) -> list[tuple[str, torch.Tensor]]:
    named = list(_T.items())
    return list(fused_stream(reversed(named) if seed_order else named, num_experts=E))


def test_one_tensor_per_fused_parameter() -> None:
    fused = _fused()
    names = [n for n, _ in fused]
    assert len(names) == len(set(names))
    p = "model.layers.0"
    assert f"{p}.self_attn.qkv_proj.weight" in names
    assert f"{p}.mlp.experts.w13_weight" in names and f"{p}.mlp.experts.w2_weight" in names
    assert not any(".experts.0." in n or ".q_proj." in n for n in names)
    # 3 E expert tensors and q/k/v become 3 tensors; the rest pass through
    assert len(fused) == len(_T) - 3 * E + 2 - 2
    w13 = dict(fused)[f"{p}.mlp.experts.w13_weight"]
    assert w13.shape == (E, 2 * _T[f"{p}.mlp.experts.0.gate_proj.weight"].shape[0], 256)


@pytest.mark.parametrize("reverse", [False, True], ids=["export-order", "reversed"])
def test_unfuse_gives_back_every_hf_tensor_bitwise(reverse: bool) -> None:
    back = dict(unfuse_all(_fused(reverse), _layout(1, 1)))
    assert sorted(back) == sorted(_T)
    for n, t in _T.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n].view(-1), t.view(-1)), n


def test_each_rank_gets_what_sglangs_loaders_would_hold() -> None:
    """Per engine rank, the tensors sent with load_format=direct hash like the parameters
    SGLang's loaders build from the HF names (TP 1, 2, 4; EP 2; kv heads replicated)."""
    fused = _fused()
    for tp, ep in CASES:
        for rank in range(tp):
            got = {n: tensor_checksum(t) for n, t in rank_tensors(fused, rank, _layout(tp, ep))}
            assert got == _reference(_T, tp, ep, rank, False), (tp, ep, rank)


def _lazy_fp32() -> list[tuple[str, object]]:
    """The sender's stream in SGLang's layout: fused parameters as their members (fp32 copies
    of the bf16 reference, to be cast to bf16 while written), the rest bf16 tensors."""
    lazy = fused_stream([(n, t.float()) for n, t in _T.items()], num_experts=E, lazy=True)
    out: list[tuple[str, object]] = []
    for n, t in lazy:
        assert isinstance(t, FusedParts) == is_fused_name(n), n
        out.append((n, t.cast(torch.bfloat16) if isinstance(t, FusedParts) else t.bfloat16()))
    return out


@pytest.mark.parametrize("lazy", [True, False], ids=["members", "whole"])
def test_rank_payloads_written_in_one_pass_hold_what_sglangs_loaders_would(lazy: bool) -> None:
    """Each rank's `direct` payload, written straight from the sender's tensors (members cast
    while copied, no fused tensor assembled), decodes as SGLang's rank decodes it (its own
    unpickler) to the parameters its loaders build from HF names (TP 1, 2, 4; EP 2), as views
    of one shared-memory buffer per rank that was already shared when written (serialising
    copies nothing) and is reused by the next call."""
    from megatron_gspo.engines.wire import deserialize_named_tensors, direct_payloads_from_pieces

    items = _lazy_fp32() if lazy else _fused()
    for tp, ep in CASES:
        held: dict[int, torch.Tensor] = {}
        per_rank = [rank_pieces(items, r, _layout(tp, ep)) for r in range(tp)]
        for call in range(2):
            payloads, keep = direct_payloads_from_pieces(per_rank, held)
            assert all(k.is_shared() and k is held[r] for r, k in enumerate(keep))
            for rank, payload in enumerate(payloads):
                got = deserialize_named_tensors(payload, "direct")
                assert len({t.untyped_storage().data_ptr() for _, t in got}) == 1
                sums = {n: tensor_checksum(t) for n, t in got}
                assert sums == _reference(_T, tp, ep, rank, False), (tp, ep, rank, call)
            if call == 0:
                for k in keep:
                    k.zero_()  # the reused buffers must be written again, in full


def test_checksums_of_fused_tensors_equal_those_of_their_hf_members() -> None:
    """The sender's verification accounts a fused tensor as its HF members: the same
    per-rank and HF-named checksums as an HF-named push."""
    for tp, ep in CASES:
        by_hf, by_fused = EngineChecksums([_layout(tp, ep)]), EngineChecksums([_layout(tp, ep)])
        for n, t in _T.items():
            by_hf.add(n, t)
        for n, t in _fused():
            by_fused.add(n, t)
        by_members = EngineChecksums([_layout(tp, ep)])
        by_members.add_bucket(_lazy_fp32())  # members hashed as sent (cast to bf16)
        assert by_fused.hf == by_hf.hf == by_members.hf
        assert by_fused.ranks(tp) == by_hf.ranks(tp) == by_members.ranks(tp)


def test_a_missing_member_is_refused() -> None:
    fuser = Fuser(num_experts=E)
    p = "model.layers.0.self_attn"
    assert fuser.add(f"{p}.q_proj.weight", _T[f"{p}.q_proj.weight"]) == []
    assert fuser.add(f"{p}.v_proj.weight", _T[f"{p}.v_proj.weight"]) == []
    with pytest.raises(ValueError, match="qkv_proj"):
        fuser.close()
    assert is_fused_name(f"{p}.qkv_proj.weight") and not is_fused_name(f"{p}.q_proj.weight")


def test_direct_payload_is_one_segment_per_rank_and_decodes_bitwise() -> None:
    """What SGLang's rank decodes from a `direct` payload (its own allow-list unpickler): the
    rank's tensors bitwise, all views of one shared buffer (one segment, not one per tensor)."""
    from megatron_gspo.engines.wire import deserialize_named_tensors, direct_payloads

    lay = _layout(2, 1)
    per_rank = [rank_tensors(_fused(), r, lay) for r in range(2)]
    payloads, keep = direct_payloads(per_rank)
    assert len(payloads) == 2
    for sent, payload in zip(per_rank, payloads, strict=True):
        got = deserialize_named_tensors(payload, "direct")
        assert [n for n, _ in got] == [n for n, _ in sent]
        for (_, a), (_, b) in zip(sent, got, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert len({t.untyped_storage().data_ptr() for _, t in got}) == 1
    del keep


def _decode_in_another_process(payloads: list[str]) -> list[float]:
    """Each payload opened and dropped in turn by a fresh process, as engines do (torch's own
    rebuild of the shared-memory handles; the sum of each decoded tensor)."""
    import subprocess
    import sys

    code = (
        "import sys, json, base64, pickle, torch\n"
        "out = []\n"
        "for p in json.load(sys.stdin):\n"
        "    named = pickle.loads(base64.b64decode(p))\n"
        "    out.append(sum(float(t.double().sum()) for _, t in named))\n"
        "    del named\n"
        "print(json.dumps(out))\n"
    )
    import json

    res = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(payloads), capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-800:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_reused_buffers_survive_several_engines_across_calls() -> None:
    """Engines of one TP size share each rank's buffer, each with its own serialisation; the
    buffer is reused by the next call (next bucket). One serialisation opened by two engines
    let the second drop the segment's count to zero: the next call's engines found no segment
    ("unable to open shared memory object")."""
    from megatron_gspo.engines.wire import direct_payloads_for_engines

    held: dict[int, torch.Tensor] = {}
    items = _fused()
    want = sum(float(t.double().sum()) for _, t in items)
    for call in range(2):
        per_rank = [rank_pieces(items, 0, _layout(1, 1))]
        payloads, keep = direct_payloads_for_engines(per_rank, 2, held)
        got = _decode_in_another_process([p[0] for p in payloads])
        assert got == pytest.approx([want, want]), call
        del keep
