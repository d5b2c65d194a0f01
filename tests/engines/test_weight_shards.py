"""Per-TP-rank verification (`engines/weight_shards.py`) against a second implementation.

The reference below builds every SGLang parameter of every rank as one materialised tensor, the
way SGLang's weight loaders fill it (fused qkv per rank = the rank's heads of q, k, v; kv heads
replicated when fewer than ranks; w13 = the rank's experts, each gate rows then up rows of the
rank's moe-TP slice; vocab padded to 64 then split), FP8 parameters as SGLang's
`block_quant_dequant` formula (repeat_interleave of the scales, fp32 product, bf16), and hashes
them with SGLang's own tensor checksum. The sender side streams and never materialises.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.engines.weight_shards import EngineChecksums, EngineLayout
from megatron_gspo.engines.wire import tensor_checksum
from megatron_gspo.weights import fp8
from megatron_gspo.weights.checksum import WeightIntegrityError
from megatron_gspo.weights.verify import verify_engines

H, HQ, HKV, D, FF, E, V = 256, 4, 2, 128, 256, 4, 200  # FP8: every shard 128-aligned
P = "model.layers.0"


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    t = {
        "model.embed_tokens.weight": r(V, H),
        "lm_head.weight": r(V, H),
        "model.norm.weight": r(H),
        f"{P}.input_layernorm.weight": r(H),
        f"{P}.self_attn.q_proj.weight": r(HQ * D, H),
        f"{P}.self_attn.k_proj.weight": r(HKV * D, H),
        f"{P}.self_attn.v_proj.weight": r(HKV * D, H),
        f"{P}.self_attn.o_proj.weight": r(H, HQ * D),
        f"{P}.self_attn.q_norm.weight": r(D),
        f"{P}.mlp.gate.weight": r(E, H),
    }
    for e in range(E):
        t[f"{P}.mlp.experts.{e}.gate_proj.weight"] = r(FF, H)
        t[f"{P}.mlp.experts.{e}.up_proj.weight"] = r(FF, H)
        t[f"{P}.mlp.experts.{e}.down_proj.weight"] = r(H, FF)
    return t


_T = _tensors()


def _deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """SGLang's block_quant_dequant (srt/layers/quantization/fp8_utils.py): [N, K], [E, N, K]."""
    n, k = q.shape[-2:]
    rep = s.repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)[..., :n, :k]
    return (q.to(torch.float32) * rep).to(torch.bfloat16)


_Q8: dict[int, dict] = {}


def _q8(t: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    if id(t) not in _Q8:
        _Q8[id(t)] = {
            n: fp8.quantise_blockwise(x.float()) for n, x in t.items() if fp8.is_quantised_name(n)
        }
    return _Q8[id(t)]


def _reference(t: dict, tp: int, ep: int, rank: int, use_fp8: bool) -> dict[str, str]:
    """rank `rank`'s `{sglang_name: checksum}` from materialised fused parameters."""
    q8 = _q8(t)

    def w(name: str) -> torch.Tensor:  # what the rank's parameter holds, bf16 view
        return _deq(*q8[name]) if use_fp8 and name in q8 else t[name]

    def rows(x: torch.Tensor, parts: int, i: int) -> torch.Tensor:
        return torch.chunk(x, parts, 0)[i]

    out = {}
    for n in ("model.norm.weight", f"{P}.input_layernorm.weight", f"{P}.self_attn.q_norm.weight",
              f"{P}.mlp.gate.weight"):  # fmt: skip
        out[n] = tensor_checksum(t[n])
    for n in ("model.embed_tokens.weight", "lm_head.weight"):
        padded = torch.cat([t[n], t[n].new_zeros(256 - V, H)])  # 64-multiple: 256
        out[n] = tensor_checksum(rows(padded, tp, rank))
    a = f"{P}.self_attn"
    q = w(f"{a}.q_proj.weight").view(HQ, D, H)[rank * HQ // tp : (rank + 1) * HQ // tp]
    kv_heads = (
        slice(rank * HKV // tp, (rank + 1) * HKV // tp)
        if HKV >= tp
        else slice(rank // (tp // HKV), rank // (tp // HKV) + 1)
    )
    k = w(f"{a}.k_proj.weight").view(HKV, D, H)[kv_heads]
    v = w(f"{a}.v_proj.weight").view(HKV, D, H)[kv_heads]
    out[f"{a}.qkv_proj.weight"] = tensor_checksum(torch.cat([q, k, v]).reshape(-1, H))
    out[f"{a}.o_proj.weight"] = tensor_checksum(torch.chunk(w(f"{a}.o_proj.weight"), tp, 1)[rank])
    moe_tp = tp // ep
    ep_rank, m = divmod(rank, moe_tp)
    mine = range(ep_rank * E // ep, (ep_rank + 1) * E // ep)
    x = f"{P}.mlp.experts"
    w13 = torch.stack(
        [
            torch.cat(
                [
                    rows(w(f"{x}.{e}.gate_proj.weight"), moe_tp, m),
                    rows(w(f"{x}.{e}.up_proj.weight"), moe_tp, m),
                ]
            )
            for e in mine
        ]
    )
    w2 = torch.stack([torch.chunk(w(f"{x}.{e}.down_proj.weight"), moe_tp, 1)[m] for e in mine])
    out[f"{x}.w13_weight"] = tensor_checksum(w13)
    out[f"{x}.w2_weight"] = tensor_checksum(w2)
    return out


def _sent(t: dict, layouts: list[EngineLayout], use_fp8: bool) -> EngineChecksums:
    acc = EngineChecksums(layouts)
    for name in reversed(list(t)):  # any order: fused members arrive out of turn
        sent = fp8.quantise_named(name, t[name].float()) if use_fp8 else [(name, t[name])]
        for n, x in sent:
            acc.add(n, x)
    return acc


def _layout(tp: int, ep: int) -> EngineLayout:
    return EngineLayout(tp, ep, HQ, HKV, D, E)


CASES = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]  # TP4: kv heads (2) replicated


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_per_rank_checksums_match_the_materialised_shards(use_fp8: bool) -> None:
    t = _T
    for tp, ep in CASES:
        acc = _sent(t, [_layout(tp, ep)], use_fp8)
        for rank, got in enumerate(acc.ranks(tp)):
            assert got == _reference(t, tp, ep, rank, use_fp8), (tp, ep, rank)


class _Engine:
    """Reports given per-rank checksums in SGLang's /weights_checker shape."""

    def __init__(self, per_rank: list[dict[str, str]]) -> None:
        self.per_rank = per_rank

    def weights_checksum(self) -> dict:
        ranks = [
            {"checksums": c, "parallelism_info": {"tp_rank": r}}
            for r, c in reversed(list(enumerate(self.per_rank)))  # order from the engine
        ]
        return {"http://e0": {"ranks": ranks}}


def test_verification_catches_a_wrong_shard_and_a_wrong_fp8_scale() -> None:
    t = _T
    acc = _sent(t, [_layout(2, 1)], use_fp8=True)
    good = [_reference(t, 2, 1, r, True) for r in range(2)]
    verify_engines([_Engine(good)], acc)  # type: ignore[list-item]
    # rank 1 loaded rank 0's slice of o_proj (a wrong narrow)
    swapped = [dict(good[0]), dict(good[1])]
    swapped[1][f"{P}.self_attn.o_proj.weight"] = good[0][f"{P}.self_attn.o_proj.weight"]
    with pytest.raises(WeightIntegrityError, match="o_proj.weight.*TP rank 1"):
        verify_engines([_Engine(swapped)], acc)  # type: ignore[list-item]
    # one block scale of expert 1's up_proj off by one ulp on the engine: w13 of rank 0 differs
    q, s = fp8.quantise_blockwise(t[f"{P}.mlp.experts.1.up_proj.weight"].float())
    s[0, 0] *= 1.01  # (one fp32 ulp would vanish in SGLang's bf16 dequantisation)
    wrong = _reference(t, 2, 1, 0, True)
    q8 = dict(_q8(t))
    q8[f"{P}.mlp.experts.1.up_proj.weight"] = (q, s)
    x = f"{P}.mlp.experts"
    wrong[f"{x}.w13_weight"] = tensor_checksum(
        torch.stack(
            [
                torch.cat(
                    [
                        torch.chunk(_deq(*q8[f"{x}.{e}.gate_proj.weight"]), 2)[0],
                        torch.chunk(_deq(*q8[f"{x}.{e}.up_proj.weight"]), 2)[0],
                    ]
                )
                for e in range(E)
            ]
        )
    )
    with pytest.raises(WeightIntegrityError, match="w13_weight.*TP rank 0"):
        verify_engines([_Engine([wrong, good[1]])], acc)  # type: ignore[list-item]
