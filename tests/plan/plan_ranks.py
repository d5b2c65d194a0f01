"""Rank function of the planner test: build the tiny model for real (gloo ranks, CPU) at each
layout and report the parameters this rank holds."""

from __future__ import annotations

from typing import Any

from megatron_gspo.layout import Layout


def real_param_counts(rank: int, world: int, hf_dir: str, layouts: list[dict]) -> list[dict]:
    """Per layout: this rank's pipeline stage and the numel of its model chunks (all, expert)."""
    from megatron.core import parallel_state

    from megatron_gspo.megatron.model import (
        build_model,
        init_megatron,
        load_bridge,
        make_provider,
        quiet_megatron,
    )

    quiet_megatron()
    bridge = load_bridge(hf_dir)
    out: list[dict[str, Any]] = []
    for spec in layouts:
        layout = Layout(**spec)
        init_megatron(layout)
        model = build_model(make_provider(bridge, layout, None))
        named = [(n, p) for chunk in model for n, p in chunk.named_parameters()]
        out.append(
            {
                "stage": parallel_state.get_pipeline_model_parallel_rank(),
                "total": sum(p.numel() for _, p in named),
                "expert": sum(p.numel() for n, p in named if ".experts." in n),
            }
        )
        parallel_state.destroy_model_parallel()
    return out
