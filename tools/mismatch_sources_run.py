"""The `mismatch_sources` measurements of docs/evidence.md, reproducible from one command.

    python tools/mismatch_sources_run.py                 # everything not done yet
    python tools/mismatch_sources_run.py --dry-run       # the commands, and which are done
    python tools/mismatch_sources_run.py --sglang-python $(bash scripts/engine_env.sh)/bin/python

Steps (each skipped when its output exists, so the command resumes):
1. the checkpoint run: GSPO on the fp32 embedded engine (`examples/evidence_cpu.yaml`, arm
   gspo-fp32, seed 0, 60 steps, a checkpoint every 15), through `tools/evidence_study.py`'s
   runner, so its per-step data and provenance (commit, command, load) are committed next to
   the measurements (`<out>/run/gspo-fp32-seed0.{jsonl,meta.json}`);
2. its checkpoints converted to fp32 HF directories (`tools/convert_megatron_to_hf.py`);
3. `benchmarks/mismatch_sources.py` at the five stages, the logit scales and the lengths, and
   `benchmarks/fp8_routing.py` at steps 0 and 60, each writing JSON with its provenance
   (commit, exact command, seed, load) into `<out>` (default
   docs/evidence/mismatch_sources/v2; the older files one level up record none).
The real-SGLang rows need the engine venv (`--sglang-python`); without it they are skipped.
Everything runs under `nice -n 19` (a shared machine).
"""

from __future__ import annotations

if __name__ == "__main__":
    import sys
    from pathlib import Path

    _root = str(Path(__file__).resolve().parents[1])
    if _root not in sys.path:
        sys.path.insert(0, _root)

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "evidence" / "mismatch_sources" / "v2"
WORK = ROOT / "runs" / "mismatch_sources"
STAGES = (15, 30, 45, 60)
SEED = 0


def commands(out: Path, work: Path, sglang: str | None) -> list[tuple[Path, list[str]]]:
    """(output that marks the step done, command) for steps 2 and 3, in order."""
    from tools.evidence_study import ARMS, prepare_task

    task, _ = prepare_task(ARMS["gspo-fp32"], work)
    py = [sys.executable]
    hf = {s: work / "hf" / f"step{s}" for s in STAGES}
    steps: list[tuple[Path, list[str]]] = []
    for s in STAGES:
        ck = work / "ckpt" / f"step_{s:06d}"
        steps.append((hf[s] / "config.json", py + ["tools/convert_megatron_to_hf.py", "-i",
                      str(ck), "-o", str(hf[s]), "--hf-dtype", "float32"]))  # fmt: skip
    bench = py + ["benchmarks/mismatch_sources.py", "--data", str(task / "pattern.jsonl"),
                  "--seed", str(SEED)]  # fmt: skip
    stage_models = ["--model", f"step0={task / 'model'}"]
    for s in STAGES:
        stage_models += ["--model", f"step{s}={hf[s]}"]
    steps += [
        (out / "stages.json", bench + stage_models + ["--json", str(out / "stages.json")]),
        (out / "scale0.json", bench + ["--model", f"step0={task / 'model'}", "--scales",
                                       "1,2,4,8", "--json", str(out / "scale0.json")]),
        (out / "scale60.json", bench + ["--model", f"step60={hf[60]}", "--scales",
                                        "1,0.5,0.25", "--json", str(out / "scale60.json")]),
        (out / "lengths.json", bench + ["--model", f"step0={task / 'model'}", "--model",
                                        f"step60={hf[60]}", "--lengths", "16,32,64,128,256",
                                        "--json", str(out / "lengths.json")]),
        (out / "fp8_routing.json", py + ["benchmarks/fp8_routing.py", "--data",
                                         str(task / "pattern.jsonl"), "--model",
                                         f"step0={task / 'model'}", "--model",
                                         f"step60={hf[60]}", "--seed", str(SEED), "--json",
                                         str(out / "fp8_routing.json")]),
    ]  # fmt: skip
    if sglang:
        steps.append((out / "lengths_sglang.json", bench + [
            "--model", f"step0={task / 'model'}", "--model", f"step60={hf[60]}", "--skip-hf",
            "--lengths", "16,32,64,128,256", "--sglang", sglang,
            "--json", str(out / "lengths_sglang.json")]))  # fmt: skip
    return steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT, help="where the JSON and run data go")
    p.add_argument("--work", type=Path, default=WORK, help="checkpoints and HF copies")
    p.add_argument("--sglang-python", help="engine venv python: also the real-server rows")
    p.add_argument("--dry-run", action="store_true", help="print the steps and exit")
    a = p.parse_args(argv)
    from tools.evidence_study import ARMS, Plan, run_complete, run_one

    plan = Plan(ARMS["gspo-fp32"], SEED, a.out / "run", a.work, nice=19)
    plan.extra_sets = ["train.steps=60", f"checkpoint.dir={a.work / 'ckpt'}",
                       "checkpoint.save_every=15"]  # fmt: skip
    steps = commands(a.out, a.work, a.sglang_python)
    if a.dry_run:
        print(f"{'done' if run_complete(plan) else 'to run'}: checkpoint run {plan.stem}")
        for done_file, cmd in steps:
            print(f"{'done' if done_file.exists() else 'to run'}: {' '.join(cmd)}")
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    if not run_complete(plan) and not run_one(plan, timeout_s=7200):
        print(f"[mismatch_sources] the checkpoint run failed: see {plan.work_dir / plan.stem}")
        return 1
    for done_file, cmd in steps:
        if done_file.exists():
            continue
        print(f"[mismatch_sources] {' '.join(cmd)}", flush=True)
        env_cmd = ["nice", "-n", "19", *cmd]
        rc = subprocess.run(env_cmd, cwd=ROOT, env={**_env(), "OMP_NUM_THREADS": "1"}).returncode
        if rc != 0:
            print(f"[mismatch_sources] failed with exit code {rc}: {' '.join(cmd)}")
            return 1
    return 0


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if "PYTHONPATH" in env else "")
    return env


if __name__ == "__main__":
    sys.exit(main())
