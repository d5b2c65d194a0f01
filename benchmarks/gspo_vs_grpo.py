"""GSPO against GRPO on the same MoE run, without Routing Replay: routing drift, clipping,
train/inference mismatch and reward, side by side.

    python benchmarks/gspo_vs_grpo.py                 # the CPU example, 30 steps each
    python benchmarks/gspo_vs_grpo.py --steps 60 --config examples/tiny_moe_cpu.yaml \
        --set rollout.temperature=1.0

Each algorithm runs the example config (same seed, data order and model) through
`torchrun -m megatron_gspo.train` with `loss.kind` switched (each with its own default
clip range: GSPO 3e-4/4e-4 on the sequence ratio, GRPO 0.2/0.27 on token ratios); the table is
read from their metrics.jsonl. Reported (mean over steps unless noted):
  flip rate     moe/routing_flip_rate: share of (token, MoE layer) whose top-k experts changed
                between the rollout policy and the policy after that step's updates
  clip          policy/clip_frac (GSPO: share of sequences; GRPO: share of tokens)
  clip mb1      the same on the first mini-batch, where the trainer still equals the rollout
                policy, so all of the ratio is train/inference mismatch
  |dlogp| mb1   first_mb/mismatch/abs_logp_diff, mean |logp_trainer - logp_engine| per token
  reward        reward/mean over the first and the last 5 steps
Ratios are GRPO / GSPO from the same invocation. Needs the inputs of the CPU example
(`python tools/make_tiny_toy.py --out runs/tiny_toy`; scripts/main.sh creates them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from megatron_gspo.testing.jobs import torchrun_command  # noqa: E402

ROWS = [
    ("flip rate", "moe/routing_flip_rate"),
    ("clip", "policy/clip_frac"),
    ("clip mb1", "first_mb/policy/clip_frac"),
    ("|dlogp| mb1", "first_mb/mismatch/abs_logp_diff"),
    ("grad norm", "grad_norm"),
]


def run(algorithm: str, steps: int, config: str, out: Path, extra: list[str]) -> list[dict]:
    log_dir = out / algorithm
    cmd = torchrun_command(config, port=29700 + len(algorithm)) + [
        "--set",
        f"loss.kind={algorithm}",
        "--set",
        f"train.steps={steps}",
        "--set",
        f"logging.dir={log_dir}",
        "--set",
        f"checkpoint.dir={log_dir}/ckpt",
        "--set",
        "checkpoint.save_every=0",
        "--set",
        "logging.tensorboard=false",
    ]
    for item in extra:
        cmd += ["--set", item]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    print(f"[bench] {algorithm}: {steps} steps ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{algorithm} run failed:\n{proc.stderr[-4000:]}")
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--config", default="examples/tiny_moe_cpu.yaml")
    p.add_argument("--set", action="append", default=[], help="extra config override k=v")
    a = p.parse_args(argv)
    if a.steps < 10:
        raise SystemExit("--steps must be >= 10 (the reward columns use the first/last 5)")
    with tempfile.TemporaryDirectory(prefix="mgspo-bench-") as tmp:
        results = {alg: run(alg, a.steps, a.config, Path(tmp), a.set) for alg in ("gspo", "grpo")}
    table = [(label, mean(results["gspo"], k), mean(results["grpo"], k)) for label, k in ROWS]
    for label, sl in (("reward first5", slice(0, 5)), ("reward last5", slice(-5, None))):
        table.append((label, *(mean(results[alg][sl], "reward/mean") for alg in ("gspo", "grpo"))))
    print(f"\nGSPO vs GRPO, {a.steps} steps each, {a.config} (no Routing Replay)\n")
    print(f"{'metric':<15}{'GSPO':>12}{'GRPO':>12}{'GRPO/GSPO':>12}")
    for label, g, r in table:
        ratio = r / g if g and not math.isnan(g) else float("nan")
        print(f"{label:<15}{g:>12.4g}{r:>12.4g}{ratio:>12.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
