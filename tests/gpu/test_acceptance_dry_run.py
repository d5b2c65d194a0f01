"""The GPU acceptance script's --dry-run, on CPU: every command line it would run parses with
torchrun's, the trainer's and SGLang's own parsers (tests/gpu/acceptance.py); the checks can
fail; the summary's verdict follows its stated bounds. Also the GPU environment's lock files."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _acceptance():
    spec = importlib.util.spec_from_file_location("acceptance", ROOT / "tests/gpu/acceptance.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["acceptance"] = mod  # its dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def acc():
    return _acceptance()


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """One input directory (model, FP8 copy, prompts) for every dry run here."""
    return tmp_path_factory.mktemp("acceptance")


def test_dry_run_checks_every_command(acc, out, capsys):
    assert acc.main(["--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for gpus in (1, 2, 8):
        for phase in ("colocated", "dist_fp8"):
            for parser in ("torchrun", "trainer config + preflight", "sglang.launch_server"):
                line = f"{phase}: {parser} ok"
                assert re.search(f"{re.escape(line)} .*\\[{gpus} GPU\\]", printed), (line, gpus)
    # The placements: one GPU shares it (gloo), two give the engine GPU 1 (NCCL).
    assert re.search(r"dist_fp8: trainer config \+ preflight ok .*backend=gloo.*\[1 GPU\]", printed)
    assert re.search(r"dist_fp8: trainer config \+ preflight ok .*backend=nccl.*\[2 GPU\]", printed)
    assert re.search(r"dist_fp8: sglang.launch_server ok .*--base-gpu-id 1 .*\[2 GPU\]", printed)
    assert re.search(r"colocated: sglang.launch_server ok .*--enable-memory-saver", printed)
    # A full node: every GPU a trainer rank (EP 8) next to its engine; split 4 + 4 for dist.
    assert re.search(r"colocated: torchrun ok \(8 proc, .*ep=8, 8 engines\) \[8 GPU\]", printed)
    assert re.search(r"dist_fp8: torchrun ok \(4 proc, .*ep=4, 4 engines\) \[8 GPU\]", printed)
    assert re.search(r"dist_fp8: sglang.launch_server ok x4 .*--base-gpu-id 7 .*\[8 GPU\]", printed)
    assert (out / "model_fp8/config.json").exists()
    # With the engine venv (scripts/test.sh exports it, and then requires it) its own SGLang
    # parses the engine commands too.
    if os.environ.get("MGSPO_ENGINE_PYTHON") or os.environ.get("MGSPO_REQUIRE_SGLANG"):
        assert "its SGLang parses all 9 engine commands" in printed  # first+last: 1+1, 2+1, 2+2
    else:
        assert "engine interpreter not given" in printed


def test_dry_run_fails_on_a_flag_sglang_rejects(acc, out, monkeypatch):
    monkeypatch.setattr(acc, "ENGINE_EXTRA", [*acc.ENGINE_EXTRA, "--no-such-sglang-flag"])
    with pytest.raises(SystemExit):  # SGLang's argparse: unrecognized arguments
        acc.main(["--dry-run", "--out", str(out), "--gpus", "1"])


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("weights.transport", "carrier-pigeon", "weights.transport"),  # parse_cli
        ("model.hf_path", "/no/such/model", "model.hf_path"),  # preflight
    ],
)
def test_dry_run_fails_on_what_the_trainer_rejects(acc, out, monkeypatch, key, value, match):
    phases = acc.phases

    def bad(*a, **k):
        ps = phases(*a, **k)
        ps[1].sets[key] = value
        return ps

    monkeypatch.setattr(acc, "phases", bad)
    with pytest.raises(ValueError, match=match):
        acc.main(["--dry-run", "--out", str(out), "--gpus", "1"])


def _rows(steps: int, **extra: float) -> list[dict]:
    return [
        {
            "weights/version": i + 1,
            "weights/verified": 1.0,
            "time/rollout_s": 1.0,
            "time/train_s": 0.5,
            "time/sync_s": 0.1,
            "loss": 0.1,
            **extra,
        }
        for i in range(steps)
    ]


def test_summary_verdict_follows_the_bounds(acc, tmp_path):
    ps = acc.phases(tmp_path, {"model": "m", "fp8": "f", "data": "d"}, "py", 1)
    mem = {
        "memory/trainer_allocated_gb_before_offload": 2.0,
        "memory/trainer_allocated_gb_offloaded": 0.2,
    }
    good = _rows(3, **{"mismatch/abs_logp_diff": 0.01}, **mem)
    ps[0].result = {"rc": 0, "wall_s": 60, "rows": good}
    ps[1].result = {"rc": 0, "wall_s": 60, "rows": _rows(2, **{"mismatch/abs_logp_diff": 0.3})}
    table, ok = acc.summarise(ps, 120.0)
    assert ok and "ACCEPTANCE PASSED" in table and "2.000/0.200" in table, table
    cases = {
        "mismatch": [dict(r, **{"mismatch/abs_logp_diff": 0.2}) for r in good],
        "finite": [dict(r, loss=float("nan")) for r in good],
        "verified": [dict(r, **{"weights/verified": 0.0}) for r in good],
        "versions": [dict(r, **{"weights/version": 1}) for r in good],
        "offload": [{k: v for k, v in r.items() if not k.startswith("memory/")} for r in good],
        "steps": good[:2],
    }
    for check, rows in cases.items():
        ps[0].result = {"rc": 0, "wall_s": 60, "rows": rows}
        table, ok = acc.summarise(ps, 120.0)
        assert not ok and f"colocated: FAILED {check}" in table, (check, table)


def test_gpu_lock_adds_to_the_cpu_lock_without_overlap():
    """constraints-gpu.txt pins only additions (name==version), none already in
    constraints.txt; Transformer Engine's three parts share one version; the script parses.
    (`bash scripts/gpu_env.sh --dry-run` checks the pins against PyPI: ~2 min, not in CI.)"""

    def pins(name: str) -> dict[str, str]:
        lines = (ROOT / name).read_text().splitlines()
        entries = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
        assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", e) for e in entries)
        norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
        return {norm(e.split("==")[0]): e.split("==")[1] for e in entries}

    cpu, gpu = pins("constraints.txt"), pins("constraints-gpu.txt")
    assert not set(cpu) & set(gpu)
    te = {
        gpu[k]
        for k in ("transformer-engine", "transformer-engine-cu13", "transformer-engine-torch")
    }
    assert te == {"2.20.2"} and "apex" not in gpu and cpu["torch"] == "2.13.0"
    subprocess.run(["bash", "-n", str(ROOT / "scripts/gpu_env.sh")], check=True)
