"""Did the reward rise? Compare the mean reward of the first and last N steps of a run.

    python tools/reward_summary.py runs/tiny_moe_cpu/metrics.jsonl [--window 10] [--margin 0.05]

    python tools/reward_summary.py runs/tiny_moe_cpu_eval/metrics.jsonl --curve eval/reward_mean

Exit code 0 when last-N mean > first-N mean + margin, 1 otherwise (so scripts can gate on it).
A non-finite value ("nan"/"inf" in metrics.jsonl) fails the check: it is counted and reported.
`--curve KEY` instead prints every logged value of KEY with its step (e.g. the held-out
evaluation, logged every eval.every steps) and exits 0.
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
import sys

from megatron_gspo.run.metrics_log import read_metrics


def summary(path: str, window: int, key: str = "reward/mean") -> tuple[float, float, int]:
    """Mean of the first and of the last `window` values of `key`, and how many there are
    (a non-finite value makes its mean non-finite)."""
    values = [r[key] for r in read_metrics(path).values() if key in r]
    if len(values) < 2 * window:
        raise SystemExit(f"{path}: {len(values)} steps with {key}; need at least {2 * window}")
    return sum(values[:window]) / window, sum(values[-window:]) / window, len(values)


def nonfinite(path: str, key: str = "reward/mean") -> int:
    """How many steps logged a non-finite `key`."""
    return sum(1 for r in read_metrics(path).values() if key in r and not math.isfinite(r[key]))


def curve(path: str, key: str) -> str:
    """One line: `key` at every step that logged it."""
    points = [(s, r[key]) for s, r in read_metrics(path).items() if key in r]
    if not points:
        raise SystemExit(f"{path}: no step logged {key}")
    return f"{key} by step: " + ", ".join(f"{s}: {v:.4f}" for s, v in points)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics")
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--key", default="reward/mean")
    p.add_argument("--curve", metavar="KEY", help="print KEY at every step that logged it")
    a = p.parse_args(argv)
    if a.curve:
        print(curve(a.metrics, a.curve))
        return 0
    first, last, n = summary(a.metrics, a.window, a.key)
    rose = last > first + a.margin  # False when either mean is NaN
    bad = nonfinite(a.metrics, a.key)
    print(
        f"{a.key}: first {a.window} steps {first:.4f}, last {a.window} steps {last:.4f} "
        f"({n} steps{f', {bad} non-finite' if bad else ''}): "
        f"{'ROSE' if rose else 'did NOT rise'} by margin {a.margin}"
    )
    return 0 if rose else 1


if __name__ == "__main__":
    sys.exit(main())
