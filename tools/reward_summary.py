"""Did the reward rise? Compare the mean reward of the first and last N steps of a run.

    python tools/reward_summary.py runs/tiny_moe_cpu/metrics.jsonl [--window 10] [--margin 0.05]

Exit code 0 when last-N mean > first-N mean + margin, 1 otherwise (so scripts can gate on it).
"""

from __future__ import annotations

import argparse
import json
import sys


def summary(path: str, window: int, key: str = "reward/mean") -> tuple[float, float, int]:
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    values = [r[key] for r in rows if key in r]
    if len(values) < 2 * window:
        raise SystemExit(f"{path}: {len(values)} steps with {key}; need at least {2 * window}")
    return sum(values[:window]) / window, sum(values[-window:]) / window, len(values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics")
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--key", default="reward/mean")
    a = p.parse_args(argv)
    first, last, n = summary(a.metrics, a.window, a.key)
    rose = last > first + a.margin
    print(
        f"{a.key}: first {a.window} steps {first:.4f}, last {a.window} steps {last:.4f} "
        f"({n} steps): {'ROSE' if rose else 'did NOT rise'} by margin {a.margin}"
    )
    return 0 if rose else 1


if __name__ == "__main__":
    sys.exit(main())
