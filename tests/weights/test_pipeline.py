"""The sender's double buffering (`weights.pipeline.SendPipeline`) and per-bucket host copies.

Single process, no model: a recording transport stands in for the engines.
"""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_gspo.engines.weight_shards import EngineChecksums, EngineLayout
from megatron_gspo.engines.wire import tensor_checksum
from megatron_gspo.weights.checksum import host_views
from megatron_gspo.weights.pipeline import SendPipeline
from megatron_gspo.weights.stream import Bucket, StreamStats
from megatron_gspo.weights.transports import Transport


class Recorder(Transport):
    """Records (bucket index, last, thread) per send; can block a send until released."""

    def __init__(self, block_first: threading.Event | None = None, fail_at: int = -1) -> None:
        super().__init__([])
        self.sent: list[tuple[int, bool, str]] = []
        self.block_first = block_first
        self.fail_at = fail_at

    def begin(self, version: str) -> None: ...

    def finish(self, version: str) -> None: ...

    def send(self, bucket: Bucket, *, version: str, last: bool) -> None:
        if bucket.index == 0 and self.block_first is not None:
            assert self.block_first.wait(10), "the caller never produced the next bucket"
        if bucket.index == self.fail_at:
            raise RuntimeError(f"engine refused bucket {bucket.index}")
        self.sent.append((bucket.index, last, threading.current_thread().name))


def _buckets(n: int) -> list[Bucket]:
    out = []
    for i in range(n):
        b = Bucket(index=i)
        b.add(f"model.layers.{i}.input_layernorm.weight", torch.full((4,), float(i)))
        out.append(b)
    return out


def test_next_bucket_is_prepared_while_the_current_one_is_sent() -> None:
    """Bucket 0's send blocks until the caller has moved on to bucket 1: this only finishes
    if the send runs on another thread (with sends inline it would wait for itself)."""
    released = threading.Event()
    transport = Recorder(block_first=released)
    pipe = SendPipeline(transport, sums=None, stats=StreamStats(), overlap=True)
    buckets = _buckets(3)
    pipe.submit(buckets[0], version="1", last=False)
    released.set()  # "export of bucket 1 happens here", while bucket 0 is in flight
    pipe.submit(buckets[1], version="1", last=False)
    pipe.submit(buckets[2], version="1", last=True)
    pipe.close()
    assert pipe.error is None
    assert [(i, last) for i, last, _ in transport.sent] == [(0, False), (1, False), (2, True)]
    assert {t for _, _, t in transport.sent} != {threading.current_thread().name}
    assert set(pipe.stats.seconds) >= {"send", "checksum", "drain"}


@pytest.mark.parametrize("overlap", [True, False])
def test_checksums_and_errors_follow_bucket_order(overlap: bool) -> None:
    """The per-bucket checksums equal SGLang's per-tensor hash of each tensor sent; a failed
    send stops the later ones and is reported once."""
    sums = EngineChecksums([EngineLayout(1, 1, 1, 1, 1)])
    transport = Recorder(fail_at=2)
    pipe = SendPipeline(transport, sums=sums, stats=StreamStats(), overlap=overlap)
    buckets = _buckets(4)
    for b in buckets:
        pipe.submit(b, version="1", last=b.index == 3)
    pipe.close()
    assert [i for i, _, _ in transport.sent] == [0, 1]
    assert isinstance(pipe.error, RuntimeError) and "bucket 2" in str(pipe.error)
    expected = {n: tensor_checksum(t) for b in buckets[:3] for n, t in b.tensors}
    assert sums.hf == expected  # bucket 2 was hashed before its send failed; 3 never was


def test_host_views_are_bitwise_the_bucket() -> None:
    """`host_views` through the flattened-bucket path (what a device bucket takes) gives back
    every tensor bitwise, mixed dtypes and shapes included."""
    from megatron_gspo.engines import weight_group

    named = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(4, 2).to(torch.bfloat16)),
        ("c", torch.randn(2, 2).to(torch.float8_e4m3fn)),
    ]
    assert host_views(named) == named  # host tensors: no copy at all
    views = weight_group.flat_views(named)
    assert [n for n, _ in views] == ["a", "b", "c"]
    for (_, t), (_, v) in zip(named, views, strict=True):
        assert v.dtype == t.dtype and v.shape == t.shape
        assert torch.equal(v.view(torch.uint8), t.view(torch.uint8))


def _layer() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    p = "model.layers.0."
    names = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "input_layernorm.weight",
        "mlp.experts.0.gate_proj.weight",
        "mlp.experts.0.up_proj.weight",
        "mlp.experts.1.gate_proj.weight",
        "mlp.experts.1.up_proj.weight",
        "mlp.experts.0.down_proj.weight",
        "mlp.experts.1.down_proj.weight",
    ]
    return [(p + n, torch.randn(8, 4, generator=g)) for n in names]


@pytest.mark.parametrize("naming", ["hf", "sglang"])
def test_one_naming_hashes_each_byte_once(monkeypatch: pytest.MonkeyPatch, naming: str) -> None:
    """Once the engines' naming is known, the sender hashes every byte it sent once (not once
    per naming and again per rank), and the checksums are those of hashing for both."""
    from sglang.srt.utils import weight_checker

    named = _layer()
    both = EngineChecksums([EngineLayout(1, 1, 1, 1, 1)])
    for n, t in named:
        both.add(n, t)
    both.ranks(1)
    hashed: list[int] = []
    real = weight_checker._hash_tensor

    def counting(t: torch.Tensor) -> str:  # SGLang's own hash, counted
        hashed.append(t.numel() * t.element_size())
        return real(t)

    monkeypatch.setattr(weight_checker, "_hash_tensor", counting)
    one = EngineChecksums([EngineLayout(1, 1, 1, 1, 1)], namings=frozenset({naming}))
    for n, t in named:
        one.add(n, t)
    if naming == "sglang":
        one.ranks(1)
    assert sum(hashed) == sum(t.numel() * t.element_size() for _, t in named)
    if naming == "hf":
        assert one.hf == both.hf == {n: tensor_checksum(t) for n, t in named}
    else:
        assert one.ranks(1) == both.ranks(1)
        assert "model.layers.0.mlp.experts.w13_weight" in one.ranks(1)[0]
