"""The evidence study's quick variant end to end (`tools/evidence_study.py --quick`): two arms
of 5 steps on 2 CPU ranks, each run's data and meta files written, the report regenerated with
both arms in it and its numbers equal to those recomputed here from the data; a second call
does not rerun what exists."""

from __future__ import annotations

import json
import statistics

import pytest

from tools import evidence_study

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def test_quick_study_runs_and_reports(tmp_path, capsys):
    data, out = tmp_path / "runs", tmp_path / "evidence.md"
    argv = ["--quick", "--data-dir", str(data), "--out", str(out), "--timeout", "600"]
    assert evidence_study.main(argv) == 0
    text = out.read_text()
    for arm in evidence_study.QUICK_ARMS:
        meta = json.loads((data / f"{arm}-seed0.meta.json").read_text())
        assert meta["status"] == "ok" and meta["steps"] == evidence_study.QUICK_STEPS
        rows = [json.loads(x) for x in (data / f"{arm}-seed0.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, evidence_study.QUICK_STEPS + 1))
        # The trainer's own metrics, incl. the per-length mismatch bins (L = 32 here).
        assert any(k.startswith("mismatch/seq_outside_clip_len/") for k in rows[0])
        mean = statistics.fmean(r["reward/mean"] for r in rows)  # 5 steps: window = all
        line = next(x for x in text.splitlines() if x.startswith(f"| {arm} | 1 | 5 |"))
        assert float(line.split(" | ")[3]) == pytest.approx(mean, abs=6e-4)
    assert (tmp_path / "evidence" / "img" / "reward.png").exists()
    capsys.readouterr()
    assert evidence_study.main(argv) == 0  # accumulates: nothing is rerun
    assert capsys.readouterr().out.count("data exists, not rerun") == 2
