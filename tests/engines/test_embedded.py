"""The embedded engine behind SGLang's app, driven through `SGLangClient`.

Log-probs are checked against an independent full-forward rescoring; weight updates by every
transport are checked against a HF model holding the new weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_gspo.dist import free_port
from megatron_gspo.engines.protocols import EngineError
from megatron_gspo.engines.types import SamplingParams
from megatron_gspo.engines.wire import tensor_checksum

from .helpers import abs_logp_diff, greedy, hf_model, rescore, wait_generating

pytestmark = pytest.mark.timeout(240)  # a hung server must fail, not stall CI

PROMPTS = [[1, 17, 33, 9], [1, 5], [1, 99, 98, 97, 96, 3]]


@pytest.fixture(scope="module")
def ref_a(ckpt_a):
    return hf_model(ckpt_a)


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(max_new_tokens=12, temperature=0.7, top_k=20, top_p=0.9, seed=1),
        SamplingParams(max_new_tokens=12, temperature=1.3, seed=2),
        SamplingParams(max_new_tokens=6, temperature=0.0),
    ],
    ids=["t0.7-topk-topp", "t1.3", "greedy"],
)
def test_logprobs_match_independent_rescoring(client_a, ref_a, sp):
    res = client_a.generate(PROMPTS, sp, n=2)
    assert [s.key for s in res.samples] == [(i, j) for i in range(3) for j in range(2)]
    t = sp.temperature if sp.temperature > 0 else 1.0  # greedy log-probs are T=1 (SGLang)
    trainer = [rescore(ref_a, s.prompt_ids, s.response_ids, t) for s in res.samples]
    for s, ref in zip(res.samples, trainer):
        assert s.prompt_ids == PROMPTS[s.prompt_index]
        assert len(s.logprobs) == len(s.response_ids) > 0
        torch.testing.assert_close(
            torch.tensor(s.logprobs, dtype=torch.float64),
            torch.tensor(ref, dtype=torch.float64),
            rtol=0,
            atol=2e-5,
        )
        assert s.weight_version == "default" and s.engine_id == client_a.config.engine_urls[0]
    assert abs_logp_diff(res.samples, trainer) < 2e-5
    # A wrong temperature convention in the trainer shows up in the mismatch metric.
    wrong = [rescore(ref_a, s.prompt_ids, s.response_ids, 1.0 if t != 1.0 else 2.0)
             for s in res.samples]  # fmt: skip
    if sp.temperature not in (0.0, 1.0):
        assert abs_logp_diff(res.samples, wrong) > 1e-2


@torch.no_grad()
def test_logprobs_match_the_trainers_kernel_at_temperature_0_7(client_a, ref_a):
    """pi_old at T != 1: the engine samples at rollout.temperature=0.7 and the trainer's
    log-prob kernel (`algo.logprobs.vocab_parallel_logprobs`, what the Megatron step calls with
    rollout.temperature) over the reference model's float64 logits of prompt + response gives
    the engine's log-prob of every response token; at T=1 it would not."""
    from megatron_gspo.algo.logprobs import vocab_parallel_logprobs
    from megatron_gspo.rollout.config import RolloutConfig

    assert RolloutConfig.__dataclass_fields__["top_p"].default == 1.0  # no truncation to undo
    sp = SamplingParams(max_new_tokens=10, temperature=0.7, seed=4)
    res = client_a.generate(PROMPTS, sp, n=2)
    for s in res.samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = ref_a(input_ids=ids).logits[0].double()
        rows = logits[len(s.prompt_ids) - 1 : -1]
        target = torch.tensor(s.response_ids)
        engine = torch.tensor(s.logprobs, dtype=torch.float64)
        trainer, _ = vocab_parallel_logprobs(rows, target, temperature=0.7)
        torch.testing.assert_close(trainer, engine, rtol=0, atol=2e-5)
        untempered, _ = vocab_parallel_logprobs(rows, target, temperature=1.0)
        assert (untempered - engine).abs().max() > 1e-2


def test_seeded_sampling_is_reproducible_and_samples_differ(client_a):
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    a = client_a.generate(PROMPTS[:1], sp, n=4)
    b = client_a.generate(PROMPTS[:1], sp, n=4)
    assert [s.response_ids for s in a.samples] == [s.response_ids for s in b.samples]
    assert len({tuple(s.response_ids) for s in a.samples}) > 1
    assert all(s.finish_reason == "length" and s.truncated for s in a.samples)
    assert a.stats.num_truncated == 4


def test_stop_token_is_kept_and_not_truncated(client_a, ref_a):
    first = greedy(ref_a, PROMPTS[0], 3)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(first[2],))
    (s,) = client_a.generate(PROMPTS[:1], sp).samples
    assert s.finish_reason == "stop" and not s.truncated
    assert s.response_ids == first[: first.index(first[2]) + 1]
    assert s.meta["finish_reason_detail"] == {"type": "stop", "matched": first[2]}


def test_4xx_carries_sglang_message(client_a):
    with pytest.raises(EngineError, match="out of vocabulary") as e:
        client_a.generate([[1, 500]], SamplingParams(max_new_tokens=2))
    assert e.value.status == 400
    # Weight updates outside a session: SGLang's 400 and its message.
    with pytest.raises(EngineError, match="must run between begin_weight_update"):
        client_a.update_weights_from_tensor([("lm_head.weight", torch.zeros(128, 64))])
    client_a.begin_weight_update()
    with pytest.raises(EngineError, match="already open"):
        client_a.begin_weight_update()
    client_a.end_weight_update()
    with pytest.raises(EngineError, match="no weight-update session"):
        client_a.end_weight_update()


def _check_engine_holds(client, ckpt, weights, prompt=PROMPTS[2]):
    """Greedy output and log-probs of the engine equal a HF model holding `weights`."""
    ref = hf_model(dict(weights), ckpt)
    (s,) = client.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0,
                                                    ignore_eos=True)).samples  # fmt: skip
    assert s.response_ids == greedy(ref, prompt, 6)
    torch.testing.assert_close(
        torch.tensor(s.logprobs, dtype=torch.float64),
        torch.tensor(rescore(ref, prompt, s.response_ids), dtype=torch.float64),
        rtol=0,
        atol=2e-5,
    )
    sums = next(iter(client.weights_checksum().values()))["ranks"][0]["checksums"]
    assert sums["lm_head.weight"] == tensor_checksum(weights["lm_head.weight"])
    return s


def _restore(client, ckpt_a):
    client.update_weights_from_disk(ckpt_a, weight_version="default")


def test_update_weights_from_tensor(client_a, ckpt_a, weights_a, weights_b):
    before = _check_engine_holds(client_a, ckpt_a, weights_a)
    named = [(k, v.to(torch.bfloat16).float()) for k, v in sorted(weights_b.items())]
    with client_a.weight_update_session(weight_version="step-1"):
        client_a.update_weights_from_tensor(named[:10])
        client_a.update_weights_from_tensor(named[10:])  # buckets do not move the version
        assert set(client_a.weight_version().values()) == {"default"}
    assert set(client_a.weight_version().values()) == {"step-1"}
    after = _check_engine_holds(client_a, ckpt_a, dict(named))
    assert after.weight_version == "step-1" and after.logprobs != before.logprobs
    _restore(client_a, ckpt_a)


def test_update_weights_in_sglangs_own_layout(client_a, ckpt_a, weights_b):
    """SGLang's fused tensors (`load_format="direct"`, `engines.weight_layout`) land in the
    embedded engine as the HF-named push does: every tensor it holds byte-identical."""
    from transformers import AutoConfig

    from megatron_gspo.engines.weight_layout import fused_stream
    from megatron_gspo.engines.weight_shards import EngineLayout

    named = [(k, v.to(torch.bfloat16).float()) for k, v in sorted(weights_b.items())]
    fused = list(fused_stream(named))
    assert len(fused) < len(named)
    layout = EngineLayout.of(AutoConfig.from_pretrained(ckpt_a), 1)
    with client_a.weight_update_session(weight_version="direct-1"):
        client_a.update_weights_from_tensor(fused[:5], layout=layout)
        client_a.update_weights_from_tensor(fused[5:], layout=layout)
    sums = next(iter(client_a.weights_checksum().values()))["ranks"][0]["checksums"]
    assert sums == {n: tensor_checksum(t) for n, t in named}
    _check_engine_holds(client_a, ckpt_a, dict(named))
    _restore(client_a, ckpt_a)


def test_update_weights_from_disk(client_a, ckpt_a, ckpt_b, weights_b):
    client_a.update_weights_from_disk(ckpt_b, weight_version="disk-1")
    assert set(client_a.weight_version().values()) == {"disk-1"}
    assert _check_engine_holds(client_a, ckpt_a, weights_b).weight_version == "disk-1"
    _restore(client_a, ckpt_a)
    assert set(client_a.weight_version().values()) == {"default"}


TRAINER = textwrap.dedent(
    """
    import sys, json
    import torch
    from safetensors.torch import load_file
    from megatron_gspo.engines.weight_group import (
        init_weight_update_group, flatten_for_broadcast)
    port, ckpt = int(sys.argv[1]), sys.argv[2]
    pg = init_weight_update_group(master_address="127.0.0.1", master_port=port,
                                  world_size=2, group_name="wug", backend="gloo")
    print("joined", flush=True)
    named = sorted(load_file(ckpt + "/model.safetensors").items())
    assert sys.stdin.readline().strip() == "bucket"
    torch.distributed.broadcast(flatten_for_broadcast(named), src=0, group=pg)
    print("sent", flush=True)
    assert sys.stdin.readline().strip() == "per-tensor"
    for _, t in named[:3]:
        torch.distributed.broadcast(torch.zeros_like(t), src=0, group=pg)
    print("sent", flush=True)
    sys.stdin.readline()
    """
)


def test_update_weights_from_distributed(client_a, ckpt_a, ckpt_b, weights_b):
    port = free_port()
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(port), ckpt_b],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        joined = client_a.init_weights_update_group(
            "127.0.0.1", port, group_name="wug", backend="gloo"
        )
        assert trainer.stdout.readline().strip() == "joined"
        joined.result(timeout=60)
        named = sorted(weights_b.items())
        with client_a.weight_update_session():
            done = client_a.update_weights_from_distributed(
                [n for n, _ in named],
                [t.dtype for _, t in named],
                [t.shape for _, t in named],
                group_name="wug",
                weight_version="dist-1",
            )
            trainer.stdin.write("bucket\n")
            trainer.stdin.flush()
            assert trainer.stdout.readline().strip() == "sent"
            done.result(timeout=60)
        _check_engine_holds(client_a, ckpt_a, weights_b)
        assert set(client_a.weight_version().values()) == {"dist-1"}
        # Per-tensor broadcasts (no bucket): three tensors zeroed by the trainer.
        with client_a.weight_update_session():
            done = client_a.update_weights_from_distributed(
                [n for n, _ in named[:3]],
                [str(t.dtype) for _, t in named[:3]],
                [list(t.shape) for _, t in named[:3]],
                group_name="wug",
                flattened_bucket=False,
            )
            trainer.stdin.write("per-tensor\n")
            trainer.stdin.flush()
            assert trainer.stdout.readline().strip() == "sent"
            done.result(timeout=60)
        got = client_a.get_weights_by_name(named[0][0], truncate_size=2)
        assert torch.count_nonzero(torch.tensor(next(iter(got.values())))) == 0
        client_a.destroy_weights_update_group("wug")
    finally:
        trainer.stdin.write("bye\n")
        trainer.stdin.flush()
        trainer.wait(timeout=30)
        _restore(client_a, ckpt_a)
    assert trainer.returncode == 0


def test_control_calls(client_a, engine_a):
    assert all(client_a.health().values())
    client_a.flush_cache()
    client_a.release_memory(["weights", "kv_cache"])
    with pytest.raises(EngineError, match="memory released"):
        client_a.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    client_a.resume_memory()
    client_a.pause_generation("retract")
    client_a.continue_generation()
    client_a.abort()
    client_a.abort("no-such-rid")
    info = json.loads(
        __import__("urllib.request").request.urlopen(engine_a.url + "/model_info").read()
    )
    assert info["weight_version"] == "default"
    assert len(client_a.generate([[1, 2]], SamplingParams(max_new_tokens=1)).samples) == 1


def _generate_in_thread(client, prompts, sp, n=1):
    import threading

    out: dict = {}
    t = threading.Thread(target=lambda: out.update(res=client.generate(prompts, sp, n=n)))
    t.start()
    return t, out


def test_abort_and_pause_mid_generation(client_a, engine_a, ckpt_a, weights_b):
    long = SamplingParams(max_new_tokens=400, ignore_eos=True, seed=3)
    t, out = _generate_in_thread(client_a, [[1, 2], [1, 3]], long)
    wait_generating(engine_a, 2)
    client_a.abort()
    t.join(60)
    res = out["res"]
    assert [s.finish_reason for s in res.samples] == ["abort", "abort"]
    assert res.stats.num_aborted == 2 and all(s.truncated for s in res.samples)
    assert all(len(s.response_ids) == len(s.logprobs) < 400 for s in res.samples)

    # pause(retract) freezes running requests; weights can be pushed meanwhile (no writer
    # lock while paused, as in SGLang); continue resumes them with the new version.
    t, out = _generate_in_thread(client_a, [[1, 2]], SamplingParams(max_new_tokens=200, seed=4))
    wait_generating(engine_a, 1)
    client_a.pause_generation("retract")
    named = sorted(weights_b.items())
    with client_a.weight_update_session():
        client_a.update_weights_from_tensor(named, weight_version="paused-1", flush_cache=False)
    client_a.continue_generation()
    t.join(60)
    (s,) = out["res"].samples
    assert s.finish_reason in ("length", "stop") and s.weight_version == "paused-1"
    _restore(client_a, ckpt_a)


def test_original_logprob_option_gives_t1_logprobs(ckpt_a, ref_a):
    from sglang.srt.sampling.sampling_params import SamplingParams as SgSamplingParams

    from megatron_gspo.engines.embedded.model import HFPolicy

    policy = HFPolicy(ckpt_a, return_original_logprob=True)
    sp = SgSamplingParams(max_new_tokens=8, temperature=0.6, sampling_seed=9, ignore_eos=True)
    sp.normalize(None)
    out = policy.generate(PROMPTS[0], sp)
    ref_t1 = rescore(ref_a, PROMPTS[0], out.output_ids, 1.0)
    ref_t = rescore(ref_a, PROMPTS[0], out.output_ids, 0.6)
    torch.testing.assert_close(
        torch.tensor(out.logprobs, dtype=torch.float64),
        torch.tensor(ref_t1, dtype=torch.float64),
        rtol=0,
        atol=2e-5,
    )
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref_t)) > 1e-2


def test_aborted_samples_are_resubmitted_when_asked(engine_a):
    from megatron_gspo.engines.client import ClientConfig, SGLangClient

    client = SGLangClient(ClientConfig(engine_urls=[engine_a.url], resubmit_aborted=1))
    sp = SamplingParams(max_new_tokens=150, ignore_eos=True, seed=8)
    t, out = _generate_in_thread(client, [[1, 2], [1, 3]], sp)
    wait_generating(engine_a, 2)
    client.abort()
    t.join(60)
    res = out["res"]
    assert [s.key for s in res.samples] == [(0, 0), (1, 0)]
    assert [s.finish_reason for s in res.samples] == ["length", "length"]
    assert res.stats.num_resubmitted == 2 and res.stats.num_aborted == 0
    # Same seed from scratch: the resubmitted sample is the one an undisturbed call gives.
    clean = client.generate([[1, 2], [1, 3]], sp)
    assert [s.response_ids for s in clean.samples] == [s.response_ids for s in res.samples]


def test_retracted_request_continues_on_pushed_weights(
    client_a, engine_a, ckpt_a, ref_a, weights_b
):
    """After pause(retract) + weight push, the rest of a response is computed from scratch
    with the new weights (SGLang recomputes retracted requests); the start used the old."""
    prompt = [1, 40, 41]
    t, out = _generate_in_thread(
        client_a, [prompt], SamplingParams(max_new_tokens=200, ignore_eos=True, seed=6)
    )
    wait_generating(engine_a, 1)
    client_a.pause_generation("retract")
    with client_a.weight_update_session(weight_version="retract-1"):
        client_a.update_weights_from_tensor(sorted(weights_b.items()), flush_cache=False)
    client_a.continue_generation()
    t.join(60)
    (s,) = out["res"].samples
    _restore(client_a, ckpt_a)
    old = torch.tensor(rescore(ref_a, prompt, s.response_ids), dtype=torch.float64)
    ref_b = hf_model(dict(weights_b), ckpt_a)
    new = torch.tensor(rescore(ref_b, prompt, s.response_ids), dtype=torch.float64)
    got = torch.tensor(s.logprobs, dtype=torch.float64)
    k = int(((got - old).abs() < 2e-5).long().cumprod(0).sum())  # tokens made before the push
    assert 0 < k < len(got), "the push must land mid-response"
    torch.testing.assert_close(got[k:], new[k:], rtol=0, atol=2e-5)
    assert s.weight_version == "retract-1"
