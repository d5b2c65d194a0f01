"""The pre-registered study's report (tools/evidence_study_report.py) on planted runs, and the
study's run order and resume rule (tools/evidence_study.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tools.evidence_stats import fisher_greater, holm, tost_paired
from tools.evidence_study import ARMS as STUDY_ARMS
from tools.evidence_study import STUDY_BLOCKS, Plan, study_order
from tools.evidence_study_report import _p, dipped, last_mean, load_study, study_lines

COMMIT = "c" * 40


def _write(
    runs: Path, arm: str, seed: int, *, dip: bool, reward: float, commit: str = COMMIT
) -> None:
    """A 100-step run: entropy 4.8 falling to 1.0, or to 0.3 at step 60 alone (a one-step dip
    below 0.1 x 4.8); reward `reward` over steps 51..100."""
    rows = []
    for s in range(1, 101):
        ent = 4.8 - 3.8 * min(s, 40) / 40
        if dip and s == 60:
            ent = 0.3
        r = 0.15 if s <= 50 else reward
        rows.append({"step": s, "policy/entropy": ent, "reward/mean": r})
    stem = f"{arm}-seed{seed}"
    (runs / f"{stem}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = {"arm": arm, "seed": seed, "commit": commit, "status": "ok", "rc": 0,
            "dirty": False, "wall_s": 100.0, "loadavg_start": [1.0]}  # fmt: skip
    (runs / f"{stem}.meta.json").write_text(json.dumps(meta))


def _study(tmp_path: Path, n: int = 10) -> Path:
    d = tmp_path / "study"
    runs = d / "runs"
    runs.mkdir(parents=True)
    (d / "COMMIT").write_text(COMMIT + "\n")
    for seed in range(n):
        _write(runs, "grpo-fp32", seed, dip=seed < 7, reward=0.36)  # 7 of n dip
        _write(runs, "gspo-fp32", seed, dip=False, reward=0.37 + 0.001 * (seed % 3))
        _write(runs, "grpo-fp32-replay", seed, dip=seed == 0, reward=0.37)
        _write(runs, "gspo-fp8", seed, dip=False, reward=0.33 + 0.002 * seed)  # far below fp32
    return d


def _row(lines: list[str], ident: str) -> list[str]:
    return next(x.split(" | ") for x in lines if x.startswith(f"| {ident} |"))


def test_planted_study_verdicts(tmp_path: Path) -> None:
    d = _study(tmp_path)
    runs_dir = d / "runs"
    _write(runs_dir, "gspo-fp32-replay", 0, dip=True, reward=0.2, commit="f" * 40)  # excluded
    meta = {"arm": "gspo-bf16", "seed": 0, "commit": COMMIT, "status": "failed", "rc": 1}
    (runs_dir / "gspo-bf16-seed0.failed1.meta.json").write_text(json.dumps(meta))
    runs, failed, foreign = load_study(d)
    assert len(runs["grpo-fp32"]) == 10 and "gspo-fp32-replay" not in runs
    assert [m["arm"] for m in failed] == ["gspo-bf16"] and len(foreign) == 1
    lines = study_lines([a for b in STUDY_BLOCKS for a in b], d)
    text = "\n".join(lines)
    assert "failed attempts: 1 (gspo-bf16 seed 0, rc 1)" in text
    # H1a: 7/10 against 0/10; H1b: 7/10 against 1/10; Holm over the two.
    p_a, p_b = fisher_greater(7, 10, 0, 10), fisher_greater(7, 10, 1, 10)
    adj = holm([p_a, p_b])
    h1a, h1b = _row(lines, "H1a"), _row(lines, "H1b")
    assert h1a[2:4] == ["7/10", "0/10"] and h1b[3] == "1/10"
    assert h1a[5] == _p(adj[0]) and h1a[-1].startswith("supported")
    assert h1b[5] == _p(adj[1]) and h1b[-1].startswith("supported")
    # E1: gspo-fp32 - grpo-fp32-replay within +-0.002: equivalent; E5: FP8 0.01-0.04 below.
    e1, e5 = _row(lines, "E1"), _row(lines, "E5")
    assert e1[-1].startswith("equivalent within ±0.02")
    assert e5[-1].startswith("not shown equivalent; difference p = 0.002")
    d5 = [0.33 + 0.002 * s - (0.37 + 0.001 * (s % 3)) for s in range(10)]
    assert e5[4].startswith(_p(tost_paired(d5, 0.02)[0]))
    assert _row(lines, "E2")[-1] == "no paired data |"  # its only run is excluded


def test_interim_below_ten_seeds(tmp_path: Path) -> None:
    lines = study_lines(["grpo-fp32", "gspo-fp32", "grpo-fp32-replay"], _study(tmp_path, n=4))
    assert _row(lines, "H1a")[-1].startswith("INTERIM (n = 4 / 4 of 10)")
    assert _row(lines, "E1")[-1].startswith("INTERIM")


def test_dip_rule_and_last_mean(tmp_path: Path) -> None:
    d = _study(tmp_path, n=1)
    runs, _, _ = load_study(d)
    grpo, gspo = runs["grpo-fp32"][0], runs["gspo-fp32"][0]
    assert dipped(grpo) and not dipped(grpo, window=10)  # one step below: the 1-step rule only
    assert not dipped(gspo)
    assert last_mean(gspo) == 0.37 and math.isclose(
        last_mean(gspo, n=60), (10 * 0.15 + 50 * 0.37) / 60
    )
    assert dipped(gspo | {"meta": {"rc": 3}})  # stopped by the bad-step guard: counted as a dip


def test_study_order_is_interleaved_and_complete() -> None:
    order = study_order()
    assert len(order) == len(set(order)) == 10 * sum(len(b) for b in STUDY_BLOCKS)
    assert order[:6] == [("grpo-fp32", 3), ("gspo-fp32", 3), ("grpo-fp32-replay", 3),
                         ("gspo-fp32", 4), ("grpo-fp32-replay", 4), ("grpo-fp32", 4)]  # fmt: skip
    assert {s for _, s in order} == set(range(3, 13))  # 0..2 repeat the exploratory runs
    assert all(a in STUDY_BLOCKS[0] for a, _ in order[:30]) and order[30][0] in STUDY_BLOCKS[1]
    assert order[30] == ("gspo-bf16-fp32head", 3)  # block B's order rotated by 3 mod 5
    assert all(a in STUDY_ARMS for a, _ in order)


def test_a_run_is_done_only_with_its_meta(tmp_path: Path) -> None:
    from tools.evidence_study import run_complete

    plan = Plan(STUDY_ARMS["gspo-fp32"], 0, tmp_path, tmp_path)
    plan.data.write_text("{}\n")
    assert not run_complete(plan)  # data without meta: killed before its meta was written
    plan.meta.write_text(json.dumps({"status": "failed"}))
    assert not run_complete(plan)
    plan.meta.write_text(json.dumps({"status": "ok"}))
    assert run_complete(plan)


def test_audit_of_the_committed_exploratory_data() -> None:
    """The checks section on the committed data: the counts the review (issue 37) found by
    hand, and the fp32-logit length measurement at L = 32."""
    from tools.evidence_audit import audit_lines

    text = "\n".join(audit_lines())
    assert "| GRPO without replay, 4 mini-batches | 9 | 6 | 4 |" in text
    assert "| GRPO with replay | 3 | 0 | 0 |" in text
    assert "| GSPO, 4 mini-batches | 18 | 0 | 0 |" in text
    assert "| step60 | 32 | 13 of 16 | 5 of 16 |" in text
    assert "| step60 | 256 | 10 of 16 | 0 of 16 |" in text
    assert "| gspo-fp32 seed 0 | a0609c1 -> 3c843c0 | 100 of 100 |" in text


def test_fp8_table_prints_fp8_against_bf16() -> None:
    """The "FP8 against bf16" table carries the FP8 / bf16 mismatch ratios, recomputed here
    from the raw per-step files (it once printed the table before it instead)."""
    from tools.evidence_audit import audit_lines

    runs = Path(__file__).resolve().parents[1] / "docs" / "evidence" / "runs"

    def last10(arm: str) -> float:
        per_seed = []
        for f in sorted(runs.glob(f"{arm}-seed*.jsonl")):
            rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            by_step = {r["step"]: r for r in rows if "mismatch/abs_logp_diff" in r}
            tail = sorted(by_step)[-10:]
            per_seed.append(sum(by_step[s]["mismatch/abs_logp_diff"] for s in tail) / len(tail))
        return sum(per_seed) / len(per_seed)

    text = "\n".join(audit_lines())
    table = text[text.index("**FP8 against bf16") :].split("\n\n")[1]
    for fp8, bf16 in (("gspo-fp8", "gspo-bf16"), ("grpo-fp8", "grpo-bf16")):
        (row,) = [r for r in table.splitlines() if r.startswith(f"| {fp8} / {bf16} |")]
        assert f"= 1/{last10(bf16) / last10(fp8):.1f} |" in row


def test_every_number_in_the_study_findings_is_printed_by_the_report() -> None:
    """The hand-written findings only read the tables: each decimal or ratio in them (0.029,
    4.9e-03, 6/10) occurs in the study section or the checks the report prints."""
    import re

    from tools.evidence_audit import audit_lines
    from tools.evidence_study_report import FINDINGS, STUDY_DIR

    findings = (STUDY_DIR / FINDINGS).read_text()
    arms = [a for block in STUDY_BLOCKS for a in block]
    printed = "\n".join(study_lines(arms) + audit_lines())
    printed = printed[: printed.index("### Findings")] + printed[printed.index("## Checks"):]
    pattern = re.compile(r"(?<![\w.])-?\d+(?:\.\d+(?:e-\d+)?|/\d+)(?![\w.])")
    numbers = pattern.findall(findings)
    assert numbers, "no number found: the pattern is wrong"
    tokens = {n.lstrip("-") for n in pattern.findall(printed)}
    missing = sorted({n for n in numbers if n.lstrip("-") not in tokens})
    assert not missing, f"numbers in {FINDINGS} that the report does not print: {missing}"


def test_sources_reproduction_counts_equal_values(tmp_path: Path) -> None:
    """Planted: one value of three differs in the rerun; the real server's table pairs rows."""
    from tools.evidence_audit import sources_repro_lines

    old, new = tmp_path / "old", tmp_path / "old" / "v2"
    new.mkdir(parents=True)
    row = {"model": "step0", "length": 32, "entropy": 1.5, "bf16": {"abs_dlogp_token": 0.25,
           "outside_band": 0.5}}  # fmt: skip
    changed = {**row, "bf16": {"abs_dlogp_token": 0.25, "outside_band": 0.625}}
    (old / "stages.json").write_text(json.dumps({"hf": [row]}))
    (new / "stages.json").write_text(json.dumps({"hf": [changed], "provenance": {"commit": "abc1234def"}}))  # noqa: E501
    srv = {**row, "bf16-h32": {"abs_dlogp_token": 0.125, "outside_band": 0.0625}}
    (old / "lengths_sglang.json").write_text(json.dumps({"sglang": [srv]}))
    (new / "lengths_sglang.json").write_text(json.dumps({"sglang": [{**srv, "bf16": changed["bf16"]}]}))  # noqa: E501
    text = "\n".join(sources_repro_lines(old, new))
    assert "| stages.json | hf | abc1234 | 2 of 3 |" in text
    assert "| lengths_sglang.json | sglang | none | 4 of 5 |" in text
    assert "| step0 | 32 | 8 / 10 | 0.250 / 0.250 | 1 / 1 | 0.125 / 0.125 |" in text


def test_stop_at_is_the_next_occurrence_of_that_clock_time() -> None:
    """`--stop-at 02:05` given at 23:36 UTC stops 2.5 h later (it once stopped at once: the
    clock string "23:36" sorts after "02:05")."""
    import calendar

    import pytest

    from tools.evidence_study import stop_deadline

    t = calendar.timegm((2026, 12, 3, 23, 36, 0, 0, 0, 0))
    assert stop_deadline("02:05", t) - t == (2 * 60 + 29) * 60
    assert stop_deadline("23:59", t) - t == 23 * 60
    assert stop_deadline("23:36", t) == t  # now: no run starts
    for bad in ("2:5x", "24:00", "12"):
        with pytest.raises(ValueError, match="HH:MM"):
            stop_deadline(bad, t)
