"""Per-rank parameter counts from megatron-core's own modules, for the launch planner
(`plan_memory.count_params`): each pipeline stage's model chunks built on the `meta` device for
one rank of that stage, in a fake process group, so TP/EP/PP sharding is megatron-core's, not a
formula's."""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

from megatron_gspo.config_io import require
from megatron_gspo.layout import Layout

__all__ = ["stage_param_counts"]


def stage_param_counts(
    hf_dir: str | Path, layout: Layout, world_size: int
) -> list[tuple[int, int]]:
    """(all, expert) parameters one rank of each pipeline stage holds, stage by stage. Must run
    before this process joins a real process group."""
    import torch
    import torch.distributed as tdist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_gspo.megatron.model import (
        initialize_parallel_state,
        make_provider,
        quiet_megatron,
    )
    from megatron_gspo.patches import apply_bridge_imports, apply_cpu_runtime

    require(not tdist.is_initialized(), "count_params needs a process without a process group")
    quiet_megatron(logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # Import-time notices of optional back-ends (TE, FP8) are noise in a planner's output.
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        apply_cpu_runtime()  # no-op on a GPU machine; the build itself never touches a device
        apply_bridge_imports()
        from megatron.bridge import AutoBridge
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection
        from transformers import AutoConfig

    bridge = AutoBridge.from_hf_config(AutoConfig.from_pretrained(str(hf_dir)))
    counts = []
    for stage in range(layout.pp):
        # megatron-core's default rank order puts PP outermost: stage s starts at s * W/pp.
        rank = stage * (world_size // layout.pp)
        tdist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            initialize_parallel_state(layout, create_gloo_process_groups=False)
            assert parallel_state.get_pipeline_model_parallel_rank() == stage
            # fp32 and no grouped GEMM: the CPU build path; parameter counts do not depend on
            # either (TE's grouped and fused modules hold the same tensors).
            provider = make_provider(bridge, layout, None, dtype=torch.float32)
            provider.perform_initialization = False
            provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
            total = expert = 0
            with torch.device("meta"):
                for vp in range(layout.vpp or 1):
                    chunk = provider.provide(vp_stage=vp if layout.vpp else None)
                    for name, p in chunk.named_parameters():
                        total += p.numel()
                        expert += p.numel() if ".experts." in name else 0
            counts.append((total, expert))
        finally:
            parallel_state.destroy_model_parallel()
            tdist.destroy_process_group()
    return counts
