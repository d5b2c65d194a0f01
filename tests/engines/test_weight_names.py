"""Checksums in SGLang's parameter naming, against explicitly fused tensors (no server needed;
tests/engines/test_sglang_server_cpu.py checks them against the real server)."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_gspo.engines.weight_names import (
    SGLangChecksums,
    reported_in_sglang_naming,
    sglang_checksums,
)
from megatron_gspo.engines.wire import tensor_checksum


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": r(16, 8), "lm_head.weight": r(16, 8)}
    a = "model.layers.0.self_attn"
    w |= {f"{a}.q_proj.weight": r(8, 8), f"{a}.k_proj.weight": r(4, 8)}
    w |= {f"{a}.v_proj.weight": r(4, 8), f"{a}.q_proj.bias": r(8), f"{a}.k_proj.bias": r(4)}
    w |= {f"{a}.v_proj.bias": r(4)}
    for e in range(3):
        for m in ("gate", "up", "down"):
            shape = (8, 6) if m == "down" else (6, 8)
            w[f"model.layers.0.mlp.experts.{e}.{m}_proj.weight"] = r(*shape)
    w |= {
        "model.layers.1.mlp.gate_proj.weight": r(6, 8),
        "model.layers.1.mlp.up_proj.weight": r(6, 8),
    }
    return w


def _fused_reference(w: dict[str, torch.Tensor]) -> dict[str, str]:
    a, x = "model.layers.0.self_attn", "model.layers.0.mlp.experts"
    qkv = {
        leaf: torch.cat([w[f"{a}.{p}_proj.{leaf}"] for p in "qkv"]) for leaf in ("weight", "bias")
    }
    w13 = torch.stack(
        [
            torch.cat([w[f"{x}.{e}.gate_proj.weight"], w[f"{x}.{e}.up_proj.weight"]])
            for e in range(3)
        ]
    )
    w2 = torch.stack([w[f"{x}.{e}.down_proj.weight"] for e in range(3)])
    gu = torch.cat(
        [w["model.layers.1.mlp.gate_proj.weight"], w["model.layers.1.mlp.up_proj.weight"]]
    )
    fused = {
        f"{a}.qkv_proj.weight": qkv["weight"],
        f"{a}.qkv_proj.bias": qkv["bias"],
        f"{x}.w13_weight": w13,
        f"{x}.w2_weight": w2,
        "model.layers.1.mlp.gate_up_proj.weight": gu,
        "model.embed_tokens.weight": w["model.embed_tokens.weight"],
        "lm_head.weight": w["lm_head.weight"],
    }
    return {n: tensor_checksum(t) for n, t in fused.items()}


@pytest.mark.parametrize("order_seed", [None, 0, 1, 2])
def test_fused_checksums_equal_hashing_the_fused_tensors(order_seed):
    w = _weights()
    items = sorted(w.items())
    if order_seed is not None:
        random.Random(order_seed).shuffle(items)  # any arrival order, any bucket split
    assert sglang_checksums(items) == _fused_reference(w)


def test_a_changed_member_changes_its_fused_checksum_only():
    w = _weights()
    ref = sglang_checksums(w.items())
    w["model.layers.0.mlp.experts.1.up_proj.weight"][0, 0] += 1
    got = sglang_checksums(w.items())
    assert {n for n in ref if ref[n] != got[n]} == {"model.layers.0.mlp.experts.w13_weight"}


def test_a_missing_member_is_an_error():
    w = _weights()
    del w["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="qkv_proj.weight"):
        sglang_checksums(w.items())


def test_fp8_weights_are_left_out_and_hf_sums_kept():
    w = _weights()
    w["lm_head.weight_scale_inv"] = torch.ones(1, 1)
    w["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(1, 1)
    acc = SGLangChecksums()
    for n, t in w.items():
        acc.add(n, t)
    out = acc.result()
    assert "lm_head.weight" not in out and "model.layers.0.self_attn.qkv_proj.weight" not in out
    assert "model.layers.0.self_attn.qkv_proj.bias" in out
    assert acc.hf == {n: tensor_checksum(t) for n, t in w.items()}


def test_naming_detection():
    assert reported_in_sglang_naming(["model.layers.0.self_attn.qkv_proj.weight"])
    assert not reported_in_sglang_naming(list(_weights()))
