"""One training run of an example config on the toy model, as a user starts it: `torchrun`
(`torch.distributed.run`) with 2 CPU ranks, `python -m megatron_gspo.train --config
examples/<name>.yaml` and `--set` overrides that point it at the toy of `tmp/toy` and write
under `tmp/run` and `tmp/ckpt`. The example end-to-end tests (the tool env, the agent) share it.

    rows = train_example(tmp_path, "tiny_moe_tool_cpu", steps=3, timeout=600, sets={...})
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from megatron_gspo.testing.jobs import torchrun_command

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}


def train_example(
    tmp: Path, example: str, *, steps: int, timeout: int, sets: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Train `examples/<example>.yaml` for `steps` steps on `tmp/toy` (made by the caller,
    `tests.ahead.make_toy`), with `sets` over the run's own keys; asserts exit code 0 (the end
    of its output otherwise) and returns its metrics rows (`tmp/run/metrics.jsonl`)."""
    keys: dict[str, Any] = {
        "model.hf_path": f"{tmp}/toy/model",
        "data.train_path": f"{tmp}/toy/toy.jsonl",
        "logging.dir": f"{tmp}/run",
        "checkpoint.dir": f"{tmp}/ckpt",
        "train.steps": steps,
        "logging.progress": "false",
        **(sets or {}),
    }
    cmd = torchrun_command(ROOT / "examples" / f"{example}.yaml")
    for key, value in keys.items():
        cmd += ["--set", f"{key}={value}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(x) for x in (tmp / "run/metrics.jsonl").read_text().splitlines()]
