"""The command line of a training job as a user starts it, for the tests and benchmarks that run
whole jobs: torchrun (`torch.distributed.run`) with N CPU ranks on one node, then `python -m
megatron_gspo.train --config FILE`; the caller appends its `--set key=value` pairs. No torch
import (a free port is asked for only when none is given).

    cmd = torchrun_command("examples/tiny_moe_cpu.yaml") + ["--set", "train.steps=3"]
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["torchrun_command"]


def torchrun_command(
    config: str | Path,
    *,
    nproc: int = 2,
    port: int | None = None,
    module: str = "megatron_gspo.train",
) -> list[str]:
    """`nproc` ranks of `python -m <module> --config <config>` under torchrun, in this
    interpreter. `port`: torchrun's master port (None: a free one, so that concurrent jobs do
    not collide)."""
    if port is None:
        from megatron_gspo.dist import free_port

        port = free_port()
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(port),
        "-m",
        module,
        "--config",
        str(config),
    ]
