"""Checks of the exploratory report's claims (issue 37), printed from the committed data.

    python tools/evidence_study.py --report      # writes them into docs/evidence.md

Every number the corrected findings (docs/evidence/notes.md) quote about the exploratory study
comes from here: whole-run entropy dips per arm, what 3 seeds can and cannot show on last-50
reward (exact tests, minimum detectable effects), the fp32-logit length measurement at every
L, the all-step vs last-10 mismatch of the L = 32 / 64 arms, the FP8 / bf16 mismatch ratios,
and the commits each arm's seeds ran at.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from tools.evidence_stats import mde_paired, sign_flip_p, tost_paired
from tools.evidence_study_report import DELTA, dipped, last_mean

__all__ = ["audit_lines"]

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "evidence" / "runs"
SOURCES = ROOT / "docs" / "evidence" / "mismatch_sources"
GROUPS = {
    "GRPO without replay, 4 mini-batches": ("grpo-fp32", "grpo-bf16", "grpo-fp8"),
    "GRPO with replay": ("grpo-fp32-replay",),
    "GSPO, 4 mini-batches": ("gspo-fp32", "gspo-bf16", "gspo-bf16-recompute",
                             "gspo-bf16-seqmask", "gspo-bf16-fp32head", "gspo-fp8"),
    "on-policy (1 mini-batch), GSPO and GRPO": ("gspo-bf16-mb1", "grpo-bf16-mb1"),
}  # fmt: skip
PAIRS = (
    ("gspo-bf16", "gspo-bf16-recompute"),
    ("gspo-bf16", "gspo-bf16-fp32head"),
    ("gspo-bf16", "gspo-bf16-seqmask"),
    ("grpo-fp32-replay", "grpo-fp32"),
    ("gspo-fp32", "grpo-fp32-replay"),
    ("gspo-fp8", "gspo-fp32"),
    ("gspo-fp8", "gspo-bf16"),
)


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in body
    ]


def _g(x: float) -> str:
    return f"{x:.2g}" if abs(x) < 0.01 else f"{x:.3f}"


def _mean_key(rs: list[dict[str, Any]], key: str, last: int | None) -> float:
    vals = []
    for r in rs:
        xs = [r["rows"][s][key] for s in sorted(r["rows"]) if key in r["rows"][s]]
        vals.append(statistics.fmean(xs[-last:] if last else xs))
    return statistics.fmean(vals)


def audit_lines(runs_dir: Path = RUNS, sources: Path = SOURCES) -> list[str]:
    """Markdown lines: the exploratory claims checked against their committed data."""
    from tools.evidence_report import load_runs

    runs = {a: [r for r in rs if r["rows"]] for a, rs in load_runs(runs_dir).items()}
    lines = ["## Checks of the exploratory study (issue 37; printed from its committed data)", ""]
    body = []
    for group, arms in GROUPS.items():
        rs = [r for a in arms for r in runs.get(a, [])]
        one, ten = sum(dipped(r) for r in rs), sum(dipped(r, 10) for r in rs)
        body.append([group, str(len(rs)), str(one), str(ten)])
    for a in sorted(runs):
        rs = runs[a]
        dips = [r["seed"] for r in rs if dipped(r)]
        ten = sum(dipped(r, 10) for r in rs)
        body.append([a, str(len(rs)), f"{len(dips)} (seeds {dips})", str(ten)])
    lines += [
        "**Whole-run entropy dips** (some step's `policy/entropy` < 0.1 x step 1's; the "
        "10-step column: some 10-step mean below it). Found after looking at the data: the "
        "pre-registered study tests it.",
        "",
        *_table(["arms", "runs", "dipped (1-step rule)", "dipped (10-step rule)"], body),
        "",
    ]
    body = []
    for a, b in PAIRS:
        vb = {r["seed"]: last_mean(r) for r in runs.get(b, [])}
        d = [last_mean(r) - vb[r["seed"]] for r in runs.get(a, []) if r["seed"] in vb]
        if len(d) < 2:
            continue
        sd = statistics.stdev(d)
        va = sorted(last_mean(r) for r in runs[a])
        body.append([
            f"{a} - {b}", str(len(d)), f"{statistics.fmean(d):+.4f} ± {sd:.4f}",
            f"{min(d):+.4f} .. {max(d):+.4f}", f"{sign_flip_p(d):.3f}",
            f"{tost_paired(d, DELTA)[0]:.3f}", f"{mde_paired(sd, len(d)):.3f}",
            f"{max(va):.4f} / {min(vb.values()):.4f}",
        ])  # fmt: skip
    lines += [
        "**Last-50 reward, paired by seed, 3 seeds**: the smallest two-sided sign-flip p with 3 "
        "pairs is 0.25 and the smallest TOST p 0.125, so no exploratory pair can show a "
        f"difference or equivalence within ±{DELTA} at 5%; MDE = (t_0.975 + t_0.8) sd / sqrt(n).",
        "",
        *_table(
            [
                "A - B",
                "pairs",
                "mean d ± sd",
                "range of d",
                "sign-flip p",
                "TOST p",
                "MDE",
                "max A / min B",
            ],
            body,
        ),  # fmt: skip
        "",
    ]
    body = []
    for arm in ("gspo-bf16", "gspo-bf16-L64"):
        rs = runs.get(arm, [])
        if not rs:
            continue
        cells = [arm, str(len(rs))]
        for key in ("mismatch/abs_logp_diff", "mismatch/seq_log_ratio_abs",
                    "mismatch/seq_outside_clip"):  # fmt: skip
            cells.append(f"{_g(_mean_key(rs, key, 10))} / {_g(_mean_key(rs, key, None))}")
        body.append(cells)
    lines += [
        "**L = 32 against L = 64** (bf16 server, GSPO), last 10 steps / all steps:",
        "",
        *_table(["arm", "seeds", "dlogp/token", "abs seq log-ratio", "outside band"], body),
        "",
    ]
    fp8_body = []
    for fp8, bf16 in (("gspo-fp8", "gspo-bf16"), ("grpo-fp8", "grpo-bf16")):
        if fp8 in runs and bf16 in runs:
            key = "mismatch/abs_logp_diff"
            x8, x16 = _mean_key(runs[fp8], key, 10), _mean_key(runs[bf16], key, 10)
            s8 = statistics.fmean(r["rows"][min(r["rows"])][key] for r in runs[fp8])
            s16 = statistics.fmean(r["rows"][min(r["rows"])][key] for r in runs[bf16])
            fp8_body.append([f"{fp8} / {bf16}", f"{_g(x8)} / {_g(x16)} = 1/{x16 / x8:.1f}",
                         f"{_g(s8)} / {_g(s16)} = {s8 / s16:.1f}x"])  # fmt: skip
    body = []
    for arm in ("gspo-bf16-fp32head", "gspo-bf16"):
        if arm in runs:
            key = "mismatch/seq_outside_clip"
            body.append([arm, str(len(runs[arm])), _g(_mean_key(runs[arm], key, None)),
                         _g(_mean_key(runs[arm], key, 10))])  # fmt: skip
    lines += [
        "**Training sequences outside GSPO's band from mismatch alone** (L = 32, first "
        "mini-batch, `mismatch/seq_outside_clip`), mean over steps and seeds:",
        "",
        *_table(["arm", "seeds", "all steps", "last 10 steps"], body),
        "",
    ]
    lines += [
        "**FP8 against bf16**, first-mini-batch dlogp/token (FP8's fp32 control is gspo-fp32, "
        "whose mismatch is 0 up to fp32 rounding):",
        "",
        *_table(["arms", "last 10 steps", "step 1"], fp8_body),
        "",
    ]
    lines += _reproduction_lines(runs, runs_dir.parent / "study" / "reproduction")
    lines += _routing_lines(runs_dir.parent / "fp8_routing" / "routing.json")
    lines += _length_lines(sources)
    lines += sources_repro_lines(sources, sources / "v2")
    body = []
    for a in sorted(runs):
        commits = sorted({(r["meta"].get("commit"), r["seed"]) for r in runs[a]})
        by: dict[str, list[int]] = {}
        for c, s in commits:
            by.setdefault(str(c), []).append(s)
        mb = sum(any(k.startswith("moe/routing_flip_rate_mb/") for k in r["rows"][max(r["rows"])])
                 for r in runs[a])  # fmt: skip
        body.append([a, "; ".join(f"{c}: seeds {s}" for c, s in sorted(by.items())), str(mb)])
    lines += [
        "**Provenance**: the commit of each exploratory seed, and how many runs logged the "
        "per-mini-batch router flip rate:",
        "",
        *_table(["arm", "commits", "runs with flip rate per mini-batch"], body),
        "",
    ]
    return lines


def _reproduction_lines(runs: dict[str, list[dict[str, Any]]], repro: Path) -> list[str]:
    """Reruns of exploratory (arm, seed) pairs at a later commit: steps with equal reward."""
    from tools.evidence_report import load_runs

    body = []
    for arm, rs in sorted(load_runs(repro).items()) if repro.exists() else []:
        old = {r["seed"]: r for r in runs.get(arm, [])}
        for r in rs:
            o = old.get(r["seed"])
            if not r["rows"] or o is None:
                continue
            same = sum(
                o["rows"].get(s, {}).get("reward/mean") == row.get("reward/mean")
                for s, row in r["rows"].items()
            )
            body.append([f"{arm} seed {r['seed']}", f"{o['meta']['commit']} -> "
                         f"{r['meta']['commit'][:7]}", f"{same} of {len(r['rows'])}"])  # fmt: skip
    if not body:
        return []
    return [
        "**Reproduction** (`docs/evidence/study/reproduction`): exploratory runs rerun at a "
        "later commit; steps whose `reward/mean` is equal to the last bit:",
        "",
        *_table(["run", "commits", "equal steps"], body),
        "",
    ]


def _routing_lines(path: Path) -> list[str]:
    """The FP8 routing check (plan S6, benchmarks/fp8_routing.py) from its JSON."""
    if not path.exists():
        return []
    doc = json.loads(path.read_text())
    body = []
    for r in doc["results"]:
        f8, b16 = r["fp8"], r["bf16"]
        body.append([
            r["model"], str(r["tokens"]), f"{r['fp32_margin_median']:.3f}",
            f"{r['fp32_margin_below_1e-2']:.3f}",
            f"{f8['route_disagreement']:.4f} ({' / '.join(f'{x:.4f}' for x in
                                                        f8['route_disagreement_per_layer'])})",
            f"{b16['route_disagreement']:.4f}", _g(f8["abs_dlogp_token"]),
            _g(b16["abs_dlogp_token"]),
        ])  # fmt: skip
    prov = doc["provenance"]
    return [
        "**FP8 routing check** (plan S6; `docs/evidence/fp8_routing/routing.json`, commit "
        f"{prov['commit'][:7]}, seed {prov['seed']}): share of (token, MoE layer) whose top-2 "
        "experts differ from the fp32 forward's, on 16 fp32-sampled sequences (prompt + 32 "
        "tokens); the fp32 router's margin between its 2nd and 3rd logit; dlogp per response "
        "token against fp32. step100: the final model of a 100-step gspo-fp8 run, seed 0.",
        "",
        *_table(
            [
                "model",
                "tokens",
                "fp32 margin (median)",
                "margin < 0.01",
                "FP8 flips (layer 0 / 1)",
                "bf16 flips",
                "FP8 dlogp/token",
                "bf16 dlogp/token",
            ],
            body,
        ),  # fmt: skip
        "",
    ]


def _length_lines(sources: Path) -> list[str]:
    f = sources / "lengths_sglang.json"
    if not f.exists():
        return []
    rows = json.loads(f.read_text())["sglang"]
    body = []
    for r in rows:
        n16, n32 = (round(16 * r[v]["outside_band"]) for v in ("bf16", "bf16-h32"))
        body.append([r["model"], str(r["length"]), f"{n16} of 16", f"{n32} of 16"])
    logits = [
        f"{r['model']}: {r['logit_token']:.2f} (top {r['logit_top']:.2f})"
        for r in json.loads((sources / "lengths.json").read_text())["hf"]
        if r["length"] == 32 and "logit_token" in r
    ]
    stages = json.loads((sources / "stages.json").read_text())["hf"]
    has = [s["model"] for s in stages if "logit_token" in s]
    return [
        "**Length measurement, real SGLang server** (`lengths_sglang.json`, 16 sequences per "
        "L): sequences whose first-mini-batch ratio alone lies outside GSPO's band.",
        "",
        *_table(["policy", "L", "bf16 logits", "fp32 logits"], body),
        "",
        f"Stages with the sampled token's logit in `stages.json`: {has or 'none'} (the "
        "per-stage logits once quoted for steps 15-45 are in no committed file). Mean logit "
        f"of the sampled token at L = 32 in `lengths.json`: {'; '.join(logits)}.",
        "",
    ]


def _values(rows: list[dict[str, Any]]) -> dict[tuple, float]:
    """Every number of a `mismatch_sources` JSON section, keyed by (model, L, scale, field...)."""
    out: dict[tuple, float] = {}
    for r in rows:
        key = (r.get("model"), r.get("length", 32), r.get("scale", 1.0))
        for k, v in r.items():
            if isinstance(v, dict):
                out.update({key + (k, kk): vv for kk, vv in v.items()
                            if isinstance(vv, (int, float))})  # fmt: skip
            elif isinstance(v, (int, float)) and k not in ("length", "scale"):
                out[key + (k,)] = v
    return out


def sources_repro_lines(old: Path, new: Path) -> list[str]:
    """The `mismatch_sources` measurements rerun from one command with provenance
    (`tools/mismatch_sources_run.py`, into `new`) against the files without provenance (`old`):
    values equal to the last bit per file and section; the real server's length table side by
    side (its sampling is not seeded alike between launches, so its 16 samples differ)."""
    if not new.is_dir():
        return []
    body = []
    for f in sorted(new.glob("*.json")):
        if not (old / f.name).exists():
            continue
        a, b = json.loads((old / f.name).read_text()), json.loads(f.read_text())
        commit = str(b.get("provenance", {}).get("commit", "none"))[:7]
        for sec in ("hf", "sglang"):
            va, vb = _values(a.get(sec) or []), _values(b.get(sec) or [])
            common = set(va) & set(vb)
            if common:
                eq = sum(va[k] == vb[k] for k in common)
                body.append([f.name, sec, commit, f"{eq} of {len(common)}"])
    lines = [
        "**Mismatch sources, reproduced** (`python tools/mismatch_sources_run.py`: the 60-step "
        "checkpoint run, its conversions and every measurement, each JSON in "
        "`docs/evidence/mismatch_sources/v2` with its commit, command, seed and load): values "
        "equal to the last bit against the earlier files (no provenance). `hf` = in-process "
        "recomputation, `sglang` = the real server's own samples.",
        "",
        *_table(["file", "section", "commit", "equal values"], body),
        "",
    ]
    fa, fb = old / "lengths_sglang.json", new / "lengths_sglang.json"
    if fa.exists() and fb.exists():
        ra = {(r["model"], r["length"]): r for r in json.loads(fa.read_text())["sglang"]}
        rows = []
        for r in json.loads(fb.read_text())["sglang"]:
            o = ra.get((r["model"], r["length"]))
            if o is None:
                continue
            cells = [r["model"], str(r["length"])]
            for v in ("bf16", "bf16-h32"):
                n_old, n_new = (round(16 * x[v]["outside_band"]) for x in (o, r))
                d_old, d_new = (_g(x[v]["abs_dlogp_token"]) for x in (o, r))
                cells += [f"{n_old} / {n_new}", f"{d_old} / {d_new}"]
            rows.append(cells)
        lines += [
            "The real server's length measurement, first run / rerun (sequences of 16 outside "
            "GSPO's band; per-token mismatch):",
            "",
            *_table(["policy", "L", "bf16 logits: outside", "per token", "fp32 logits: outside",
                     "per token"], rows),  # fmt: skip
            "",
        ]
    return lines
