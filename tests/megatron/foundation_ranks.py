"""Rank program for the foundation layout tests (spawned by tests/megatron/test_layouts.py).

For each layout: build the tiny MoE from the HF checkpoint through megatron-bridge, run a
forward (full logits gathered over TP vocab shards, CP chunks and PP stages), then one Adam step
(lr = eps >> |g|, so the weight delta IS the averaged gradient) with a plain LM loss through
`get_forward_backward_func`, and export the updated weights as full HF tensors.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from megatron_gspo.megatron.cpu_attention import zigzag_indices
from megatron_gspo.megatron.model import (
    Layout,
    build_model,
    init_megatron,
    load_bridge,
    make_provider,
    quiet_megatron,
)
from megatron_gspo.testing.weights import hf_state

BATCH, SEQ = 4, 16


def make_tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (BATCH, SEQ + 1), generator=g)


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    if ps.get_tensor_model_parallel_world_size() == 1:
        return logits
    return gather_from_tensor_model_parallel_region(logits)


def _unzigzag(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Gather CP shards of `x` along `dim` and restore sequence order."""
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return x
    group = ps.get_context_parallel_group()
    parts = [torch.empty_like(x) for _ in range(cp)]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    full_len = x.size(dim) * cp
    out = torch.empty(*x.shape[:dim], full_len, *x.shape[dim + 1 :], dtype=x.dtype)
    for r, part in enumerate(parts):
        out.index_copy_(dim, zigzag_indices(full_len, cp, r), part)
    return out


def _cp_slice(x: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    return x[:, zigzag_indices(x.size(1), cp, rank)]


def _forward_step(data_iterator: Any, model: torch.nn.Module, *, collect: list) -> Any:
    tokens = next(data_iterator)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).expand_as(inputs)
    inputs, labels, positions = _cp_slice(inputs), _cp_slice(labels), _cp_slice(positions)
    logits = model(inputs, positions, None)

    def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        full = _gather_vocab(logits)  # [b, s_local, V]
        collect.append(_unzigzag(full.detach(), 1))
        ce = torch.nn.functional.cross_entropy(
            full.float().flatten(0, 1), labels.flatten(), reduction="sum"
        )
        # Megatron multiplies a 2-tuple loss by cp and averages grads over dp*cp, so each CP
        # shard contributes its token-sum over the micro-batch's full token count.
        loss = ce / labels.numel() / _cp_size()
        return loss, {"loss": loss.detach()}

    return logits, loss_func


def _cp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_world_size()


def run_layout(
    bridge: Any, layout: Layout, tokens: torch.Tensor, distopt: bool, plant: str | None
) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    init_megatron(layout)
    provider = make_provider(bridge, layout, loss_is_share=False)
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distopt
    )
    model = build_model(provider, ddp_config=ddp, load_from=bridge)
    if plant:  # a deliberately wrong shard: the comparison must catch it
        for name, p in model[0].named_parameters():
            if plant in name:
                with torch.no_grad():
                    p.copy_(p.roll(1, 0))
                break
    for m in model:
        m.config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(
            # Adam's first step is -lr * g / (|g| + eps); with lr = eps >> |g| it is -g to
            # ~1e-6 relative, so the weight delta IS the gradient (the distributed optimizer
            # supports only Adam-like optimizers).
            optimizer="adam",
            lr=1e4,
            adam_eps=1e4,
            weight_decay=0.0,
            clip_grad=0.0,
            use_distributed_optimizer=distopt,
            params_dtype=torch.float32,
        ),
        model,
    )
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = tokens.chunk(dp)[dp_rank]
    micro = list(local.split(1))
    fb = get_forward_backward_func()
    seq_len = SEQ // layout.cp

    def iterators() -> Any:
        its = [iter(micro) for _ in model]
        return its if len(model) > 1 else its[0]

    collect: list[torch.Tensor] = []
    fb(
        forward_step_func=partial(_forward_step, collect=collect),
        data_iterator=iterators(),
        model=model,
        num_microbatches=len(micro),
        seq_length=seq_len,
        micro_batch_size=1,
        forward_only=True,
    )
    logits = torch.cat(collect) if collect else None
    for m in model:
        m.zero_grad_buffer()
    opt.zero_grad()
    losses = fb(
        forward_step_func=partial(_forward_step, collect=[]),
        data_iterator=iterators(),
        model=model,
        num_microbatches=len(micro),
        seq_length=seq_len,
        micro_batch_size=1,
        forward_only=False,
    )
    ok, grad_norm, _ = opt.step()
    assert ok
    state = hf_state(bridge, model)
    # Full logits of the whole batch, in dp order, on the last pipeline stage.
    if logits is not None and dp > 1:
        parts = [torch.empty_like(logits) for _ in range(dp)]
        torch.distributed.all_gather(parts, logits, group=ps.get_data_parallel_group())
        logits = torch.cat(parts)
    return {
        "logits": logits,
        "loss": sum(float(x["loss"]) for x in losses) if losses else None,
        "grad_norm": float(grad_norm),
        "weights": state,
    }


def main(rank: int, world: int, hf_dir: str, cases: list[dict[str, Any]]) -> dict[str, Any]:
    quiet_megatron()
    bridge = load_bridge(hf_dir)
    vocab = bridge.hf_pretrained.config.vocab_size
    tokens = make_tokens(vocab)
    out: dict[str, Any] = {}
    for case in cases:
        layout = Layout(**case["layout"])
        out[case["name"]] = run_layout(
            bridge, layout, tokens, case.get("distopt", False), case.get("plant")
        )
        if rank != 0:
            out[case["name"]].pop("weights")  # every rank exports the same full tensors
    if rank == 0 and cases and cases[0].get("with_hf"):
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            out["hf_logits"] = hf(tokens[:, :-1]).logits
    return out
