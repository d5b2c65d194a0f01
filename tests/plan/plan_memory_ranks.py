"""Rank function of tests/plan/test_plan_memory.py: train the tiny MoE for two optimizer steps
through the real path (`Policy.build`) and measure the peak CPU tensor memory of the step.

Method (why the profiler): CPU allocations are not counted by torch by default, but with
`torch.profiler.profile(profile_memory=True)` every allocation and free of the CPU allocator is
recorded as a `[memory]` event with its signed size, including the ones made inside C++ (autograd
buffers, optimizer kernels) that a Python-level TorchDispatchMode would not see as creations.
The running sum of those events, in time order, is the tensor memory allocated since the
profiler started; its maximum is the peak.

Scope: what the planner estimates for one rank, i.e. weights + gradient buffer + optimizer
state + activations of the in-flight micro-batch. Python/import overhead is not a tensor and
not counted. The profiler starts after the build, so the model's parameters and megatron's
gradient buffer (allocated by the build) are counted from their storages; everything else
(Adam state, created lazily by the first step, and all activations) is allocated inside the
profiled window. What the build keeps besides the model (the bridge's HF copy, caches) is not
in the estimate and is therefore not counted either.
"""

from __future__ import annotations

from typing import Any

import torch

ATTN_SDPA = "sdpa"


def _flash_core_attention(
    self: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: Any,
    attention_mask: Any,
    attn_mask_type: Any = None,
    attention_bias: Any = None,
    packed_seq_params: Any = None,
) -> Any:
    """CPUCoreAttention.forward for TP=CP=1 through torch's fused SDPA, sequence by sequence.

    Why: the planner models flash attention (the GPU path), which keeps q, k, v and the output
    but never the [t, t] scores; the CPU stand-in materialises dense scores and masks over the
    whole packed micro-batch (quadratic in the token budget). torch's CPU flash kernel keeps
    what flash attention keeps, so the measured step holds what the planner estimates.
    """
    lengths, thd = self._layout(query.size(0), packed_seq_params)
    assert thd and self.cp_group.size() == 1, "test stand-in: packed sequences, CP=1"
    rep = self.heads // self.groups
    outs, start = [], 0
    for n in lengths:
        # [n, np, hn] -> [1, np, n, hn]
        q, k, v = (x[start : start + n].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=rep > 1
        )
        outs.append(o.squeeze(0).transpose(0, 1))
        start += n
    context = torch.cat(outs)
    return context.reshape(context.size(0), -1)


def measure_step_peak(
    rank: int, world: int, hf_dir: str, overrides: list[str], seq_len: int, num_seqs: int
) -> dict[str, float]:
    """Peak tensor bytes of two `Policy.update` calls (one mini-batch each), by part."""
    from megatron_gspo.config import load_config
    from megatron_gspo.megatron.cpu_attention import CPUCoreAttention
    from megatron_gspo.megatron.packing import TrainSequence
    from megatron_gspo.megatron.policy import Policy

    CPUCoreAttention.forward = _flash_core_attention  # type: ignore[method-assign]
    cfg = load_config(None, [f"model.hf_path={hf_dir}", *overrides])
    policy = Policy.build(cfg.policy_spec())
    vocab = policy.bridge.hf_pretrained.config.vocab_size
    g = torch.Generator().manual_seed(rank)
    prompt = 8
    seqs = [
        TrainSequence(
            seq_id=i,
            prompt_ids=torch.randint(3, vocab, (prompt,), generator=g).tolist(),
            response_ids=torch.randint(3, vocab, (seq_len - prompt,), generator=g).tolist(),
            old_logp=[-4.0] * (seq_len - prompt),
            advantage=1.0 if i % 2 else -1.0,
        )
        for i in range(num_seqs)
    ]
    # Weights and the gradient buffer exist before the step: count their distinct storages.
    storages: dict[int, int] = {}
    for chunk in policy.model:
        for p in chunk.parameters():
            for t in (p, getattr(p, "main_grad", None)):
                if t is not None:
                    s = t.untyped_storage()
                    storages[s.data_ptr()] = s.nbytes()
    static = float(sum(storages.values()))
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        metrics = [policy.update(seqs, step) for step in range(2)]
    # Raw allocator records (signed sizes, nanosecond stamps), not the per-op net figures of
    # `prof.events()`, which hide the temporaries freed inside one op.
    records = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and str(e.extra_fields.device) == "cpu":
            records.append((e.start_time_ns, e.extra_fields.alloc_size))
    live = peak = 0
    for _, size in sorted(records):
        live += size
        peak = max(peak, live)
    micro_batches = len(policy.plan(seqs))
    return {
        "static": static,
        "step_peak": float(peak),
        "peak": static + peak,
        "micro_batches": float(micro_batches),
        "loss": float(metrics[-1]["loss"]),
    }
