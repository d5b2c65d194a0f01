"""How a rank ends (issue 40, `megatron_gspo/run/teardown.py`): one rank in a process of its own
joins a gloo group, imports megatron-core after it (as the trainer does), builds its parallel
state and ends through `end_process(7)`: exit code 7, nothing printed by C++, and before the
end no megatron-core global still names a process group (its `destroy_model_parallel` misses
two). The loop over 200 launches under load is `benchmarks/teardown_loop.py`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

RANK = """
import sys, torch
from megatron_gspo import dist
from megatron_gspo.run import teardown
from megatron_gspo.layout import Layout
dist.init_distributed("cpu")
before = len(dist.comm_threads())
from megatron_gspo.megatron.model import init_megatron
init_megatron(Layout(), seed=0)
torch.distributed.all_reduce(torch.ones(8))
grown = len(dist.comm_threads())
left = teardown.release_process_groups()
from megatron.core import parallel_state as ps
held = [k for k, v in vars(ps).items() if isinstance(v, torch.distributed.ProcessGroup)]
print(f"threads {before} {grown} {len(left)} held {held}", flush=True)
teardown.end_process(7)
"""


def test_a_rank_ends_with_its_code_and_no_group_left_in_megatron_globals() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)  # a 1-rank job of its own
    proc = subprocess.run(
        [sys.executable, "-c", RANK], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 7, out[-3000:]
    assert "terminate called" not in out and "Traceback" not in out, out[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("threads "))
    before, grown, left = (int(x) for x in line.split()[1:4])
    assert grown > before and left < grown, line  # megatron-core's groups were freed
    assert line.endswith("held []"), line
