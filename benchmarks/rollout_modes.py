"""Samples per second of the CPU example: synchronous vs asynchronous vs over-sampled rollouts.

    python benchmarks/rollout_modes.py                 # the CPU example, 6 steps per mode
    python benchmarks/rollout_modes.py --steps 10 --set rollout.max_new_tokens=32
    python benchmarks/rollout_modes.py --modes sync async "async k=4" --engine sglang

Each mode runs the example config (same seed, data and model) through
`torchrun -m megatron_gspo.train` with one switch changed; the table is read from their
metrics.jsonl. Throughput is trained samples (prompts_per_rollout x group_size per step) over
the wall time between the end of step 1 and the end of the last step, so start-up (imports,
engine launch, the first batch) is left out. Columns: samples/s and its ratio to the
synchronous run, time waiting for the rollout per step (time/rollout_wait_s), rollout wall time
per step (time/rollout_s), overlap (rollout/overlap_frac: share of the rollout hidden behind
training), groups launched and aborted/carried per step, mean token staleness, and the engine
busy fraction (rollout/engine_busy_frac: the share of the trainer's time between taking two
batches, training, weight push and logging, during which the engines generated; from step 2).
`--engine sglang` rolls out on the real SGLang 0.5.23 CPU server (the venv of
scripts/engine_env.sh) instead of the embedded engine.
Needs the inputs of the CPU example (`python tools/make_tiny_toy.py --out runs/tiny_toy`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from megatron_gspo.testing.jobs import torchrun_command  # noqa: E402

MODES = {
    "sync": [],
    "async": ["rollout.async_rollout=true"],
    "async k=4": ["rollout.async_rollout=true", "rollout.max_staleness=4"],
    "oversample 2x": ["rollout.oversample=2.0", "rollout.drop_equal_reward_groups=true"],
    "async+oversample+partial": [
        "rollout.async_rollout=true",
        "rollout.oversample=2.0",
        "rollout.partial_tokens=2",
        "rollout.max_staleness=2",
    ],
}


def run(name: str, sets: list[str], steps: int, config: str, out: Path, port: int) -> list[dict]:
    log_dir = out / name.replace(" ", "_").replace("+", "_")
    cmd = torchrun_command(config, port=port) + [
        "--set",
        f"train.steps={steps}",
        "--set",
        f"logging.dir={log_dir}",
        "--set",
        "checkpoint.dir=null",
        "--set",
        "checkpoint.save_every=0",
        "--set",
        "logging.progress=false",
        "--set",
        "logging.tensorboard=false",
    ]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(metrics: list[dict]) -> dict[str, float]:
    samples = sum(m["rollout/num_samples"] for m in metrics[1:])
    wall = metrics[-1]["time"] - metrics[0]["time"]
    rest = metrics[1:]

    def mean(key: str) -> float:
        return sum(m.get(key, 0.0) for m in rest) / len(rest)

    return {
        "samples/s": samples / wall,
        "wait s": mean("time/rollout_wait_s"),
        "rollout s": mean("time/rollout_s"),
        "overlap": mean("rollout/overlap_frac"),
        "launched": mean("rollout/groups_launched") + mean("rollout/groups_continued"),
        "aborted": mean("rollout/groups_aborted") + mean("rollout/groups_carried"),
        "staleness": mean("rollout/staleness_mean"),
        "busy": mean("rollout/engine_busy_frac"),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--config", default=str(ROOT / "examples/tiny_moe_cpu.yaml"))
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra overrides")
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    p.add_argument("--engine", choices=("embedded", "sglang"), default="embedded")
    args = p.parse_args(argv)
    if args.engine == "sglang":  # the real server, bf16, in its own venv (as scripts/main.sh)
        venv = subprocess.run(
            ["bash", str(ROOT / "scripts/engine_env.sh")], capture_output=True, text=True
        ).stdout.strip()
        args.sets = [
            "rollout.launch.backend=sglang",
            "rollout.launch.device=cpu",
            f"rollout.launch.python={venv}/bin/python",
            *args.sets,
        ]
    if args.steps < 3:
        p.error("--steps must be >= 3 (step 1 is left out of the timing)")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="rollout-modes-") as tmp:
        for k, name in enumerate(args.modes):
            metrics = run(
                name, MODES[name] + args.sets, args.steps, args.config, Path(tmp), 29760 + k
            )
            rows[name] = summarize(metrics)
    base = rows.get("sync", next(iter(rows.values())))["samples/s"]
    cols = [
        "samples/s",
        "x sync",
        "wait s",
        "rollout s",
        "overlap",
        "launched",
        "aborted",
        "staleness",
        "busy",
    ]
    print(f"{'mode':<26}" + "".join(f"{c:>11}" for c in cols))
    for name, r in rows.items():
        vals = {**r, "x sync": r["samples/s"] / base}
        print(f"{name:<26}" + "".join(f"{vals[c]:>11.3f}" for c in cols))


if __name__ == "__main__":
    main()
