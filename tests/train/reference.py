"""The uninterrupted reference run shared by the trainer end-to-end files.

One launch (2 CPU ranks, EP=2, the embedded engine, `STEPS` steps, a checkpoint every
`SAVE_EVERY`, the HF export at the end) serves as the fault chain's reference
(`test_faults_e2e.py`: every interrupted run must reproduce it) and as run A of
`test_train_e2e.py` (its steps, its export, the resumed and colocated runs compared with it).
Saving a checkpoint does not change what a step trains (the fault chain checks exactly that),
so one run serves both; the session fixture `reference_run` (conftest.py) starts it once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from megatron_gspo.dist import free_port
from tools import make_tiny_toy

ROOT = Path(__file__).resolve().parents[2]
STEPS, SAVE_EVERY, GRACE_S = 6, 2, 10
TORCHRUN_SHUTDOWN_S = 600  # far above any launch: a rank that does not end shows as a hang
PROMPTS, GROUP = 4, 4


def command(tmp: Path, run: str, *, toy: Path | None = None) -> list[str]:
    """torchrun + the trainer on the tiny toy (`toy`, default `tmp/toy`), logging to `tmp/run`
    and checkpointing to `tmp/run/ckpt`."""
    toy = toy or tmp / "toy"
    sets = {
        "model.hf_path": f"{toy}/model",
        "data.train_path": f"{toy}/toy.jsonl",
        "logging.dir": f"{tmp}/{run}",
        "checkpoint.dir": f"{tmp}/{run}/ckpt",
        "checkpoint.save_every": SAVE_EVERY,
        "checkpoint.export_hf_at_end": "true",
        "train.steps": STEPS,
        "train.stop_grace_s": GRACE_S,
        "rl.prompts_per_rollout": PROMPTS,
        "rl.group_size": GROUP,
        "logging.tensorboard": "false",
        "logging.progress": "false",
        "weights.verify_every": 1,  # test_train_e2e checks every push as verified
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(free_port()), "--shutdown-timeout", str(TORCHRUN_SHUTDOWN_S)]
    cmd += ["-m", "megatron_gspo.train", "--config", str(ROOT / "examples/tiny_moe_cpu.yaml")]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def write_toy(tmp: Path) -> None:
    """The toy of the reference run (and of the runs compared with it) into `tmp/toy`."""
    make_tiny_toy.main(["--out", str(tmp / "toy"), "--n", "64"])


def run_reference(tmp: Path) -> dict[str, Any]:
    """Train the reference run in `tmp/ref` on the toy in `tmp/toy` (`write_toy`)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    t0 = time.monotonic()
    proc = subprocess.run(
        command(tmp, "ref"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {"tmp": tmp, "dir": tmp / "ref", "toy": tmp / "toy", "seconds": time.monotonic() - t0}
