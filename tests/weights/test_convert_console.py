"""The conversion tools' console (issue 40, library noise): a conversion prints our `[convert]`
lines and the progress bars, nothing else. Was: megatron-bridge's traceback for the optional
`FP8GlobalStateManager` import, megatron-core's and transformers' warnings and deprecations,
torch's "No CUDA runtime" and torchrun's OMP_NUM_THREADS notice, on every conversion.

One real round trip of the tiny toy, as a user runs it: HF -> Megatron under
`python -m megatron_gspo.torchrun` with 2 ranks (EP=2), then Megatron -> HF with plain `python`;
then a refused conversion (an output holding the user's file): one line, exit 2, nothing
written. What the libraries said is kept in `<output>/third_party.log`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.run.console import THIRD_PARTY_LOG
from tools import make_tiny_toy

pytestmark = [pytest.mark.multirank, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
OURS = ("[convert] ", "Loading from ", "Converting to HuggingFace ")  # our lines, the bars
NOISE = ("Traceback", "Warning", "WARNING", "deprecated", "FP8GlobalStateManager", "[rank")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "OMP_"))}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


def _console(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines a user sees, each checked to be ours."""
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    for noise in NOISE:
        assert noise not in proc.stdout + proc.stderr, (noise, proc.stdout, proc.stderr)
    assert all(ln.startswith(OURS) for ln in lines), lines
    return lines


def test_a_conversion_prints_only_its_own_lines(tmp_path: Path) -> None:
    make_tiny_toy.main(["--out", str(tmp_path / "toy"), "--n", "8"])
    model, ckpt, hf = tmp_path / "toy" / "model", tmp_path / "ckpt", tmp_path / "hf"
    to_megatron = _run(
        "-m", "megatron_gspo.torchrun", "--nproc_per_node", "2",
        "tools/convert_hf_to_megatron.py", "-i", str(model), "-o", str(ckpt), "--ep", "2",
    )  # fmt: skip
    assert to_megatron.returncode == 0, to_megatron.stdout + to_megatron.stderr
    lines = _console(to_megatron)
    assert f"[convert] library output (warnings, notices) in {ckpt / THIRD_PARTY_LOG}" in lines
    log = (ckpt / THIRD_PARTY_LOG).read_text()
    assert "FP8GlobalStateManager" in log and "rank1" in log  # kept, from both ranks

    to_hf = _run("tools/convert_megatron_to_hf.py", "-i", str(ckpt), "-o", str(hf))
    assert to_hf.returncode == 0, to_hf.stdout + to_hf.stderr
    _console(to_hf)
    assert "FP8GlobalStateManager" in (hf / THIRD_PARTY_LOG).read_text()
    assert len(list(hf.glob("*.safetensors"))) == 1  # the weights, next to the log

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("the user's")
    refused = _run("tools/convert_megatron_to_hf.py", "-i", str(ckpt), "-o", str(tmp_path / "out"))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    (line,) = [ln for ln in (refused.stdout + refused.stderr).splitlines() if ln.strip()]
    assert line.startswith(f"error: -o {tmp_path / 'out'} holds 'notes.txt'"), line
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]
