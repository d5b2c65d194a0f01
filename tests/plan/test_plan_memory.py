"""The planner's memory estimate is within 25% of the measured CPU peak of a real training step.

The tiny MoE is trained for two optimizer steps on one gloo rank through the real path
(`Policy.build(cfg)`, `Policy.update`) with a token budget where activations are most of the
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
        from megatron_gspo.plan import make_plan
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
