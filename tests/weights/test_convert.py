"""Checkpoint conversion HF <-> Megatron torch_dist on 2 gloo ranks (TP2, EP2, PP2, CP2).

Round trips are bitwise, a checkpoint written at one layout loads at another with logits
identical to the same layout built straight from HF, the checkpoint records its `Layout`,
`export_hf` (the converter's and the trainer's writer) replaces an earlier export and equals
the in-memory state, and the error paths (library and command line) say what is wrong.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.layout import Layout
from megatron_gspo.testing.harness import spawn_ranks
from tests.weights import convert_ranks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("convert")
    save_tiny_hf_checkpoint(root / "hf", seed=3)
    return spawn_ranks(convert_ranks.main, 2, str(root))


@pytest.mark.parametrize("src,dst", convert_ranks.EXPORTS)
@pytest.mark.multirank
def test_round_trip_and_reshard_bitwise(results: list[dict], src: str, dst: str) -> None:
    info = results[0][f"export_{src}_{dst}"]
    assert info["missing"] == [] and info["extra"] == [] and info["unequal"] == [], info
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(
        info["files"]
    )


@pytest.mark.parametrize("src,dst", convert_ranks.LOGITS)
@pytest.mark.multirank
def test_resharded_logits_identical(results: list[dict], src: str, dst: str) -> None:
    for rank in (0, 1):
        info = results[rank][f"logits_{src}_{dst}"]
        assert info["equal"], info
        assert info["shape"] == (2, 16, 128)


@pytest.mark.multirank
def test_refuses_to_overwrite(results: list[dict]) -> None:
    for r in results:
        assert r["overwrite"].startswith("ConversionError") and "--force" in r["overwrite"]
    assert "model-00000.safetensors" in results[0]["forced"]


@pytest.mark.multirank
def test_layout_that_does_not_fit(results: list[dict]) -> None:
    for r in results:
        msg = r["bad_layout"]
        assert msg.startswith("ConversionError"), msg
        # Layout.validate's message, with the command-line flag's name
        assert "--ep=3 does not divide the model's num_experts=4; change --ep" in msg


@pytest.mark.multirank
def test_missing_tensor_is_named(results: list[dict]) -> None:
    for r in results:
        msg = r["missing_tensor"]
        assert msg.startswith("ConversionError"), msg
        assert convert_ranks.DROPPED in msg


@pytest.mark.multirank
def test_checkpoint_records_its_layout(results: list[dict]) -> None:
    for r in results:
        for name, layout in convert_ranks.LAYOUTS.items():
            assert r[f"meta_{name}"] == layout, name
            assert isinstance(r[f"meta_{name}"], Layout)


@pytest.mark.multirank
def test_export_hf_replaces_an_earlier_export_and_equals_the_state(results: list[dict]) -> None:
    r0 = results[0]
    assert r0["export_hf_small"] == r0["export_hf"] == r0["hf_state_keys"] > 0
    # one shard: the many small shards of the first export are gone, as is the .tmp dir
    assert [f for f in r0["export_hf_files"] if f.endswith(".safetensors")] == [
        "model-00000.safetensors"
    ], r0["export_hf_files"]
    assert {"config.json", "generation_config.json"} <= set(r0["export_hf_files"])
    assert r0["export_hf_equal"]
    assert results[1]["export_hf"] == 0 and results[1]["hf_state_keys"] == r0["hf_state_keys"]


def _tool(tool: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    env.pop("RANK", None)  # one rank: plain python
    return subprocess.run(
        [sys.executable, f"tools/{tool}.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_command_line_layout_errors(tmp_path: Path) -> None:
    """--cp reaches the layout check (one rank cannot hold cp=2), a layout that cannot exist
    is argparse's usage error; both exit 2 naming the flag, and nothing is written."""
    save_tiny_hf_checkpoint(tmp_path / "hf", seed=3)
    args = ["-i", str(tmp_path / "hf"), "-o", str(tmp_path / "out")]
    proc = _tool("convert_hf_to_megatron", *args, "--cp", "2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "error: layout cp2 does not fit: world size 1 is not divisible by tp*pp*cp" in out
    assert "change --tp, --pp or --cp" in out
    assert not (tmp_path / "out").exists()
    proc = _tool("convert_megatron_to_hf", *args, "--vpp", "2")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "usage:" in proc.stderr and "vpp=2 needs pipeline parallelism" in proc.stderr
