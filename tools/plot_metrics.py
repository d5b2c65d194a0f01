"""Plot metrics from a run's metrics.jsonl against the step, to a PNG.

    python tools/plot_metrics.py runs/tiny/metrics.jsonl --out reward.png
    python tools/plot_metrics.py runs/tiny/metrics.jsonl --keys reward/mean,policy/loss --smooth 5

One panel per key (default: the reward mean, the held-out evaluation's reward mean and pass@k
when the run evaluated (`eval.every`), and the clip fractions that are present). A key logged
only at some steps (evaluation) is drawn with markers. Repeated
steps (a resumed run appends) keep their last value; non-finite values ("nan"/"inf" in the file)
are left as gaps.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: this checkout's package, Ctrl-C as one line
    import sys
    from pathlib import Path

    _root = str(Path(__file__).resolve().parents[1])
    if _root not in sys.path:
        sys.path.insert(0, _root)
    from megatron_gspo.run.interrupt import quiet_ctrl_c

    quiet_ctrl_c(Path(__file__).name)

import argparse
import math
from pathlib import Path

from megatron_gspo.run.metrics_log import read_metrics

DEFAULT_KEYS = (
    "reward/mean",
    "eval/reward_mean",
    "eval/pass@*",  # every pass@k the run logged
    "policy/clip_frac",
    "policy/clip_frac_low",
    "policy/clip_frac_high",
)


def _smooth(values: list[float], window: int) -> list[float]:
    if window <= 1:
        return values
    out = []
    for i in range(len(values)):
        win = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(win) / len(win) if win else float("nan"))
    return out


def plot(
    rows: dict[int, dict[str, float]],
    keys: list[str],
    out: str | Path,
    *,
    smooth: int = 1,
    title: str | None = None,
) -> Path:
    """Draw one panel per key (vs step) and save a PNG; returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # no display; also safe under pytest on a headless machine
    import matplotlib.pyplot as plt

    if not keys:
        raise ValueError("no keys to plot")
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.4 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        steps = [s for s, r in rows.items() if key in r]
        values = [rows[s][key] for s in steps]
        sparse = 2 * len(steps) < len(rows)  # e.g. evaluated every N steps: show each point
        alpha = 0.4 if smooth > 1 else 1.0
        ax.plot(steps, values, lw=1, alpha=alpha, marker="o" if sparse else None, label=key)
        if smooth > 1:
            ax.plot(steps, _smooth(values, smooth), lw=1.8, label=f"{key} (mean of {smooth})")
        ax.set_ylabel(key.split("/")[-1])
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def default_keys(present: set[str]) -> list[str]:
    """DEFAULT_KEYS that are in `present`, a trailing "*" matching every key it prefixes."""
    keys: list[str] = []
    for k in DEFAULT_KEYS:
        if k.endswith("*"):
            keys += sorted(p for p in present if p.startswith(k[:-1]))
        elif k in present:
            keys.append(k)
    return keys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", help="metrics.jsonl written by the trainer")
    p.add_argument(
        "--keys", help=f"comma-separated keys (default: those of {DEFAULT_KEYS} present)"
    )
    p.add_argument("--out", default="metrics.png", help="PNG to write")
    p.add_argument("--smooth", type=int, default=1, help="also draw a running mean of N steps")
    p.add_argument("--title", help="figure title")
    args = p.parse_args(argv)
    rows = read_metrics(args.metrics)
    if not rows:
        p.error(f"{args.metrics} holds no metrics")
    present = {k for r in rows.values() for k in r}
    if args.keys:
        keys = [k.strip() for k in args.keys.split(",") if k.strip()]
        missing = [k for k in keys if k not in present]
        if missing:
            p.error(f"keys not in {args.metrics}: {missing}; present: {sorted(present)}")
    else:
        keys = default_keys(present)
        if not keys:
            p.error(f"none of {DEFAULT_KEYS} in {args.metrics}; pass --keys")
    out = plot(rows, keys, args.out, smooth=args.smooth, title=args.title)
    print(f"wrote {out} ({len(rows)} steps, keys: {', '.join(keys)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
