"""Issue 26 (7): a refusal reaches the console as one line with exit code 2 when the job is
started the README's ways, `bash scripts/main.sh` and `python -m megatron_gspo.torchrun` (was:
torchrun wrapped the rank's line in its ~40-line ChildFailedError report and exited 1). The
reference for "today" is plain torchrun on the same input (exit 1, a traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.checkpoint.store import required_files, write_manifest
from megatron_gspo.layout import Layout
from megatron_gspo.weights.convert import META_FILE

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _one_line(r: subprocess.CompletedProcess, expected: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert lines == [lines[0]] and lines[0].startswith("error: ") and expected in lines[0], lines


@pytest.mark.slow
def test_main_sh_refuses_bad_input_in_one_line_with_exit_2() -> None:
    r = subprocess.run(
        ["bash", "scripts/main.sh", "--set", "optim.lr=fast"], cwd=ROOT, env=_env(),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    _one_line(r, "optim.lr='fast' must be a number; change optim.lr")


def _damaged_checkpoint(ckpt: Path) -> None:
    """A checkpoint of a 2-rank EP=2 job whose shard of rank 1 has a flipped byte: preflight
    (the layout) passes, the ranks' `verify` refuses it after init_distributed."""
    d = ckpt / "step_000002"
    (d / "hf_config").mkdir(parents=True)
    for name in required_files(2):
        (d / name).write_bytes(name.encode() * 100)
    (d / META_FILE).write_text(json.dumps({"layout": Layout(ep=2).to_dict(), "world_size": 2}))
    write_manifest(d)
    shard = d / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    (ckpt / "latest").write_text(d.name)


@pytest.mark.slow
@pytest.mark.multirank
def test_a_refusal_on_the_ranks_arrives_as_one_line_through_torchrun(tmp_path: Path) -> None:
    from tools import make_tiny_toy

    make_tiny_toy.main(["--out", str(tmp_path / "toy"), "--n", "16"])
    _damaged_checkpoint(tmp_path / "run" / "ckpt")
    train = ["-m", "megatron_gspo.train", "--config", str(ROOT / "examples/tiny_moe_cpu.yaml")]
    for key, value in {
        "model.hf_path": tmp_path / "toy/model",
        "data.train_path": tmp_path / "toy/toy.jsonl",
        "logging.dir": tmp_path / "run",
        "checkpoint.dir": tmp_path / "run/ckpt",
    }.items():
        train += ["--set", f"{key}={value}"]
    train += ["--resume"]
    r = subprocess.run(
        [sys.executable, "-m", "megatron_gspo.torchrun", "--nproc_per_node", "2", *train],
        cwd=tmp_path, env={**_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    _one_line(r, "__1_0.distcp: its sha256 differs from the one written with the checkpoint")
