"""tools/evidence_report.py on hand-made runs: the numbers in the tables and the collapse flags
against values computed here, and the study's arm registry skipping arms whose keys are
missing."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from tools.evidence_report import collapse_flags, write_report
from tools.evidence_study import ARMS, Arm, keep_row, missing_key


def _write_run(d, arm, seed, rewards, **extra):
    rows = []
    for i, r in enumerate(rewards, start=1):
        row = {"step": i, "reward/mean": r, "policy/entropy": 2.0, "policy/clip_frac": 0.1 * seed}
        row["mismatch/seq_outside_clip_len/32-63"] = 0.5
        row.update({k: v[i - 1] for k, v in extra.items()})
        rows.append(row)
    (d / f"{arm}-seed{seed}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    meta = {"arm": arm, "seed": seed, "status": "ok", "wall_s": 100.0, "loadavg_start": [2.0]}
    (d / f"{arm}-seed{seed}.meta.json").write_text(json.dumps(meta))


def test_collapse_flags():
    rising = {i: {"reward/mean": i / 30, "policy/entropy": 3.0} for i in range(1, 31)}
    assert collapse_flags(rising) == []
    drop = {i: {"reward/mean": 0.8 if i < 20 else 0.2, "policy/entropy": 3.0} for i in range(1, 31)}
    assert collapse_flags(drop) == ["reward drop"]
    ent = {i: {"reward/mean": 0.5, "policy/entropy": 3.0 if i == 1 else 0.1} for i in range(1, 31)}
    assert collapse_flags(ent) == ["entropy collapse"]
    nan = {1: {"reward/mean": 0.5, "grad_norm": math.nan}, 2: {"reward/mean": 0.5}}
    assert collapse_flags(nan) == ["non-finite"]
    skipped = {1: {"reward/mean": 0.5, "train/skipped_updates": 1.0}}
    assert collapse_flags(skipped) == ["non-finite"]


def test_report_tables_from_the_data(tmp_path):
    data = tmp_path / "runs"
    data.mkdir()
    seeds = {0: [0.1 * (i % 3) + i / 40 for i in range(25)], 1: [0.2 + i / 50 for i in range(25)]}
    for s, rw in seeds.items():
        _write_run(data, "gspo-fp32", s, rw)
    (data / "grpo-fp32-seed0.meta.json").write_text(
        json.dumps({"arm": "grpo-fp32", "seed": 0, "status": "failed", "rc": 1})
    )
    out = tmp_path / "evidence.md"
    write_report(data, out, ARMS, {"gspo-fp8": "config key x does not exist here yet"})
    text = out.read_text()
    first = [statistics.fmean(r[:10]) for r in seeds.values()]
    last = [statistics.fmean(r[-10:]) for r in seeds.values()]
    row = next(line for line in text.splitlines() if line.startswith("| gspo-fp32 | 2 | 25 |"))
    cells = row.split(" | ")
    for cell, vals in ((cells[3], first), (cells[4], last)):
        mean, sd = (float(x) for x in cell.split(" ± "))
        assert mean == pytest.approx(statistics.fmean(vals), abs=6e-4)
        assert sd == pytest.approx(statistics.stdev(vals), rel=0.02)
    assert "| grpo-fp32 |" in text and "1 failed (seeds [0])" in text
    assert "not run: config key x does not exist here yet" in text
    assert "| gspo-fp32-recompute | GSPO, trainer recomputes pi_old | not run yet |" in text
    assert "len 32-63" in text and "0.500" in text
    # clip fraction: seed 0 logs 0.0, seed 1 logs 0.1 -> 0.05 ± 0.0707
    assert f"0.050 ± {statistics.stdev([0.0, 0.1]):.3f}" in text


def test_missing_keys_skip_an_arm():
    assert missing_key(ARMS["gspo-fp32"]) is None
    assert missing_key(Arm("x", ("loss.kind=gspo", "task.length=64"))) is None
    assert missing_key(Arm("x", ("loss.kind=gspo", "loss.no_such_key=1"))) == "loss.no_such_key"


def test_kept_rows_are_small_and_rounded():
    row = {"step": 3, "reward/mean": 0.123456789, "rollout/groups_kept": 4.0, "loss": "nan"}
    assert keep_row(row) == {"step": 3, "reward/mean": 0.123457, "loss": "nan"}
