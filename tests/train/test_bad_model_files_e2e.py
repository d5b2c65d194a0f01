"""The end-to-end proof of the start-up validation (issue 40): one launch under
`python -m megatron_gspo.torchrun` with 2 ranks on a model directory whose `model.safetensors`
is 0 bytes (an interrupted download). It ends in the launcher, before any rank starts: exit 2,
one line naming the file, no traceback, nothing written (was: preflight passed, then both ranks
printed 60-line tracebacks). The other corrupt inputs are tests/test_input_generated.py's, run
in-process through the same `preflight`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.dist import free_port
from tools import make_tiny_toy

pytestmark = [pytest.mark.multirank, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_an_empty_weight_file_is_one_line_before_any_rank_starts(tmp_path: Path) -> None:
    make_tiny_toy.main(["--out", str(tmp_path / "toy"), "--n", "8"])
    model = tmp_path / "toy" / "model"
    (model / "model.safetensors").write_bytes(b"")
    cmd = [sys.executable, "-m", "megatron_gspo.torchrun", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(free_port()), "-m", "megatron_gspo.train"]
    cmd += ["--config", str(ROOT / "examples/tiny_moe_cpu.yaml")]
    sets = {
        "model.hf_path": model,
        "data.train_path": tmp_path / "toy" / "toy.jsonl",
        "logging.dir": tmp_path / "run",
        "checkpoint.dir": tmp_path / "ckpt",
    }
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {model}/model.safetensors: empty (0 bytes; an interrupted download?); "
        "download it again"
    ], out[-3000:]
    assert "Traceback" not in out and "[rank" not in out, out[-3000:]
    assert not (tmp_path / "run").exists() and not (tmp_path / "ckpt").exists()
    shutil.rmtree(tmp_path / "toy")
