"""The trainer predicts SGLang's `/weights_checker` checksums with SGLang's own function, on the
device the engine holds its weights on (issue 35, item 5).

SGLang hashes with `mm_utils.tensor_hash`: sha256 of the bytes for CPU tensors, its Triton
`gpu_tensor_hash` for CUDA ones. Before this fix the trainer re-implemented the sha256 branch,
so every first push to a GPU engine "differed". On CPU a re-implementation and SGLang's function
agree by value, so a value test cannot tell them apart: these tests swap SGLang's function for a
marked one (its value XOR a constant) and require the trainer's prediction to follow it, against
SGLang's own `WeightChecker` run over a module that holds the fused parameters (fused here by
hand, with torch.cat / stack). A planted re-implementation (the pre-fix sha256 code) fails them.
The CUDA branch runs on a GPU only: `tests/gpu/device_check.py` (its "hash" section).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import pytest
import torch

from megatron_gspo.engines import wire
from megatron_gspo.engines.weight_names import sglang_checksums
from megatron_gspo.engines.weight_shards import EngineChecksums, EngineLayout

MARK = 0x00F0_0D00_CAFE_0001
A, X = "model.layers.0.self_attn", "model.layers.0.mlp.experts"


def _hf(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    # 64 rows: SGLang pads the vocabulary to a multiple of 64 (`weight_shards.VOCAB_PADDING`)
    w = {"model.embed_tokens.weight": r(64, 8), "model.norm.weight": r(8)}
    w |= {f"{A}.q_proj.weight": r(8, 8), f"{A}.k_proj.weight": r(4, 8)}
    w |= {f"{A}.v_proj.weight": r(4, 8)}
    for e in range(3):
        w[f"{X}.{e}.gate_proj.weight"] = r(6, 8)
        w[f"{X}.{e}.up_proj.weight"] = r(6, 8)
        w[f"{X}.{e}.down_proj.weight"] = r(8, 6)
    return w


def _engine_module(w: dict[str, torch.Tensor]) -> torch.nn.Module:
    """What a one-rank SGLang engine holds of `w`, under its names (fused by hand)."""
    held = {
        "model.embed_tokens.weight": w["model.embed_tokens.weight"],
        "model.norm.weight": w["model.norm.weight"],
        f"{A}.qkv_proj.weight": torch.cat([w[f"{A}.{p}_proj.weight"] for p in "qkv"]),
        f"{X}.w13_weight": torch.stack(
            [
                torch.cat([w[f"{X}.{e}.gate_proj.weight"], w[f"{X}.{e}.up_proj.weight"]])
                for e in range(3)
            ]
        ),
        f"{X}.w2_weight": torch.stack([w[f"{X}.{e}.down_proj.weight"] for e in range(3)]),
    }
    root = torch.nn.Module()
    for name, t in held.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
    return root


def _sglang_reports(module: torch.nn.Module) -> dict[str, str]:
    """SGLang's own `WeightChecker` answering `{"action": "checksum"}` for `module`."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.weight_checker import WeightChecker

    place = dict(tp_rank=0, tp_size=1, dp_rank=0, attn_dp_size=1, pp_rank=0, pp_size=1)
    with get_parallel().override(**place):
        checker = WeightChecker(get_model=lambda: module)
    return checker.handle("checksum", role="target")["checksums"]


@pytest.fixture
def marked(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """SGLang's `tensor_hash` (as its weight checker calls it) marked; returns what it hashed."""
    from sglang.srt.utils import weight_checker

    seen: list[torch.Tensor] = []
    real = weight_checker.tensor_hash

    def marked_hash(t: torch.Tensor) -> int:
        seen.append(t)
        return real(t) ^ MARK

    monkeypatch.setattr(weight_checker, "tensor_hash", marked_hash)
    return seen


def _sha256_reimplementation(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """The pre-fix prediction: sha256 of the fused bytes, computed without SGLang."""
    from megatron_gspo.engines.weight_names import sglang_slot

    groups: dict[str, list[tuple[tuple[int, int], torch.Tensor]]] = {}
    for name, t in named:
        slot = sglang_slot(name)
        key, order = slot if slot else (name, (0, 0))
        groups.setdefault(key, []).append((order, t))
    out = {}
    for key, parts in groups.items():
        h = hashlib.sha256()
        for _, t in sorted(parts, key=lambda p: p[0]):
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        out[key] = f"{int.from_bytes(h.digest()[:8], 'big'):016x}"
    return out


def _check(predict: Callable[[list[tuple[str, torch.Tensor]]], dict[str, str]], seen) -> None:
    w = _hf()
    reported = _sglang_reports(_engine_module(w))
    assert len(reported) == 5 and seen  # SGLang's own checker ran through the marked hash
    seen.clear()
    assert predict(list(w.items())) == reported
    # the branch an engine on CPU takes: SGLang's function saw host tensors only
    assert seen and all(not t.is_cuda for t in seen)


def test_prediction_is_sglangs_function_on_cpu(marked: list[torch.Tensor]) -> None:
    _check(sglang_checksums, marked)


def test_sender_checksums_are_sglangs_function_on_cpu(marked: list[torch.Tensor]) -> None:
    """The sender's path (`EngineChecksums`, as `WeightSync` builds it for a CPU engine)."""

    def predict(named: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
        sums = EngineChecksums([EngineLayout(1, 1, 1, 1, 1, 3)], device="cpu")
        sums.add_bucket(named)
        hf = dict(sums.hf)
        assert hf == {n: wire.tensor_checksum(t) for n, t in named}  # HF names: marked too
        return sums.ranks(1)[0]

    _check(predict, marked)


def test_a_reimplementation_fails_the_check(marked: list[torch.Tensor]) -> None:
    """The planted re-implementation computes sha256 right, and still fails: it is not
    SGLang's function (on a GPU engine it would be wrong by value too)."""
    with pytest.raises(AssertionError):
        _check(_sha256_reimplementation, marked)


def test_unmarked_values_agree_with_sglang() -> None:
    """Without the mark, prediction and SGLang's checker agree (the fused layout is right)."""
    w = _hf(1)
    assert sglang_checksums(w.items()) == _sglang_reports(_engine_module(w))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only host")
def test_cuda_engine_without_a_gpu_is_one_line() -> None:
    with pytest.raises(RuntimeError, match="weights.engine_device=cpu") as e:
        wire.tensor_checksum(torch.ones(3), "cuda")
    assert "\n" not in str(e.value)
    with pytest.raises(RuntimeError, match="gpu_tensor_hash"):
        wire.fused_checksum([torch.ones(2)], "cuda")


def test_engine_device_follows_the_launched_engines() -> None:
    from megatron_gspo.config import load_config

    def dev(*o: str) -> str:
        c = load_config(None, ["model.hf_path=/m", "data.train_path=/d.jsonl", *o])
        return c.weights.engine_device

    sglang = "rollout.launch.backend=sglang"
    assert dev() == "cpu"  # the embedded engine
    assert dev(sglang, "rollout.launch.device=cpu") == "cpu"
    assert dev(sglang, "rollout.launch.device=cuda") == "cuda"
    assert dev(sglang) == "auto"  # SGLang's default device: decided where the sender runs
    assert dev(sglang, "rollout.launch.device=cuda", "weights.engine_device=cpu") == "cpu"


@pytest.fixture
def marked_fp8(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """SGLang's `block_quant_dequant` (as its FP8 comparable calls it) marked: negated."""
    from sglang.srt.utils import weight_checker_comparator as wcc

    seen: list[torch.Tensor] = []
    real = wcc.block_quant_dequant

    def marked_dequant(q: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        seen.append(q)
        return -real(q, *args, **kw)

    monkeypatch.setattr(wcc, "block_quant_dequant", marked_dequant)
    return seen


def _fp8_qkv() -> tuple[list[tuple[str, torch.Tensor]], str]:
    """Block-FP8 q/k/v (128 rows each) as sent, and SGLang's checksum of the fused parameter:
    `_hash_tensor(Fp8BlockComparable(q, scale).dequantize())`, as `_compute_checksum` does."""
    from sglang.srt.utils.weight_checker import _hash_tensor
    from sglang.srt.utils.weight_checker_comparator import Fp8BlockComparable

    from megatron_gspo.engines.fp8_blocks import quantise_blockwise

    g = torch.Generator().manual_seed(3)
    sent, qs, ss = [], [], []
    for p in "qkv":
        q, s = quantise_blockwise(torch.randn(128, 256, generator=g).to(torch.bfloat16))
        sent += [(f"{A}.{p}_proj.weight", q), (f"{A}.{p}_proj.weight_scale_inv", s)]
        qs.append(q)
        ss.append(s)
    fused = Fp8BlockComparable(torch.cat(qs), torch.cat(ss)).dequantize()
    return sent, _hash_tensor(fused)


def _own_dequant_prediction(sent: list[tuple[str, torch.Tensor]]) -> str:
    """The pre-fix prediction: our own dequantisation (same fp32 products), then the hash."""
    from megatron_gspo.engines.fp8_blocks import dequantise_blockwise

    d = dict(sent)
    parts = [
        dequantise_blockwise(d[f"{A}.{p}_proj.weight"], d[f"{A}.{p}_proj.weight_scale_inv"])
        for p in "qkv"
    ]
    return wire.tensor_checksum(torch.cat(parts).to(torch.bfloat16))


def test_fp8_checksums_are_sglangs_dequantisation(marked_fp8: list[torch.Tensor]) -> None:
    """A block-FP8 weight is hashed as SGLang's own `Fp8BlockComparable.dequantize` makes it;
    the pre-fix prediction (our dequantisation, equal by value) fails under the mark."""
    sent, reported = _fp8_qkv()
    assert marked_fp8  # SGLang's side ran through the marked function
    sums = EngineChecksums([EngineLayout(1, 1, 1, 1, 1)], namings=frozenset({"sglang"}))
    sums.add_bucket(sent)
    assert sums.ranks(1)[0] == {f"{A}.qkv_proj.weight": reported}
    assert _own_dequant_prediction(sent) != reported


def test_fp8_unmarked_agrees() -> None:
    sent, reported = _fp8_qkv()
    assert _own_dequant_prediction(sent) == reported  # same products: the mark is what differs


def test_fp8_below_one_block_uses_sglangs_dequantisation(marked_fp8) -> None:
    """Tiny test models (K < 128): SGLang's comparable would infer the block edge wrong, so the
    prediction calls SGLang's block_quant_dequant with the checkpoint's 128 (still marked)."""
    from megatron_gspo.engines.fp8_blocks import dequantise_blockwise, quantise_blockwise

    name = "model.layers.0.self_attn.o_proj.weight"
    q, s = quantise_blockwise(torch.randn(64, 32).to(torch.bfloat16))
    sums = EngineChecksums([EngineLayout(1, 1, 1, 1, 1)], namings=frozenset({"sglang"}))
    sums.add_bucket([(name, q), (name + "_scale_inv", s)])
    got = sums.ranks(1)[0][name]
    own = dequantise_blockwise(q, s).to(torch.bfloat16)
    assert marked_fp8 and got == wire.tensor_checksum(-own) != wire.tensor_checksum(own)
