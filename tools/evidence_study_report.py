"""The pre-registered study's section of docs/evidence.md (issue 37; docs/evidence/plan.md).

    python tools/evidence_study.py --report

Reads the committed runs of `docs/evidence/study/runs` (only those made at the study commit,
`docs/evidence/study/COMMIT`), applies the plan's rules (entropy dip, last-50 reward) and tests
(`tools/evidence_stats.py`), and returns markdown lines: the runs so far, the primary families
P1 (dip rates, one-sided Fisher + Holm, exact McNemar beside) and P2 (paired TOST within
+-0.02 + Holm, with the two-sided sign-flip test and its minimum detectable effect), the
secondary comparisons and descriptive metrics. A comparison whose arms have fewer than 10 seeds
is labelled INTERIM: its numbers are printed, no verdict.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tools.evidence_stats import (
    fisher_greater,
    fisher_two_sided,
    holm,
    mcnemar_greater,
    mde_paired,
    mde_rate,
    sign_flip_p,
    tost_paired,
)

__all__ = ["N_PLANNED", "StudyRun", "dipped", "last_mean", "load_study", "study_lines"]

ROOT = Path(__file__).resolve().parents[1]
STUDY_DIR = ROOT / "docs" / "evidence" / "study"
N_PLANNED = 10
ALPHA = 0.05
DELTA = 0.02
"""The equivalence margin on last-50 reward (plan, section 2)."""
FINDINGS = "findings.md"
"""Hand-written answers to the plan's hypotheses, next to the runs (printed after the tables)."""
DIP_FRACTION = 0.1
"""Entropy dip: policy/entropy below this share of its step-1 value (plan, section 2)."""
P1 = (("H1a", "grpo-fp32", "gspo-fp32"), ("H1b", "grpo-fp32", "grpo-fp32-replay"))
P2 = (
    ("E1", "gspo-fp32", "grpo-fp32-replay"),
    ("E2", "gspo-fp32", "gspo-fp32-replay"),
    ("E3", "gspo-bf16", "gspo-bf16-recompute"),
    ("E4", "gspo-bf16-fp32head", "gspo-bf16"),
    ("E5", "gspo-fp8", "gspo-fp32"),
)
S2_DIPS = (
    ("S2a", "grpo-fp32-deep", "gspo-fp32-deep"),
    ("S2b", "grpo-fp32-deep", "grpo-fp32-replay-deep"),
)
S2_EQ = (("S2c", "gspo-fp32-deep", "grpo-fp32-replay-deep"),)

StudyRun = dict[str, Any]
"""{"seed", "meta", "rows": {step: {key: value}}} as tools/evidence_report.load_runs gives."""


def study_commit(study_dir: Path = STUDY_DIR) -> str | None:
    """The full hash every study run must carry (docs/evidence/study/COMMIT), or None."""
    f = study_dir / "COMMIT"
    return f.read_text().split()[0] if f.exists() else None


def load_study(
    study_dir: Path = STUDY_DIR,
) -> tuple[dict[str, list[StudyRun]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(arm -> runs with data at the study commit, failed attempts, runs at another commit)."""
    from tools.evidence_report import load_runs

    commit = study_commit(study_dir)
    runs: dict[str, list[StudyRun]] = {}
    failed, foreign = [], []
    for arm, rs in load_runs(study_dir / "runs").items():
        for r in rs:
            if commit is None or r["meta"].get("commit") != commit or r["meta"].get("dirty"):
                foreign.append(r["meta"])
            elif r["rows"]:
                runs.setdefault(arm, []).append(r)
            else:
                failed.append(r["meta"])
    for rs in runs.values():
        rs.sort(key=lambda r: r["seed"])
    return runs, failed, foreign


def _series(rows: Mapping[int, Mapping[str, float]], key: str) -> list[float]:
    return [rows[s][key] for s in sorted(rows) if key in rows[s]]


def dipped(run: StudyRun, window: int = 1) -> bool:
    """The plan's entropy dip: some `window`-step mean of policy/entropy below DIP_FRACTION x
    step 1's, a non-finite entropy, or a stop by the trainer's bad-step guard (exit 3)."""
    if run["meta"].get("rc") == 3:
        return True
    ent = _series(run["rows"], "policy/entropy")
    if not ent or any(not math.isfinite(e) for e in ent):
        return True
    means = [statistics.fmean(ent[i : i + window]) for i in range(len(ent) - window + 1)]
    return min(means) < DIP_FRACTION * ent[0]


def _safe(fn: Callable[[list[float]], float], xs: list[float]) -> float:
    return fn(xs) if xs else math.nan


def last_mean(run: StudyRun, key: str = "reward/mean", n: int = 50) -> float:
    """Mean of `key` over the run's last `n` logged steps (steps 51..100 for n = 50)."""
    return _safe(statistics.fmean, _series(run["rows"], key)[-n:])


def _f(x: float | None, digits: int = 3) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    if x != 0 and abs(x) < 10 ** -(digits - 1):
        return f"{x:.1e}"
    return f"{x:.{digits}f}"


def _p(p: float) -> str:
    return f"{p:.2g}" if p < 0.01 else f"{p:.3f}"


def _msd(xs: Sequence[float]) -> str:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return "-"
    if len(xs) == 1:
        return _f(xs[0])
    return f"{_f(statistics.fmean(xs))} ± {_f(statistics.stdev(xs))}"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in body
    ]


def _interim(na: int, nb: int) -> str | None:
    if min(na, nb) >= N_PLANNED:
        return None
    return f"INTERIM (n = {na} / {nb} of {N_PLANNED}): no verdict"


def dip_rows(
    runs: Mapping[str, list[StudyRun]],
    tests: Sequence[tuple[str, str, str]],
    window: int = 1,
    one_sided: bool = True,
) -> list[list[str]]:
    """One table row per dip comparison (A higher than B), Holm over the rows."""
    ps: list[float] = []
    for _, a, b in tests:
        ra, rb = runs.get(a, []), runs.get(b, [])
        xa, xb = sum(dipped(r, window) for r in ra), sum(dipped(r, window) for r in rb)
        test = fisher_greater if one_sided else fisher_two_sided
        ps.append(test(xa, len(ra), xb, len(rb)) if ra and rb else math.nan)
    adj = iter(holm([p for p in ps if math.isfinite(p)]))
    out = []
    for (name, a, b), p in zip(tests, ps, strict=True):
        ra, rb = runs.get(a, []), runs.get(b, [])
        na, nb = len(ra), len(rb)
        xa, xb = sum(dipped(r, window) for r in ra), sum(dipped(r, window) for r in rb)
        if not math.isfinite(p):
            out.append([name, f"{a} vs {b}", f"{xa}/{na}", f"{xb}/{nb}", "-", "-", "-", "-",
                        "no data"])  # fmt: skip
            continue
        p_adj = next(adj)
        pb = {r["seed"]: dipped(r, window) for r in rb}
        pairs = [(dipped(r, window), pb[r["seed"]]) for r in ra if r["seed"] in pb]
        mc = mcnemar_greater([x for x, _ in pairs], [y for _, y in pairs]) if pairs else math.nan
        mde = mde_rate(xb / nb, na, nb, alpha=ALPHA / 2) if one_sided else None
        verdict = _interim(na, nb)
        if verdict is None:
            if p_adj < ALPHA:
                verdict = "supported"
            else:
                verdict = "not shown (no difference detected"
                verdict += f"; detectable: rate >= {_f(mde, 2)})" if mde else ")"
        out.append([
            name, f"{a} vs {b}", f"{xa}/{na}", f"{xb}/{nb}", _p(p), _p(p_adj),
            f"{_p(mc)} ({len(pairs)} pairs)" if pairs else "-",
            _f(mde, 2) if mde is not None else ("none reachable" if one_sided else "-"),
            verdict,
        ])  # fmt: skip
    return out


def paired_diffs(
    runs: Mapping[str, list[StudyRun]], a: str, b: str, fn: Callable[[StudyRun], float]
) -> list[float]:
    """fn(A) - fn(B) per seed both arms ran, by seed."""
    vb = {r["seed"]: fn(r) for r in runs.get(b, [])}
    return [fn(r) - vb[r["seed"]] for r in runs.get(a, []) if r["seed"] in vb]


def tost_rows(
    runs: Mapping[str, list[StudyRun]], tests: Sequence[tuple[str, str, str]]
) -> list[list[str]]:
    """One table row per equivalence pair on last-50 reward, Holm over the TOST p-values."""
    ds = [paired_diffs(runs, a, b, last_mean) for _, a, b in tests]
    p_tost = [tost_paired(d, DELTA)[0] if d else math.nan for d in ds]
    valid = [p for p in p_tost if math.isfinite(p)]
    adj = iter(holm(valid))
    out = []
    for (name, a, b), d, pt in zip(tests, ds, p_tost, strict=True):
        na, nb = len(runs.get(a, [])), len(runs.get(b, []))
        if not d:
            out.append([name, f"{a} - {b}", "0", "-", "-", "-", "-", "-", "no paired data"])
            continue
        p_adj = next(adj)
        sd = statistics.stdev(d) if len(d) > 1 else math.nan
        p_two = sign_flip_p(d, "two-sided")
        mde = mde_paired(sd, len(d)) if len(d) > 1 else math.inf
        verdict = _interim(na, nb)
        if verdict is None:
            eq = f"equivalent within ±{DELTA}" if p_adj < ALPHA else "not shown equivalent"
            diff = (f"difference p = {_p(p_two)}" if p_two < ALPHA
                    else f"no difference detected (MDE {_f(mde)})")  # fmt: skip
            verdict = f"{eq}; {diff}"
        out.append([
            name, f"{a} - {b}", str(len(d)), f"{_f(statistics.fmean(d))} ± {_f(sd)}",
            f"{_p(pt)} ({_p(p_adj)})", _p(p_two), _f(mde), f"{min(d):+.3f} .. {max(d):+.3f}",
            verdict,
        ])  # fmt: skip
    return out


_OUT, _FLIP = "mismatch/seq_outside_clip", "moe/routing_flip_rate"


def _describe(runs: Mapping[str, list[StudyRun]], arms: Sequence[str]) -> list[list[str]]:
    body = []
    for a in arms:
        rs = runs.get(a, [])
        if not rs:
            body.append([a, "0"] + ["-"] * 10)
            continue

        def col(fn: Callable[[StudyRun], float], rs: list[StudyRun] = rs) -> str:
            return _msd([fn(r) for r in rs])

        body.append([
            a, str(len(rs)), ",".join(str(r["seed"]) for r in rs),
            f"{sum(dipped(r) for r in rs)} / {sum(dipped(r, 10) for r in rs)}",
            col(last_mean), col(lambda r: last_mean(r, n=10)),
            col(lambda r: _safe(min, _series(r["rows"], "policy/entropy"))),
            col(lambda r: _safe(statistics.fmean, _series(r["rows"], "first_mb/policy/clip_frac"))),
            col(lambda r: last_mean(r, "mismatch/abs_logp_diff", 10)),
            col(lambda r: _safe(statistics.median, _series(r["rows"], _OUT))),
            col(lambda r: _safe(statistics.fmean, _series(r["rows"], _FLIP)[:10])),
            col(lambda r: last_mean(r, _FLIP, 10)),
        ])  # fmt: skip
    return body


def study_lines(arms: Sequence[str], study_dir: Path = STUDY_DIR) -> list[str]:
    """The markdown section of the pre-registered study (see the module docstring)."""
    runs, failed, foreign = load_study(study_dir)
    commit = study_commit(study_dir)
    metas = [r["meta"] for rs in runs.values() for r in rs]
    lines = [
        "## Pre-registered study (issue 37)",
        "",
        "Plan: `docs/evidence/plan.md` (committed before the first run). Data: "
        "`docs/evidence/study/runs`, all made at the study commit "
        f"`{commit or 'not set'}` (`docs/evidence/study/COMMIT`), from a detached worktree of "
        "it; this section is computed by `python tools/evidence_study.py --report` (rules and "
        "tests: `tools/evidence_study_report.py`, `tools/evidence_stats.py`). Resume the runs "
        "(runs whose data exist are skipped; `--dry-run` prints the order and what is done; "
        "the bf16 arms need the engine venv of `bash scripts/engine_env.sh`):",
        "",
        f"    git worktree add --detach ../study-run {commit or 'COMMIT'}",
        "    mkdir -p ../study-run/docs/evidence/study/runs",
        "    cp docs/evidence/study/runs/* ../study-run/docs/evidence/study/runs/  # done runs",
        '    cd ../study-run && PYTHONPATH=. "$(bash scripts/env.sh)"/bin/python \\',
        "        tools/evidence_study.py --study --stop-at HH:MM   # UTC; starts no run after",
        "    # as runs end: copy docs/evidence/study/runs/<arm>-seed<k>.* back and commit them",
        "",
    ]
    total = sum(len(rs) for rs in runs.values())
    loads = [m["loadavg_start"][0] for m in metas if m.get("loadavg_start")]
    walls = [m["wall_s"] for m in metas if "wall_s" in m]
    lines.append(
        f"Runs with data: {total} of {N_PLANNED * len(arms)}; failed attempts: {len(failed)}"
        + "".join(f" ({m['arm']} seed {m['seed']}, rc {m.get('rc')})" for m in failed)
        + f"; runs excluded for another commit or a dirty tree: {len(foreign)}."
        + (
            f" Wall time per run {min(walls):.0f}-{max(walls):.0f} s at 1-min load averages "
            f"{min(loads):.1f}-{max(loads):.1f} at start (2 shared cores, nice 19)."
            if walls
            else ""
        )  # fmt: skip
    )
    lines += ["", "### Runs per arm (mean ± sd over seeds)", ""]
    header = ["arm", "n", "seeds", "dips (1-step / 10-step)", "last-50 reward",
              "last-10 reward", "min entropy", "1st-mb clip frac", "dlogp/token last 10",
              "outside band (median step)", "flip rate first 10", "flip rate last 10"]  # fmt: skip
    lines += _table(header, _describe(runs, arms)) + [""]
    dip_head = ["id", "A vs B", "A dips", "B dips", "Fisher p (one-sided)", "Holm p",
                "McNemar p (paired)", "MDE: rate of A", "verdict"]  # fmt: skip
    lines += [
        "### P1: entropy-dip rates (primary; dip = some step's entropy < 0.1 x step 1's)",
        "",
        *_table(dip_head, dip_rows(runs, P1)),
        "",
        f"alpha = {ALPHA} per family, Holm within P1 and within P2 (plan, section 3). "
        "MDE: the smallest dip rate of A that the one-sided Fisher test at 0.025 (Holm's first "
        "step) detects with 80% power against B's observed rate.",
        "",
    ]
    eq_head = ["id", "A - B (last-50 reward)", "pairs", "mean d ± sd", "TOST p (Holm)",
               "two-sided sign-flip p", "MDE (80%, 5%)", "range of d", "verdict"]  # fmt: skip
    lines += [
        f"### P2: last-50 reward equivalence (primary; TOST within ±{DELTA}, paired by seed)",
        "",
        *_table(eq_head, tost_rows(runs, P2)),
        "",
        "### Secondary",
        "",
        "S1 (two-sided Fisher): replay and GSPO's dip rate; S5: P1 with the 10-step window; "
        "S2: the deeper model (its own Holm family).",
        "",
        *_table(
            dip_head, dip_rows(runs, (("S1", "gspo-fp32-replay", "gspo-fp32"),), one_sided=False)
        ),  # fmt: skip
        *_table(dip_head, dip_rows(runs, [(f"S5 ({h})", a, b) for h, a, b in P1], 10))[2:],
        *_table(dip_head, dip_rows(runs, S2_DIPS))[2:],
        "",
        *_table(eq_head, tost_rows(runs, S2_EQ)),
        "",
    ]
    findings = study_dir / FINDINGS
    if findings.is_file():
        lines += [
            f"### Findings (hand-written: `docs/evidence/study/{FINDINGS}`; every number in it "
            "is printed in the tables of this page)",
            "",
            *findings.read_text().rstrip().splitlines(),
            "",
        ]
    return lines
