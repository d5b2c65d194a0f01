"""Checks of the GPU stack that CPU machines can take (issue 35, items 2 and 8): a `nvidia-smi`
on PATH stands for the driver (`tests/plan/slurm_kit.fake_nvidia_smi`); this machine's torch is
the locks' CUDA 13.0 build and sees no GPU, as on a node whose driver is too old.

Before the fix, a bf16 job on such a node ended with `model.dtype=bf16 on CPU: ...` (bf16 was
refused on CPU then; fp16 is now), which says nothing about the driver; now the driver and
what to do come first, in one line. Also the weight-file check the planner runs before
launch (`model_files_problem`).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.plan.gpu_stack import Driver, driver_problem, nvidia_driver, torch_here
from megatron_gspo.plan.model_files import model_files_problem
from megatron_gspo.run.preflight import preflight
from tests.plan.slurm_kit import fake_nvidia_smi, write_weights
from tests.test_bad_input import _base, _write

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or torch.version.cuda is None,
    reason="needs the CUDA build of torch on a machine without a usable GPU",
)


def _on_path(monkeypatch: pytest.MonkeyPatch, bin_dir: Path) -> None:
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def _preflight_error(tmp: Path, *sets: str) -> str:
    cfg = load_config(_write(tmp, _base(tmp)), ["model.dtype=fp16", *sets])
    with pytest.raises(ConfigError) as e:
        preflight(cfg, resume=False, overwrite=False, world_size=1)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_driver_older_than_the_cuda_build_is_named_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _on_path(monkeypatch, fake_nvidia_smi(tmp_path / "bin", driver="570.124.06", cuda="12.8",
                                          mem_mib=143771))  # fmt: skip
    msg = _preflight_error(tmp_path, "train.device=auto")
    assert msg.startswith("NVIDIA driver 570.124.06 supports CUDA up to 12.8"), msg
    assert f"a CUDA {torch.version.cuda} build" in msg and "R580 or newer" in msg, msg
    assert "model.dtype" not in msg


def test_driver_new_enough_but_no_gpu_seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _on_path(monkeypatch, fake_nvidia_smi(tmp_path / "bin", driver="580.82.07", cuda="13.0",
                                          mem_mib=143771))  # fmt: skip
    msg = _preflight_error(tmp_path, "train.device=cuda")
    assert msg.startswith("NVIDIA driver 580.82.07 (CUDA 13.0) is here but"), msg
    assert "sees no GPU" in msg and "--gpus-per-node" in msg, msg


def test_cpu_device_or_no_driver_skips_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert nvidia_driver() is None  # this machine (else the skip above would have applied)
    # no nvidia-smi: the old message, unchanged
    assert _preflight_error(tmp_path, "train.device=auto").startswith("model.dtype=fp16 on CPU")
    _on_path(monkeypatch, fake_nvidia_smi(tmp_path / "bin", driver="570.124.06", cuda="12.8",
                                          mem_mib=143771))  # fmt: skip
    assert nvidia_driver() == Driver(version="570.124.06", cuda="12.8")
    # train.device=cpu asks for the CPU: no driver line
    assert _preflight_error(tmp_path, "train.device=cpu").startswith("model.dtype=fp16 on CPU")


def test_driver_problem_branches() -> None:
    here = torch_here()
    new = Driver(version="580.82.07", cuda="13.0")
    assert driver_problem(here | {"cuda_available": True}, new, "x") is None
    assert driver_problem(here, None, "x") is None
    assert "CPU-only build" in (driver_problem(here | {"cuda_build": None}, new, "x") or "")
    assert driver_problem({"torch": None}, new, "x") is None  # no torch there


def _safetensors(path: Path, header: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header)


def test_model_files(tmp_path: Path) -> None:
    d = tmp_path / "m"
    assert "no such directory" in (model_files_problem(d) or "")
    d.mkdir()
    assert "no config.json" in (model_files_problem(d) or "")
    (d / "config.json").write_text("{}")
    assert "no *.safetensors weights" in (model_files_problem(d) or "")
    write_weights(d)
    assert model_files_problem(d) is None
    # an index names every shard: one missing, one empty, one not safetensors
    shards = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    index = {"weight_map": {f"w{i}": s for i, s in enumerate(shards)}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _safetensors(d / shards[0], b"{}")
    (d / shards[1]).write_bytes(b"")
    (d / shards[2]).write_bytes(b"<html>rate limited</html>")
    _safetensors(d / shards[3], b"{}")
    got = model_files_problem(d, "rollout.launch.model_path")
    assert got == (
        f"rollout.launch.model_path={d}: weight file {shards[1]} empty (and 1 more); download "
        "the checkpoint into it or point rollout.launch.model_path at one (the recipes' "
        "directories hold only config.json, for planning)"
    )
    (d / shards[1]).unlink()
    got = model_files_problem(d) or ""
    assert f"weight file {shards[1]} missing (and 1 more)" in got
    _safetensors(d / shards[1], b"{}")
    assert "not a safetensors file" in (model_files_problem(d) or "")
    _safetensors(d / shards[2], b"{}")
    assert model_files_problem(d) is None
