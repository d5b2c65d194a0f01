"""The evidence study's quick variant end to end (`tools/evidence_study.py --quick`): one arm of
5 steps on 2 CPU ranks (one launch), its data and meta files written with the trainer's
per-length mismatch bins and the per-mini-batch router flip rates, the report regenerated with
its numbers equal to those recomputed here from the data; then, with a second seed's data
added by hand (the first seed's rewards shifted), a second call reruns nothing and reports the
mean and sample standard deviation over the two seeds."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ahead import ROOT, Ahead, ahead
from tools import evidence_study

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def _line(text: str, prefix: str, last: bool = False) -> list[str]:
    lines = [x for x in text.splitlines() if x.startswith(prefix)]
    return lines[-1 if last else 0].split(" | ")


def _argv(tmp: Path) -> list[str]:
    return ["--quick", "--data-dir", str(tmp / "runs"), "--out", str(tmp / "evidence.md")]


@ahead("evidence_study")
def _launch(tmp: Path) -> Path:
    """The quick study, as a user runs it (started ahead: tests/ahead.py); its directory."""
    cmd = [sys.executable, "-m", "tools.evidence_study", *_argv(tmp), "--timeout", "600"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return tmp


def test_quick_study_runs_and_reports(launches_ahead: Ahead, capsys) -> None:
    tmp_path = launches_ahead.result("evidence_study")
    data, out = tmp_path / "runs", tmp_path / "evidence.md"
    (arm,) = evidence_study.QUICK_ARMS
    argv = [*_argv(tmp_path), "--timeout", "600"]
    meta = json.loads((data / f"{arm}-seed0.meta.json").read_text())
    assert meta["status"] == "ok" and meta["steps"] == evidence_study.QUICK_STEPS
    rows = [json.loads(x) for x in (data / f"{arm}-seed0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, evidence_study.QUICK_STEPS + 1))
    # The trainer's own metrics, incl. the per-length mismatch bins (L = 32 here) and the flip
    # rate at mini-batches 2..4 (4 per rollout in examples/evidence_cpu.yaml).
    assert any(k.startswith("mismatch/seq_outside_clip_len/") for k in rows[0])
    flips = [f"moe/routing_flip_rate_mb/{k}" for k in (2, 3, 4)]
    assert all(0.0 <= r[k] <= 1.0 for r in rows for k in flips)
    text = out.read_text()
    mean = statistics.fmean(r["reward/mean"] for r in rows)  # 5 steps: window = all
    assert float(_line(text, f"| {arm} | 1 | 5 |")[3]) == pytest.approx(mean, abs=6e-4)
    flip_row = _line(text, f"| {arm} | ", last=True)  # the last table: router flip rate
    want = statistics.fmean(r[flips[-1]] for r in rows)
    assert float(flip_row[-1].split(" / ")[0]) == pytest.approx(want, rel=1e-2, abs=6e-4)
    assert (tmp_path / "evidence" / "img" / "reward.png").exists()

    shifted = [dict(r, **{"reward/mean": r["reward/mean"] + 0.1}) for r in rows]
    (data / f"{arm}-seed1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shifted))
    (data / f"{arm}-seed1.meta.json").write_text(json.dumps(dict(meta, seed=1)))
    capsys.readouterr()
    assert evidence_study.main([*argv, "--seeds", "0,1"]) == 0  # accumulates: nothing is rerun
    assert capsys.readouterr().out.count("data exists, not rerun") == 2
    cell = _line(out.read_text(), f"| {arm} | 2 | 5 |")[3]
    means = [mean, statistics.fmean(r["reward/mean"] for r in shifted)]
    assert cell == f"{statistics.fmean(means):.3f} ± {statistics.stdev(means):.3f}"
