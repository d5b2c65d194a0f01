"""Block FP8 and bucketing units (no Megatron): shapes, names, the e4m3 bound, edge blocks."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.engines.weight_group import flatten_for_broadcast as flatten
from megatron_gspo.testing.weights import block_relative_error
from megatron_gspo.weights import fp8
from megatron_gspo.weights.checksum import WeightIntegrityError, checksums, compare_checksums
from megatron_gspo.weights.stream import StreamStats, iter_buckets


@pytest.mark.parametrize("shape", [(300, 200), (128, 128), (1, 7), (257, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantise_shapes_and_bound(shape: tuple[int, int], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    # Mixed magnitudes so that some blocks hit e4m3 subnormals relative to their scale.
    x = (torch.randn(shape, generator=g) * torch.logspace(-4, 1, shape[1])).to(dtype)
    q, s = fp8.quantise_blockwise(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == fp8.scale_shape(shape)
    assert fp8.check_dequantised("w", x, q, s) <= 1.0
    assert float(block_relative_error(x, q, s).max()) <= fp8.REL_BOUND


def test_bound_check_fails_on_a_wrong_scale() -> None:
    x = torch.randn(256, 256)
    q, s = fp8.quantise_blockwise(x)
    s[1, 0] *= 1.2  # one block dequantised with the wrong scale
    with pytest.raises(ValueError, match=r"block \(1, 0\)"):
        fp8.check_dequantised("w", x, q, s)


def test_zero_block_and_pow2_scales() -> None:
    x = torch.zeros(128, 256)
    x[:, 128:] = torch.randn(128, 128)
    q, s = fp8.quantise_blockwise(x, pow2_scale=True)
    assert torch.equal(fp8.dequantise_blockwise(q, s)[:, :128], x[:, :128])
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert fp8.check_dequantised("w", x, q, s) <= 1.0


@pytest.mark.parametrize(
    "name,quantised",
    [
        ("model.layers.3.self_attn.q_proj.weight", True),
        ("model.layers.3.self_attn.o_proj.weight", True),
        ("model.layers.3.mlp.experts.17.gate_proj.weight", True),
        ("model.layers.3.mlp.experts.17.down_proj.weight", True),
        ("model.layers.3.mlp.shared_expert.up_proj.weight", True),
        ("model.layers.3.mlp.gate.weight", False),  # router
        ("model.layers.3.mlp.shared_expert_gate.weight", False),
        ("model.layers.3.input_layernorm.weight", False),
        ("model.layers.3.self_attn.q_norm.weight", False),
        ("model.embed_tokens.weight", False),
        ("lm_head.weight", False),
        ("model.norm.weight", False),
    ],
)
def test_which_names_are_quantised(name: str, quantised: bool) -> None:
    assert fp8.is_quantised_name(name) is quantised
    if quantised:
        assert fp8.scale_name(name) == name.removesuffix("weight") + "weight_scale_inv"


def test_buckets_bound_size_and_keep_order() -> None:
    tensors = [(f"t{i}", torch.full((i + 1, 10), float(i))) for i in range(20)]
    stats = StreamStats()
    buckets = list(iter_buckets(iter(tensors), bucket_bytes=400, stats=stats))
    assert [n for b in buckets for n in b.names] == [n for n, _ in tensors]
    for b in buckets:
        assert b.nbytes <= 400 or len(b.tensors) == 1
    assert stats.buckets == len(buckets) and stats.tensors == 20
    assert list(iter_buckets(iter(tensors), keep=False)) == []


def test_misaligned_tensor_opens_a_bucket() -> None:
    """An odd-sized fp8 tensor must not put an fp32 tensor at an unaligned byte offset."""
    tensors = [("a", torch.zeros(3, dtype=torch.float8_e4m3fn)), ("b", torch.zeros(2))]
    buckets = list(iter_buckets(iter(tensors), bucket_bytes=1 << 20))
    assert [b.names for b in buckets] == [["a"], ["b"]]


def test_flatten_matches_sglang_layout() -> None:
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    named = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(4).to(torch.bfloat16)),
        ("c", torch.randn(2, 2).to(torch.float8_e4m3fn)),
    ]
    assert torch.equal(flatten(named), FlattenedTensorBucket(named).get_flattened_tensor())


def test_checksum_mismatch_names_the_tensor() -> None:
    named = [("a", torch.randn(10)), ("b", torch.randn(10))]
    sent = checksums(named)
    held = dict(sent)
    compare_checksums(sent, held, "e0")
    b = named[1][1].clone()
    b[3] = torch.nextafter(b[3], torch.tensor(float("inf")))  # one ulp
    held["b"] = checksums([("b", b)])["b"]
    with pytest.raises(WeightIntegrityError, match="'b' differs on engine e0"):
        compare_checksums(sent, held, "e0")
    with pytest.raises(WeightIntegrityError, match="'a' was sent but is missing"):
        compare_checksums(sent, {"b": sent["b"]}, "e0")


def test_conversion_error_drains_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """An FP8 bound violation on the sender must not stop the iteration (the other ranks are
    in the same gathers): the stream is drained, the error names the tensor, and the bucket
    holding it is never yielded (the per-bucket check runs before the bucket leaves)."""
    bad_name = "model.layers.2.self_attn.q_proj.weight"
    real = fp8.error_ratio_max

    def ratio(name: str, *args, **kwargs) -> torch.Tensor:
        r = real(name, *args, **kwargs)
        return r + 1.5 if name == bad_name else r

    monkeypatch.setattr(fp8, "error_ratio_max", ratio)
    consumed = []

    def source():
        for i in range(4):
            consumed.append(i)
            yield f"model.layers.{i}.self_attn.q_proj.weight", torch.randn(8, 8)

    stats = StreamStats()
    sent = [
        n
        for b in iter_buckets(source(), use_fp8=True, fp8_check=True, stats=stats, bucket_bytes=70)
        for n in b.names
    ]
    assert consumed == [0, 1, 2, 3] and stats.tensors_seen == 4
    assert stats.error is not None and bad_name in stats.error
    assert bad_name not in sent and "model.layers.0.self_attn.q_proj.weight" in sent


def test_fp8_bound_is_read_once_per_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """The e4m3 bound check reads the device once per bucket (not once per weight), and the
    worst ratio it reports equals the per-weight check of each weight (`check_dequantised`)."""
    calls = []
    real = fp8.check_ratios

    def counting(named):
        calls.append([n for n, _ in named])
        return real(named)

    monkeypatch.setattr(fp8, "check_ratios", counting)
    g = torch.Generator().manual_seed(0)
    weights = [
        (f"model.layers.{i}.mlp.experts.0.up_proj.weight", torch.randn(128, 128, generator=g))
        for i in range(6)
    ]
    stats = StreamStats()
    # ~2 quantised weights (16 KiB e4m3 + 4 B scale each) per bucket.
    buckets = list(
        iter_buckets(iter(weights), use_fp8=True, fp8_check=True, stats=stats, bucket_bytes=40000)
    )
    assert stats.error is None and 1 < len(buckets) < len(weights)
    assert len(calls) == len(buckets)
    assert sorted(n for c in calls for n in c) == sorted(n for n, _ in weights)
    expected = max(fp8.check_dequantised(n, x, *fp8.quantise_blockwise(x)) for n, x in weights)
    assert stats.fp8_worst_error_ratio == expected
