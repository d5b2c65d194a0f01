"""The device check's CPU parts in CI: `tests/gpu/device_check.py --device cpu --small`, one
subprocess (started ahead: tests/ahead.py), its JSON against the schema in its docstring.

On CPU the sections take the CPU branches (SGLang's sha256 hash, gloo, CPU GEMMs), so this
proves the script runs and reports, not the GPU branches; it still sees the bf16 defects of
issue 35 that CPU can show: `resume` compares fp32 main params bitwise (defect 6) and `lm_head`
holds the fused head to the fp32-logit head (defect 7).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.ahead import ROOT, Ahead, ahead

SCRIPT = ROOT / "tests" / "gpu" / "device_check.py"
SECTIONS = ("hash", "train", "lm_head", "resume")
S = {"pass", "fail", "skip"}
NUM = (int, float)
#: the schema of the script's docstring: section -> {key: type(s)} beside status/seconds/reason
KEYS: dict[str, dict[str, Any]] = {
    "hash": {"sglang": str, "engine_device": str, "tensors": int, "sglang_checksums": dict,
             "predicted_match": bool, "sender_match": bool,
             "sha256_prediction_matches": bool, "mismatched": list},
    "train": {"dtype": str, "loss": NUM, "grad_norm": NUM, "finite": bool,
              "params_changed": bool, "main_params_fp32": bool, "step_seconds": NUM},
    "lm_head": {"T": int, "V": int, "H": int, "logp_max_abs_diff": NUM,
                "entropy_max_abs_diff": NUM, "grad_hidden_rel_diff": NUM,
                "grad_weight_rel_diff": NUM, "fused_peak_mib": (type(None), *NUM),
                "unfused_peak_mib": (type(None), *NUM), "fused_seconds": NUM,
                "unfused_seconds": NUM, "tolerance": NUM},
    "resume": {"after_load_differ": list, "after_step_differ": list, "compared": int},
}  # fmt: skip


#: the SGLang files tests/gpu/fetch_wheels.sh takes out of the sglang wheel
SGLANG_FILES = (
    "sglang/kernels/ops/memory/gpu_tensor_hash.py",
    "sglang/srt/managers/mm_utils.py",
    "sglang/srt/utils/weight_checker.py",
    "sglang/srt/utils/common.py",
)
#: runs the script with the sglang package unimportable, as on a machine without it
NO_SGLANG = (
    "import sys; sys.modules['sglang'] = None; sys.argv[0] = {script!r}; "
    "exec(compile(open({script!r}).read(), {script!r}, 'exec'))"
)


def _run(tmp: Path, name: str, *args: str, block_sglang: bool = False) -> dict[str, Any]:
    out = tmp / f"{name}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(SCRIPT)]
    if block_sglang:
        cmd = [sys.executable, "-c", NO_SGLANG.format(script=str(SCRIPT))]
    cmd += ["--device", "cpu", "--small", "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    return {"code": proc.returncode, "json": json.loads(out.read_text()), "stdout": proc.stdout}


# Where the trainer venv's sglang is, found here at collection (main thread) without importing
# it: the launch below runs on the ahead thread, where an import (SGLang's pulls in transformers,
# torchao, diffusers: dozens of new loggers) raced pytest's walk over logging's logger dict at
# the start of every test phase ("dictionary changed size during iteration" in the first tests'
# setup and teardown, tests/ahead.py).
_SGLANG = importlib.util.find_spec("sglang")


@ahead("device_check")
def _launch(tmp: Path) -> dict[str, dict[str, Any]]:
    """The whole check with the trainer venv's sglang, and its hash section from SGLang's
    source files alone (what a GPU machine without the sglang package runs)."""
    assert _SGLANG is not None and _SGLANG.origin, "sglang is not installed in this venv"
    src = tmp / "sglang-src"
    pkg = Path(_SGLANG.origin).parent.parent
    for f in SGLANG_FILES:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_bytes((pkg / f).read_bytes())
    full = _run(tmp, "full")
    files = _run(tmp, "files", "--sections", "hash", "--sglang-src", str(src), block_sglang=True)
    return {"full": full, "files": files}


@pytest.fixture(scope="module")
def runs(launches_ahead: Ahead) -> dict[str, dict[str, Any]]:
    return launches_ahead.result("device_check")


@pytest.fixture(scope="module")
def result(runs: dict[str, dict[str, Any]]) -> tuple[int, dict[str, Any], str]:
    r = runs["full"]
    return r["code"], r["json"], r["stdout"]


def check_schema(d: dict[str, Any]) -> None:
    """Raise AssertionError where `d` leaves the documented schema."""
    assert d["schema"] == 1
    assert d["device"] in ("cpu", "cuda") and isinstance(d["device_name"], str)
    assert isinstance(d["small"], bool) and isinstance(d["ok"], bool)
    assert isinstance(d["seconds"], NUM)
    assert set(d["versions"]) == {"torch", "triton", "megatron_core", "sglang"}
    assert set(d["sections"]) <= set(SECTIONS)
    for name, sec in d["sections"].items():
        assert sec["status"] in S and isinstance(sec["seconds"], NUM), name
        if sec["status"] != "pass":
            assert isinstance(sec["reason"], str), name
        if sec["status"] == "skip":
            continue
        if sec["status"] == "fail" and "traceback" in sec:
            continue  # raised before its measurements
        extra = set(sec) - set(KEYS[name]) - {"status", "seconds", "reason", "traceback"}
        assert not extra, f"{name}: undocumented keys {sorted(extra)}"
        for key, types in KEYS[name].items():
            assert isinstance(sec[key], types), f"{name}.{key}={sec[key]!r}"
    statuses = [s["status"] for s in d["sections"].values()]
    assert d["ok"] == ("fail" not in statuses and "pass" in statuses)


def test_cpu_run_follows_the_schema(result: tuple[int, dict[str, Any], str]) -> None:
    code, d, stdout = result
    check_schema(d)
    assert json.loads(stdout) == d  # one JSON on stdout, the same as --out
    assert d["device"] == "cpu" and d["small"] and set(d["sections"]) == set(SECTIONS)
    assert code == (0 if d["ok"] else 1)


def test_every_cpu_section_passes(result) -> None:
    """hash and train pass on CPU (SGLang's sha256 branch; a bf16 step with fp32 main
    params); lm_head (fp32 logits from bf16 inputs, issue 35 item 7) and resume (the fp32 main
    params survive a load, item 6) too: on the code before those fixes they reported fail."""
    _, d, _ = result
    hash_, train = d["sections"]["hash"], d["sections"]["train"]
    assert hash_["status"] == "pass", hash_.get("reason")
    assert hash_["engine_device"] == "cpu" and hash_["tensors"] == 6
    assert hash_["sha256_prediction_matches"]  # CPU: SGLang's branch is sha256
    assert train["status"] == "pass", train.get("reason")
    assert train["main_params_fp32"] and train["dtype"] == "bfloat16"
    for name in ("lm_head", "resume"):
        assert d["sections"][name]["status"] == "pass", d["sections"][name]


def test_schema_check_can_fail(result) -> None:
    _, d, _ = result
    broken = json.loads(json.dumps(d))
    broken["sections"]["train"]["loss"] = "nan"
    with pytest.raises(AssertionError, match="train.loss"):
        check_schema(broken)
    broken = json.loads(json.dumps(d))
    broken["sections"]["hash"]["surprise"] = 1
    with pytest.raises(AssertionError, match="undocumented"):
        check_schema(broken)


def test_hash_from_sglangs_source_files_alone(runs) -> None:
    """Without the sglang package (a GPU machine with torch + Triton only), the hash section
    compiles SGLang's own functions from its source files; same checksums as the package."""
    full, files = runs["full"]["json"], runs["files"]["json"]
    check_schema(files)
    h = files["sections"]["hash"]
    assert h["status"] == "pass", h.get("reason")
    assert " functions from " in h["sglang"] and files["versions"]["sglang"] is not None
    assert " functions from " not in full["sections"]["hash"]["sglang"]
    assert h["sglang_checksums"] == full["sections"]["hash"]["sglang_checksums"]
