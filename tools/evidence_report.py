"""docs/evidence.md from the committed per-step data of tools/evidence_study.py (no rerun).

    python tools/evidence_study.py --report

Per arm, over its seeds: reward curve (mean and min..max band), first-10 / last-10 mean reward,
clip fractions, first-mini-batch engine/trainer mismatch per token and per sequence, the share
of sequences whose engine/trainer sequence ratio alone lies outside the clip band by response
length, the router flip rate, and collapse flags. Plots (matplotlib, when installed) go to
docs/evidence/img/ next to the data; without matplotlib the report has tables only. Findings
written by hand go in notes.md next to the data directory (docs/evidence/notes.md) and are
copied into the report.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_gspo.algo.length_bins import LENGTH_BINS, bin_label

__all__ = ["collapse_flags", "load_runs", "write_report"]

WINDOW = 10
_R = "reward/mean"
DROP_MARGIN = 0.1
"""Reward drop flag: the best 10-step mean reward minus the last 10-step mean exceeds this."""
ENTROPY_FLOOR = 0.1
"""Entropy collapse flag: last-10 mean entropy below this share of the step-1 entropy."""


def load_runs(data_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """arm -> [{"seed", "meta", "rows": {step: {key: float}}}] from <arm>-seed<k>.jsonl / .meta.json
    (a failed run has a meta file and no rows)."""
    from megatron_gspo.run.metrics_log import read_metrics

    runs: dict[str, list[dict[str, Any]]] = {}
    for meta_path in sorted(Path(data_dir).glob("*.meta.json")):
        meta = json.loads(meta_path.read_text())
        data = meta_path.with_name(meta_path.name.removesuffix(".meta.json") + ".jsonl")
        rows = read_metrics(data) if data.exists() and meta.get("status") == "ok" else {}
        runs.setdefault(meta["arm"], []).append({"seed": meta["seed"], "meta": meta, "rows": rows})
    return runs


def _series(rows: Mapping[int, Mapping[str, float]], key: str) -> list[float]:
    return [r[key] for r in rows.values() if key in r]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def collapse_flags(rows: Mapping[int, Mapping[str, float]]) -> list[str]:
    """Which collapses one run shows: "reward drop", "entropy collapse", "non-finite"."""
    flags = []
    reward = _series(rows, "reward/mean")
    if len(reward) >= 2 * WINDOW:
        rolling = [_mean(reward[i : i + WINDOW]) for i in range(len(reward) - WINDOW + 1)]
        if max(rolling) - rolling[-1] > DROP_MARGIN:
            flags.append("reward drop")
    ent = _series(rows, "policy/entropy")
    if len(ent) > WINDOW and _mean(ent[-WINDOW:]) < ENTROPY_FLOOR * ent[0]:
        flags.append("entropy collapse")
    keys = ("reward/mean", "loss", "grad_norm", "policy/entropy")
    bad = any(not math.isfinite(v) for r in rows.values() for k, v in r.items() if k in keys)
    if bad or any(r.get("train/skipped_updates", 0) > 0 for r in rows.values()):
        flags.append("non-finite")
    return flags


def _fmt(x: float, digits: int = 3) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    if x != 0 and abs(x) < 10 ** -(digits - 1):
        return f"{x:.1e}"
    return f"{x:.{digits}f}"


def _over_seeds(values: list[float]) -> str:
    """mean ± sd over seeds (sd only with 2+ seeds)."""
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return "-"
    if len(vals) == 1:
        return _fmt(vals[0])
    return f"{_fmt(statistics.fmean(vals))} ± {_fmt(statistics.stdev(vals))}"


def _per_run(runs: list[dict[str, Any]], fn: Any) -> list[float]:
    return [fn(r["rows"]) for r in runs if r["rows"]]


def _first(key: str) -> Any:
    return lambda rows: (_series(rows, key) or [float("nan")])[0]


def _last(key: str) -> Any:
    return lambda rows: _mean(_series(rows, key)[-WINDOW:])


def _head(key: str) -> Any:
    return lambda rows: _mean(_series(rows, key)[:WINDOW])


def _all(key: str) -> Any:
    return lambda rows: _mean(_series(rows, key))


def _median(key: str) -> Any:
    return lambda rows: statistics.median(_series(rows, key) or [float("nan")])


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in body]


def _plots(runs: dict[str, list[dict[str, Any]]], img_dir: Path, link: str) -> list[str]:
    """Write the PNGs; return their markdown lines (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(matplotlib is not installed: tables only)"]
    img_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for fname, key, title, log in (
        ("reward.png", "reward/mean", "mean reward per step (band: min..max over seeds)", False),
        ("mismatch_token.png", "mismatch/abs_logp_diff", "1st mini-batch abs logp diff", True),
        ("mismatch_seq.png", "mismatch/seq_outside_clip", "share outside clip band", False),
        ("entropy.png", "policy/entropy", "policy entropy per token", False),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        for arm, rs in sorted(runs.items()):
            curves = [_series(r["rows"], key) for r in rs if r["rows"]]
            curves = [c for c in curves if c]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            steps = list(range(1, n + 1))
            mean = [_mean([c[i] for c in curves]) for i in range(n)]
            line = ax.plot(steps, mean, label=f"{arm} ({len(curves)})")[0]
            if len(curves) > 1:
                lo = [min(c[i] for c in curves) for i in range(n)]
                hi = [max(c[i] for c in curves) for i in range(n)]
                ax.fill_between(steps, lo, hi, alpha=0.2, color=line.get_color())
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(img_dir / fname, dpi=80)
        plt.close(fig)
        out.append(f"![{title}]({link}/{fname})")
    return out


def write_report(
    data_dir: Path,
    out: Path,
    arms: Mapping[str, Any],
    skipped: Mapping[str, str | None],
    preface: list[str] | None = None,
) -> Path:
    """Regenerate the report `out` from every run under `data_dir`; `preface` (markdown lines:
    the pre-registered study) goes first, and the runs of `data_dir` follow as exploratory."""
    runs = load_runs(data_dir)
    img_dir = out.parent / out.stem / "img"  # docs/evidence.md: docs/evidence/img
    lines = [
        "# Evidence: GSPO on engine log-probs, without Routing Replay (issues 22, 37)",
        "",
        *(preface or []),
        "# Exploratory study (issue 22): hypotheses found here, not confirmed here",
        "",
        "Generated by `python tools/evidence_study.py --report` from the per-step data in "
        f"`{_rel(data_dir)}` (one `<arm>-seed<k>.jsonl` per run, provenance in `.meta.json`); "
        "do not edit by hand. Setup: `examples/evidence_cpu.yaml` (tiny Qwen3-MoE, 2 CPU ranks, "
        "EP=2; 4 prompts x 4 responses per step), task `megatron_gspo/data/pattern.py` (repeat a "
        "1-2 digit pattern to L characters, reward graded per position), `L = "
        "rollout.max_new_tokens`. fp32 = the embedded engine (the trainer's dtype); bf16 = the "
        "real SGLang server on CPU in bf16. Mismatch figures are from the first mini-batch of "
        "each step, where the trainer has not moved yet.",
        "",
    ]
    done = [a for a in arms if any(r["rows"] for r in runs.get(a, []))]
    body = []
    for a in arms:
        rs = runs.get(a, [])
        ok = [r for r in rs if r["rows"]]
        failed = [r for r in rs if not r["rows"]]
        if ok:
            status = f"{len(ok)} run(s), seeds {sorted(r['seed'] for r in ok)}"
        elif skipped.get(a):
            status = f"not run: {skipped[a]}"
        else:
            status = "not run yet"
        if failed:
            status += f"; {len(failed)} failed (seeds {sorted(r['seed'] for r in failed)})"
        status += "".join(
            f"; seed {r['seed']}: {r['meta']['note']}" for r in rs if "note" in r["meta"]
        )
        body.append([a, getattr(arms[a], "note", ""), status])
    lines += ["## Arms", ""] + _table(["arm", "what", "status"], body) + [""]
    notes = Path(data_dir).parent / "notes.md"
    if notes.exists():  # hand-written findings, kept across regenerations
        lines += ["## Findings (hand-written: `" + _rel(notes) + "`)", "", notes.read_text(), ""]
    if not done:
        lines += ["No run has data yet.", ""]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines))
        return out

    def rows_for(fns: list[Any]) -> list[list[str]]:
        return [[a] + [_over_seeds(_per_run(runs[a], f)) for f in fns] for a in done]

    lines += ["## Reward (mean ± sd over seeds)", ""]
    body = []
    for a in done:
        ok = [r for r in runs[a] if r["rows"]]
        steps = min(len(r["rows"]) for r in ok)
        walls = [r["meta"].get("wall_s", float("nan")) for r in ok]
        loads = [r["meta"].get("loadavg_start", [float("nan")])[0] for r in ok]
        flags = sorted({f for r in ok for f in collapse_flags(r["rows"])})
        reward = [_over_seeds(_per_run(runs[a], f)) for f in (_head(_R), _last(_R))]
        body.append(
            [a, str(len(ok)), str(steps), *reward]
            + [f"{_mean(walls):.0f} (load {_mean(loads):.1f})", ", ".join(flags) or "none"]
        )
    header = ["arm", "seeds", "steps", "first 10", "last 10 (final)", "wall s / run", "collapse"]
    lines += _table(header, body) + [""]
    lines += [
        f"Collapse flags: reward drop = best {WINDOW}-step mean minus last {WINDOW}-step mean "
        f"> {DROP_MARGIN}; entropy collapse = last-{WINDOW} entropy < {ENTROPY_FLOOR} x step 1; "
        "non-finite = a non-finite reward, loss, gradient norm or entropy, or a skipped update.",
        "",
        "## Clipping and engine/trainer mismatch",
        "",
    ]
    header = [
        "arm",
        "clip frac (all mb)",
        "clip frac (1st mb)",
        "abs dlogp/token, step 1",
        "abs dlogp/token, last 10",
        "abs seq log-ratio, last 10",
        "outside clip (median step)",
    ]
    fns = [
        _all("policy/clip_frac"),
        _all("first_mb/policy/clip_frac"),
        _first("mismatch/abs_logp_diff"),
        _last("mismatch/abs_logp_diff"),
        _last("mismatch/seq_log_ratio_abs"),
        _median("mismatch/seq_outside_clip"),
    ]
    lines += _table(header, rows_for(fns)) + [""]
    labels = [bin_label(lo, hi) for lo, hi in LENGTH_BINS]
    present = [
        b
        for b in labels
        if any(
            _series(r["rows"], f"mismatch/seq_outside_clip_len/{b}") for a in done for r in runs[a]
        )
    ]
    lines += [
        "## Share of sequences outside the clip band, by response length",
        "",
        "Per step: share of first-mini-batch sequences in the length bin whose engine-vs-"
        "trainer sequence log-ratio alone lies outside GSPO's clip band; averaged over the "
        "steps and seeds that had sequences in the bin (a step with one sequence in a bin "
        "weighs as much as a step with many: bins away from L are noisy). In brackets: mean "
        "|sequence log-ratio|. GRPO arms measure against GRPO's own, 500x wider band.",
        "",
    ]
    if present:
        body = []
        for a in done:
            cells = []
            for b in present:
                share = _over_seeds(_per_run(runs[a], _all(f"mismatch/seq_outside_clip_len/{b}")))
                mag = _per_run(runs[a], _all(f"mismatch/seq_log_ratio_abs_len/{b}"))
                cells.append(f"{share} ({_fmt(_mean([m for m in mag if math.isfinite(m)]))})")
            body.append([a] + cells)
        lines += _table(["arm"] + [f"len {b}" for b in present], body) + [""]
    else:
        lines += ["(no run logged the per-length metrics)", ""]
    lines += [
        "## Router flip rate",
        "",
        "`moe/routing_flip_rate`: share of probed (token, MoE layer) whose top-k experts differ "
        "between the rollout policy and the policy after the step's last mini-batch; `mb k`: "
        "`moe/routing_flip_rate_mb/<k>`, the same against the weights mini-batch k trains at "
        "(after k - 1 optimizer steps), as first 10 / last 10 step means (runs made before "
        "`train.routing_flip_per_minibatch` existed lack it: `-`).",
        "",
    ]
    flip = "moe/routing_flip_rate"
    fns = [_first(flip), _head(flip), _last(flip)]
    ks = sorted(
        {int(k.rsplit("/", 1)[1]) for a in done for r in runs[a] for row in r["rows"].values()
         for k in row if k.startswith(flip + "_mb/")}
    )  # fmt: skip
    body = rows_for(fns)
    for row, a in zip(body, done, strict=True):
        for k in ks:
            key = f"{flip}_mb/{k}"
            head, last = (_over_seeds(_per_run(runs[a], f(key))) for f in (_head, _last))
            row.append("-" if head == "-" else f"{head} / {last}")
    header = ["arm", "step 1", "first 10", "last 10"] + [f"mb {k}" for k in ks]
    lines += _table(header, body) + [""]
    link = img_dir.relative_to(out.parent).as_posix()
    plots = _plots({a: runs[a] for a in done}, img_dir, link)
    lines += ["## Plots", ""] + [p + "\n" for p in plots]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return out


def _rel(p: Path) -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        return str(Path(p).resolve().relative_to(root))
    except ValueError:
        return str(p)
