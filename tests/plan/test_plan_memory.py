"""The planner's memory estimate is within 25% of the measured CPU peak of a real training step.

The tiny MoE is trained for two optimizer steps on one gloo rank through the real path
(`Policy.build`, `Policy.update`) with a token budget where activations are most of the
memory (512 tokens per micro-batch: about three quarters of the estimate). The peak is measured
with `torch.profiler.profile(profile_memory=True)`: the CPU allocator reports every allocation
and free (signed sizes, with timestamps) and their running sum's maximum is the peak tensor
memory of the step (method and details: plan_memory_ranks.py).

Scope of the comparison: what the planner estimates per rank, weights + gradient buffer +
optimizer state (Adam, fp32) + activations of the in-flight micro-batch; not the process
overhead (CUDA context; on CPU: Python, imports) nor the engine. The planner models flash
attention (no [t, t] scores), so the run swaps the CPU attention stand-in, which materialises
dense scores, for torch's CPU flash kernel. The check can fail: the same bound refuses the
estimate with its activations doubled or halved (a planted factor-2 error).
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.testing.harness import spawn_ranks
from tests.plan.test_plan import _python

pytestmark = pytest.mark.multirank
TOKENS, SEQ_LEN, NUM_SEQS = 512, 128, 4  # one packed micro-batch of 4 sequences per step
OVERRIDES = [
    "model.dtype=fp32",
    "data.train_path=unused.jsonl",
    "rl.prompts_per_rollout=2",
    "rl.group_size=2",
    "rl.mini_batches_per_rollout=1",
    "rl.pi_old=engine",
    "optim.use_distributed_optimizer=false",
    f"train.micro_batch_tokens={TOKENS}",
    "data.max_prompt_tokens=8",
    f"rollout.max_new_tokens={SEQ_LEN - 8}",
    "train.routing_flip_every=0",
]
TOLERANCE = 0.25


def _measure(rank: int, world: int, hf_dir: str) -> dict[str, float]:
    from tests.plan.plan_memory_ranks import measure_step_peak

    return measure_step_peak(rank, world, hf_dir, OVERRIDES, SEQ_LEN, NUM_SEQS)


def _estimate(hf_dir: Path) -> dict[str, float]:
    """The planner's per-rank estimate for the same config on 1 x 1 (its own process: the
    meta-device count needs a process without a process group)."""
    code = textwrap.dedent(
        f"""
        import dataclasses, json
        from megatron_gspo.config import load_config
        from megatron_gspo.plan.planner import make_plan
        cfg = load_config(None, {[f"model.hf_path={hf_dir}", *OVERRIDES]!r})
        plan = make_plan(cfg, nodes=1, gpus_per_node=1, gpu_mem_gb=80)
        print(json.dumps(dict(dataclasses.asdict(plan.memory), micro_batches=plan.micro_batches)))
        """
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _within(estimate: float, measured: float) -> bool:
    return abs(estimate / measured - 1) <= TOLERANCE


def test_memory_estimate_within_25_percent_of_measured_cpu_peak(tmp_path: Path) -> None:
    hf_dir = save_tiny_hf_checkpoint(tmp_path / "model")
    measured = spawn_ranks(_measure, 1, str(hf_dir))[0]
    est = _estimate(hf_dir)
    assert measured["micro_batches"] == est["micro_batches"] == 1
    static = est["weights"] + est["grads"] + est["optimizer"]
    estimate = static + est["activations"]
    report = (
        f"measured peak {measured['peak'] / 1e6:.2f} MB (weights+grad buffer "
        f"{measured['static'] / 1e6:.2f} MB + step {measured['step_peak'] / 1e6:.2f} MB), "
        f"estimate {estimate / 1e6:.2f} MB (state {static / 1e6:.2f} + activations "
        f"{est['activations'] / 1e6:.2f}), ratio {estimate / measured['peak']:.2f}"
    )
    print(report)
    # the parameters' storages are exactly what the planner counts for weights + grads
    assert measured["static"] == est["weights"] + est["grads"], report
    assert est["activations"] > static, "the token budget must make activations matter"
    assert _within(estimate, measured["peak"]), report
    # a factor-2 error in the activations (the largest part) would not pass the same bound
    assert not _within(static + 2 * est["activations"], measured["peak"]), report
    assert not _within(static + est["activations"] / 2, measured["peak"]), report


def _fused_head_tensor_peak(tokens: int, vocab_shard: int, hidden: int) -> int:
    """Exact peak bytes of live tensors above the inputs during forward + backward of the fused
    LM head with the trainer's chunks, bf16 (FakeTensorMode + MemTracker: shapes only, no
    compute, so the planner's own sizes can be measured)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from megatron_gspo.algo import fused_lm_head_logprobs
    from megatron_gspo.megatron.step import LOGPROB_CHUNK, VOCAB_CHUNK

    with FakeTensorMode():
        h = torch.randn(tokens, hidden, dtype=torch.bfloat16).requires_grad_(True)
        w = torch.randn(vocab_shard, hidden, dtype=torch.bfloat16).requires_grad_(True)
        target = torch.randint(0, vocab_shard, (tokens,))
        tracker = MemTracker()
        tracker.track_external(h, w, target)
        with tracker:
            logp, ent = fused_lm_head_logprobs(
                h, w, target, chunk_size=LOGPROB_CHUNK, vocab_chunk=VOCAB_CHUNK, with_entropy=True
            )
            assert ent is not None
            (logp.sum() + ent.sum()).backward()
        snap = tracker.get_tracker_snapshot("peak")
    inputs = sum(x.numel() * x.element_size() for x in (h, w, target))
    return int(sum(d["Total"] for d in snap.values())) - inputs


@pytest.mark.parametrize("tp", [1, 2])
def test_lm_head_term_follows_the_fused_head(tp: int) -> None:
    """The planner's LM-head term (model.fused_lm_head, the default) against the exact tensor
    peak of the fused op on one rank's vocab shard: several token and vocab chunks (T = 2 C,
    V/tp > Vc), a hidden size where the weight gradient is a visible part. The unfused formula
    (6 T V/tp) would not pass the same bound."""
    from types import SimpleNamespace as NS

    from megatron_gspo.plan.memory import _lm_head

    tokens, vocab, hidden = 2048, 40_000, 512
    measured = _fused_head_tensor_peak(tokens, vocab // tp, hidden)
    layout = NS(cp=1, tp=tp)

    def est(fused: bool) -> float:
        cfg = NS(train=NS(micro_batch_tokens=tokens), model=NS(fused_lm_head=fused))
        return _lm_head(cfg, layout, 2, hidden, vocab)  # type: ignore[arg-type]

    report = (
        f"tp={tp}: estimate {est(True) / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB, "
        f"ratio {est(True) / measured:.3f}"
    )
    print(report)
    assert _within(est(True), measured), report
    assert not _within(est(False), measured), report
    # the previous term (three fp32 [C, Vc] blocks at once, 12 C Vc) was 38% over at tp=1
    old = 12 * 1024 * min(vocab // tp, 8192) + 6 * tokens * hidden + 2 * (vocab // tp) * hidden
    assert not _within(old, measured), report


def test_planners_sharing_a_counts_cache_keep_each_others_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two planners counting different models at once (the rehearsals run two at a time, and
    so may two Slurm jobs with one cache): both entries are in the cache afterwards, and a
    third call reads them without counting (was: the later write dropped the earlier entry)."""
    import threading

    from megatron_gspo.layout import Layout
    from megatron_gspo.plan import memory as plan_memory

    both_counting = threading.Barrier(2)
    counted: list[str] = []

    def fake_count(hf_dir, layout, world_size):  # both finish counting at the same time
        counted.append(str(hf_dir))
        both_counting.wait(timeout=30)
        n = 10 if str(hf_dir).endswith("a") else 20
        return [plan_memory.StageParams(**_stage_fields(n))]

    monkeypatch.setattr(plan_memory, "count_params", fake_count)
    dirs = []
    for name, layers in (("a", 1), ("b", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
        dirs.append(tmp_path / name)
    cache = tmp_path / "counts.json"
    threads = [
        threading.Thread(target=plan_memory.cached_count_params, args=(d, Layout(), 2, cache))
        for d in dirs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(json.loads(cache.read_text())) == 2
    counted.clear()
    for d, n in zip(dirs, (10, 20), strict=True):
        (got,) = plan_memory.cached_count_params(d, Layout(), 2, cache)
        assert got == plan_memory.StageParams(**_stage_fields(n))
    assert counted == []


def _stage_fields(n: int) -> dict[str, int]:
    from megatron_gspo.plan.memory import StageParams

    return {f.name: n for f in dataclasses.fields(StageParams)}


def test_sync_estimate_counts_one_tp_rank_per_engine_gpu_in_sglang_layout() -> None:
    """In SGLang's own layout an engine GPU receives its rank's part (1/TP of the bytes); with
    HF names every TP rank loads every tensor. The 30B BF16 recipe: TP-2 engines, tensor."""
    from megatron_gspo.config import load_config
    from megatron_gspo.plan.memory import sync_estimate
    from megatron_gspo.plan.planner import _hf_config

    recipe = "examples/recipes/qwen3_30b_a3b_bf16.yaml"
    hf = _hf_config("examples/recipes/qwen3-30b-a3b")
    got = {}
    for layout in ("auto", "hf"):
        cfg = load_config(recipe, [f"weights.layout={layout}"])
        got[layout] = sync_estimate(cfg, hf, 25.0, gpus_per_node=8, trainer_world=8)
    assert cfg.rollout.launch is not None and cfg.rollout.launch.tp_size == 2
    assert got["hf"]["engine_gpu_bytes"] == got["hf"]["bytes"] > 60e9  # 61.1 GB in bf16
    assert got["auto"]["engine_gpu_bytes"] == got["auto"]["bytes"] / 2
    assert got["auto"]["seconds"] == got["hf"]["seconds"] / 2
