"""Wire-level checks against SGLang's own classes: bodies, payloads, checksums, samples."""

from __future__ import annotations

import math

import pydantic
import pytest
import torch

from megatron_gspo.engines import wire as proto
from megatron_gspo.engines.types import (
    Sample,
    SampleValidationError,
    SamplingParams,
    build_sample,
)
from megatron_gspo.engines.weight_group import flatten_for_broadcast


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(max_new_tokens=8),
        SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20, seed=3),
        SamplingParams(max_new_tokens=1, temperature=0.0, stop_token_ids=(2, 5), min_p=0.1),
        SamplingParams(max_new_tokens=16, ignore_eos=True, seed=0),
    ],
)
def test_generate_bodies_pass_sglang_validation(sp):
    prompts = [[1, 2, 3], [4, 5]]
    body = proto.generate_body(
        [p for p in prompts for _ in range(2)],
        [sp.to_sglang(seed=sp.sample_seed(i, j)) for i in range(2) for j in range(2)],
        [f"r-{i}-{j}" for i in range(2) for j in range(2)],
    )
    proto.validate_generate_body(body, vocab_size=128)
    native = proto.generate_body_native_n(prompts, sp.to_sglang(), n=3)
    proto.validate_generate_body(native, vocab_size=128)
    single = proto.generate_body_single(prompts[0], sp.to_sglang(seed=sp.sample_seed(0, 0)), "r")
    proto.validate_generate_body(single, vocab_size=128)


def test_validation_rejects_what_sglang_rejects():
    body = proto.generate_body([[1, 2]], [{"max_tokens": 3}], ["r"])
    with pytest.raises(ValueError, match="max_tokens"):
        proto.validate_generate_body(body)
    with pytest.raises(ValueError):  # duplicate rids: GenerateReqInput normalisation refuses
        proto.validate_generate_body(proto.generate_body([[1], [2]], [{}, {}], ["x", "x"]))
    with pytest.raises(pydantic.ValidationError):  # a string where SGLang wants an int
        proto.validate_control_body(
            "/init_weights_update_group",
            {"master_address": "a", "master_port": "x", "rank_offset": 1, "world_size": 2},
        )


def test_seeds_differ_per_sample():
    sp = SamplingParams(seed=7)
    seeds = {sp.sample_seed(i, j) for i in range(50) for j in range(16)}
    assert len(seeds) == 50 * 16
    assert SamplingParams().sample_seed(0, 0) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_weight_payload_round_trips_bitwise(dtype):
    g = torch.Generator().manual_seed(0)
    named = [
        ("model.layers.0.mlp.experts.0.down_proj.weight", torch.randn(32, 64, generator=g)),
        ("model.norm.weight", torch.randn(64, generator=g)),
        ("lm_head.weight", torch.randn(128, 64, generator=g)),
    ]
    named = [(n, t.to(dtype)) for n, t in named]
    if dtype == torch.float8_e4m3fn:  # block-FP8 weights travel with their fp32 scales
        named.append(("lm_head.weight_scale_inv", torch.rand(1, 1, generator=g)))
    payloads, bucket = proto.serialize_flattened_bucket(named, tp_size=2)
    assert len(payloads) == 2 and all(isinstance(p, str) for p in payloads)
    for payload in payloads:
        got = proto.deserialize_named_tensors(payload)
        assert [n for n, _ in got] == [n for n, _ in named]
        for (_, a), (_, b) in zip(named, got):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # The trainer-side flattening (no SGLang import) is byte-identical to SGLang's bucket.
    assert torch.equal(flatten_for_broadcast(named), bucket.get_flattened_tensor())


def test_flatten_for_broadcast_refuses_misaligned_bucket():
    with pytest.raises(ValueError, match="item size"):
        flatten_for_broadcast([("a", torch.zeros(3, dtype=torch.bfloat16)), ("b", torch.zeros(2))])


def test_tensor_checksum_matches_sglang():
    from sglang.srt.utils.weight_checker import _hash_tensor, overall_checksum

    ts = {"a": torch.randn(7, 5), "b": torch.randn(3).to(torch.bfloat16)}
    sums = {k: proto.tensor_checksum(t) for k, t in ts.items()}
    assert sums == {k: _hash_tensor(t) for k, t in ts.items()}
    assert proto.overall_checksum(sums) == overall_checksum(sums)
    assert proto.tensor_checksum(ts["a"] + 1e-3) != sums["a"]


def _sample(**kw) -> Sample:
    base = dict(
        prompt_ids=[1, 2],
        output_ids=[5, 2],
        token_logprobs=[[-1.0, 5, None], [-0.5, 2, None]],
        finish_reason={"type": "stop", "matched": 2},
        weight_version="v1",
        engine_id="e",
        prompt_index=0,
        sample_index=1,
    )
    return build_sample(**{**base, **kw})


def test_build_sample_checks_ids_and_logprobs():
    s = _sample()
    assert s.logprobs == [-1.0, -0.5] and s.logprob_mask == [True, True]
    assert s.finish_reason == "stop" and not s.truncated and s.key == (0, 1)
    assert _sample(finish_reason={"type": "length", "length": 2}).truncated
    with pytest.raises(SampleValidationError, match="2 output ids but 1"):
        _sample(token_logprobs=[[-1.0, 5, None]])
    with pytest.raises(SampleValidationError, match="token 6"):
        _sample(token_logprobs=[[-1.0, 6, None], [-0.5, 2, None]])
    masked = _sample(token_logprobs=[[float("nan"), 5, None], [None, 2, None]])
    assert masked.logprob_mask == [False, False] and masked.num_valid_logprobs == 0
    assert all(math.isfinite(x) for x in masked.logprobs)


def test_error_message_reads_every_sglang_envelope():
    assert proto.error_message(b'{"error": {"message": "bad rid"}}') == "bad rid"
    assert proto.error_message(b'{"error": "unknown field `x`"}') == "unknown field `x`"
    assert proto.error_message(b'{"object":"error","message":"m"}') == "m"
    assert proto.error_message(b'{"success": false, "message": "no session"}') == "no session"
    assert proto.error_message(b"Cache not flushed") == "Cache not flushed"


def test_a_body_that_is_not_sglang_json_is_one_short_line():
    """An engine URL that is a plain web server (issue 40): its HTML page named by its title,
    not printed (was: the raw page, over ten lines, in the drop message)."""
    page = (
        b"<!DOCTYPE html>\n<html>\n<head>\n<title>Directory listing\n for /</title>\n</head>\n"
        + b"<body>\n" + b"<li><a href='x'>x</a></li>\n" * 40 + b"</body>\n</html>\n"
    )
    msg = proto.error_message(page)
    assert msg == "an HTML page titled 'Directory listing for /', not an SGLang answer"
    long = proto.error_message(b"line one\nline two\n" + b"x" * 500)
    assert "\n" not in long and long.startswith("line one line two x") and len(long) <= 203
