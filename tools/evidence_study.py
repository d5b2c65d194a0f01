"""The evidence study of issue 22: does GSPO on the engine's log-probs, without Routing Replay,
train a MoE stably? Runs a matrix of arms on the long-response repeat task and writes
docs/evidence.md from the committed per-step data.

    python tools/evidence_study.py --list                      # the arms, and which can run here
    python tools/evidence_study.py --arms gspo-fp32,grpo-fp32 --seeds 0,1,2   # run, then report
    python tools/evidence_study.py --all --seeds 0,1,2         # every runnable arm
    python tools/evidence_study.py --report                    # only regenerate docs/evidence.md
    python tools/evidence_study.py --quick                     # 1 arm x 5 steps (CI, a minute)

An arm is a named set of `--set` overrides on examples/evidence_cpu.yaml (plus `task.*` keys of
`megatron_gspo.data.pattern.PatternTaskConfig`). One run = one arm at one seed: `train.seed` and
`data.seed` are the seed, the starting model is the same tiny MoE for every run. Its per-step
metrics (a fixed subset of keys, `KEEP`) go to docs/evidence/runs/<arm>-seed<k>.jsonl and its
provenance (overrides, commit, wall time, load average) to <arm>-seed<k>.meta.json. A run whose
data file exists is not rerun (`--rerun` forces it), so results accumulate across sessions and
machines; a failed run writes only its meta file (status, exit code, log tail), which the report
lists. Runs go one at a time under `nice -n 10`.

Arms whose config keys this checkout does not have yet (FP8-emulated engine, sequence mask,
Routing Replay: other parts of issue 22) are in the registry and are skipped with a message
naming the missing key. Arms on the real SGLang server need its venv (scripts/engine_env.sh,
or MGSPO_ENGINE_PYTHON).

This is a tool (next to tools/reward_summary.py and tools/plot_metrics.py), not a benchmark:
it trains, it does not time a component, and its product is a document.
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
import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.reward_summary import summary

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "examples" / "evidence_cpu.yaml"
DATA_DIR = ROOT / "docs" / "evidence" / "runs"
REPORT = ROOT / "docs" / "evidence.md"
WORK_DIR = ROOT / "runs" / "evidence"
QUICK_DIR = ROOT / "runs" / "evidence_quick"

# Per-step keys kept in the committed data (the whole metrics row is ~3 kB a step).
KEEP_PREFIXES = (
    "reward/",
    "policy/",
    "mismatch/",
    "first_mb/",
    "drift/",
    "response/",
    "loss/",
    "tis/",
    "moe/routing_flip_rate_mb/",
)
KEEP = (
    "step",
    "loss",
    "grad_norm",
    "train/skipped_updates",
    "moe/routing_flip_rate",
    "time/step_s",
    "time/rollout_s",
    "time/train_s",
    "time/mismatch_logp_s",  # the cost of the mismatch masks' extra forward (engine pi_old)
)
_DROP = ("reward/time_s", "reward/timeouts", "reward/retries", "reward/failures")


@dataclass(frozen=True)
class Arm:
    """One cell of the study matrix."""

    name: str
    """File-name-safe id: <loss>-<engine>[-variant]."""
    sets: tuple[str, ...] = ()
    """--set overrides on examples/evidence_cpu.yaml (`task.*` keys: the task, not the config)."""
    engine: str = "embedded"
    """embedded (fp32, the trainer's dtype) or sglang (the real server on CPU, bf16)."""
    note: str = ""
    """What the arm controls for (goes into the report)."""
    owner: str = ""
    """Where a missing key comes from (an issue-22 branch), for the skip message."""
    needs_module: str = ""
    """A module the arm needs besides its keys (a key that exists for another use)."""
    model: tuple[tuple[str, int], ...] = ()
    """Overrides of the tiny model's shape (`data.tiny_model.TINY_QWEN3_MOE` keys): the deeper
    model of the pre-registered study; empty = the toy."""


def _arms() -> dict[str, Arm]:
    gspo, grpo = ("loss.kind=gspo",), ("loss.kind=grpo",)
    rec, mb1 = ("rl.pi_old=recompute",), ("rl.mini_batches_per_rollout=1",)
    arms = []
    # The bf16 server's arms were run with its logits in bf16, SGLang's own default: they keep
    # it now that rollout.launch.fp32_lm_head is on by default (the fp32head arm's finding).
    bf16_head = ("rollout.launch.fp32_lm_head=false",)
    for eng, tag in (("embedded", "fp32"), ("sglang", "bf16")):
        pin = bf16_head if eng == "sglang" else ()
        gs, gr = gspo + pin, grpo + pin
        arms += [
            Arm(f"gspo-{tag}", gs, eng, "GSPO, engine log-probs as pi_old (the default)"),
            Arm(f"gspo-{tag}-recompute", gs + rec, eng, "GSPO, trainer recomputes pi_old"),
            Arm(f"grpo-{tag}", gr, eng, "GRPO, engine log-probs as pi_old"),
            Arm(f"gspo-{tag}-mb1", gs + mb1, eng, "GSPO, 1 mini-batch per rollout (on-policy)"),
            Arm(f"grpo-{tag}-mb1", gr + mb1, eng, "GRPO, 1 mini-batch per rollout"),
            Arm(f"gspo-{tag}-L64", gs + ("task.length=64",), eng, "GSPO, responses of 64"),
            Arm(f"grpo-{tag}-L64", gr + ("task.length=64",), eng, "GRPO, responses of 64"),
            Arm(f"gspo-{tag}-L128", gs + ("task.length=128",), eng, "GSPO, responses of 128"),
        ]
    # Hooks for the other parts of issue 22: skipped until their keys (and modules) exist
    # here. The keys are those of their branches at the time of writing.
    fp8 = ("rollout.launch.quantization=fp8", "weights.fp8=true")
    fp8_mod = "megatron_gspo.engines.embedded.fp8_emulation"
    mask = ("loss.seq_mismatch_mask=[0.999,1.002]", *bf16_head)
    replay = ("rl.routing_replay=true",)
    arms += [
        Arm("gspo-fp8", gspo + fp8, "embedded", "GSPO on the FP8-emulated embedded engine",
            "branch h22fp8", fp8_mod),
        Arm("grpo-fp8", grpo + fp8, "embedded", "GRPO on the FP8-emulated embedded engine",
            "branch h22fp8", fp8_mod),
        Arm("gspo-bf16-seqmask", gspo + mask, "sglang",
            "GSPO + sequence mask by the engine/trainer geometric-mean ratio", "branch h22mask"),
        Arm("gspo-bf16-fp32head", gspo + ("rollout.launch.fp32_lm_head=true",),
            "sglang", "GSPO, the bf16 SGLang server computing its logits in fp32 "
            "(benchmarks/mismatch_sources.py: the bf16 logits are most of the grown mismatch)"),
        Arm("grpo-bf16-replay", grpo + replay + bf16_head, "sglang",
            "GRPO + Routing Replay (study control)", "branch h22replay"),
        Arm("grpo-fp32-replay", grpo + replay, "embedded",
            "GRPO + Routing Replay (study control)", "branch h22replay"),
        Arm("gspo-fp32-replay", gspo + replay, "embedded",
            "GSPO + Routing Replay (does replay add anything to GSPO?)"),
    ]  # fmt: skip
    # The pre-registered study's deeper model (docs/evidence/plan.md): more layers and experts
    # than the toy, so routing has more to disagree on, still minutes per run.
    for a in [x for x in arms if x.name in ("grpo-fp32", "gspo-fp32", "grpo-fp32-replay")]:
        arms.append(Arm(f"{a.name}-deep", a.sets, a.engine, f"{a.note}; {DEEP_NOTE}",
                        model=DEEP_MODEL))  # fmt: skip
    return {a.name: a for a in arms}


DEEP_MODEL = (("num_hidden_layers", 4), ("num_experts", 8))
DEEP_NOTE = "deeper model: 4 layers, 8 experts top-2"


ARMS = _arms()
QUICK_ARMS = ("gspo-fp32",)
QUICK_STEPS = 5


@dataclass
class Plan:
    """Where a run's files go and what it runs with."""

    arm: Arm
    seed: int
    data_dir: Path
    work_dir: Path
    extra_sets: list[str] = field(default_factory=list)
    nice: int = 10

    @property
    def stem(self) -> str:
        return f"{self.arm.name}-seed{self.seed}"

    @property
    def data(self) -> Path:
        return self.data_dir / f"{self.stem}.jsonl"

    @property
    def meta(self) -> Path:
        return self.data_dir / f"{self.stem}.meta.json"


def missing_key(arm: Arm) -> str | None:
    """The first override key of `arm` the config of this checkout does not have, else None."""
    from megatron_gspo.config import Config
    from megatron_gspo.config_io import ConfigError, apply_override

    for s in arm.sets:
        if s.startswith("task."):
            continue
        try:
            apply_override(Config, {}, s)
        except ConfigError:
            return s.partition("=")[0]
    return None


def engine_python() -> str | None:
    """The real SGLang server's interpreter (MGSPO_ENGINE_PYTHON or scripts/engine_env.sh)."""
    exe = os.environ.get("MGSPO_ENGINE_PYTHON")
    if exe:
        return exe
    try:
        out = subprocess.run(
            ["bash", str(ROOT / "scripts" / "engine_env.sh")],
            capture_output=True,
            text=True,
            timeout=1800,
            check=True,
        )
    except (subprocess.SubprocessError, OSError):
        return None
    return str(Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python")


def why_not(arm: Arm, check_engine: bool = True) -> str | None:
    """Why `arm` cannot run in this checkout (one line), or None; `check_engine=False` does
    not look for (or build) the SGLang venv."""
    key = missing_key(arm)
    if key is not None:
        return f"config key {key} does not exist here yet ({arm.owner or 'not built'})"
    if arm.needs_module and importlib.util.find_spec(arm.needs_module) is None:
        return f"module {arm.needs_module} does not exist here yet ({arm.owner or 'not built'})"
    from megatron_gspo.config import load_config
    from megatron_gspo.config_io import ConfigError

    engine = ["rollout.launch.backend=sglang", "rollout.launch.device=cpu"]
    try:  # the arm's overrides pass the config's own checks (e.g. replay on SGLang CPU)
        sets = [s for s in arm.sets if not s.startswith("task.")]
        load_config(BASE_CONFIG, (engine if arm.engine == "sglang" else []) + sets)
    except ConfigError as e:
        return f"the config refuses it: {e}"
    if check_engine and arm.engine == "sglang" and engine_python() is None:
        return "the real SGLang engine venv is missing (bash scripts/engine_env.sh builds it)"
    return None


def _task_sets(arm: Arm) -> dict[str, str]:
    return {
        s.partition("=")[0].removeprefix("task."): s.partition("=")[2]
        for s in arm.sets
        if s.startswith("task.")
    }


def base_max_new_tokens() -> int:
    """rollout.max_new_tokens of examples/evidence_cpu.yaml: the task length L of an arm
    without a task.length key."""
    from megatron_gspo.config_io import read_yaml

    return int(read_yaml(BASE_CONFIG)["rollout"]["max_new_tokens"])


def prepare_task(arm: Arm, work_dir: Path) -> tuple[Path, int]:
    """Write the tiny MoE and the task data for this arm's task keys (once); return the task
    directory and its length L."""
    from megatron_gspo.data.pattern import pattern_task_config, write_pattern_dataset

    # The task length defaults to the base config's response budget (the yaml is sized for it).
    values = {"length": base_max_new_tokens(), **{k: int(v) for k, v in _task_sets(arm).items()}}
    task = pattern_task_config(values)
    d = work_dir / f"task-L{task.length}-p{task.pattern_min}{task.pattern_max}-n{task.n}"
    if arm.model:
        d = d.with_name(d.name + "-" + "-".join(f"{k}{v}" for k, v in arm.model))
    if not (d / "pattern.jsonl").exists():
        from transformers.utils import logging as hf_logging

        from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
        from megatron_gspo.data.toy import save_toy_tokenizer

        hf_logging.disable_progress_bar()  # a sub-second "Writing model shards" bar is noise

        save_tiny_hf_checkpoint(d / "model", seed=0, perturb_norms=False, **dict(arm.model))
        save_toy_tokenizer(d / "model")
        write_pattern_dataset(d / "pattern.jsonl.tmp", task)
        (d / "pattern.jsonl.tmp").rename(d / "pattern.jsonl")
    return d, task.length


def overrides(plan: Plan, task_dir: Path, length: int) -> list[str]:
    """Every --set of one run, in order (later ones win)."""
    arm, log_dir = plan.arm, plan.work_dir / plan.stem
    sets = [
        f"model.hf_path={task_dir / 'model'}",
        f"data.train_path={task_dir / 'pattern.jsonl'}",
        f"rollout.max_new_tokens={length}",
        f"train.micro_batch_tokens={max(512, 2 * (length + 16))}",
        f"train.seed={plan.seed}",
        f"data.seed={plan.seed}",
        f"logging.dir={log_dir}",
        "train.routing_flip_per_minibatch=true",  # the flip rate per mini-batch index
    ]
    if arm.engine == "sglang":
        sets += [
            "rollout.launch.backend=sglang",
            "rollout.launch.device=cpu",
            f"rollout.launch.python={engine_python()}",
        ]
    sets += [s for s in arm.sets if not s.startswith("task.")]
    return sets + plan.extra_sets


def keep_row(row: dict) -> dict:
    """The committed subset of one metrics row, floats to 6 significant digits."""
    out = {}
    for k, v in row.items():
        if k in _DROP or not (k in KEEP or k.startswith(KEEP_PREFIXES)):
            continue
        if isinstance(v, float) and math.isfinite(v):
            v = float(f"{v:.6g}")
        out[k] = v
    return out


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        return "unknown"


def _commit(full: bool = False) -> str:
    return _git("rev-parse", "HEAD") if full else _git("rev-parse", "--short", "HEAD")


def _dirty() -> bool:
    """Whether tracked code differs from the commit (data files under docs/ do not count)."""
    return bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"))


def run_complete(plan: Plan) -> bool:
    """A run counts as done when its data file and a meta file with status ok both exist (the
    meta file is written last, atomically: a run killed at any point is not done)."""
    if not (plan.data.exists() and plan.meta.exists()):
        return False
    try:
        return json.loads(plan.meta.read_text()).get("status") == "ok"
    except ValueError:
        return False


def run_one(plan: Plan, timeout_s: float) -> bool:
    """Train one arm at one seed; write its data and meta files. True on success."""
    task_dir, length = prepare_task(plan.arm, plan.work_dir)
    sets = overrides(plan, task_dir, length)
    cmd = ["nice", "-n", str(plan.nice), sys.executable, "-m", "megatron_gspo.torchrun"]
    from megatron_gspo.dist import free_port

    cmd += ["--nproc_per_node", "2", "--master_port", str(free_port())]  # 29500 may be taken
    cmd += ["-m", "megatron_gspo.train", "--config", str(BASE_CONFIG)]
    cmd += [a for s in sets for a in ("--set", s)] + ["--overwrite"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if "PYTHONPATH" in env else "")
    log_dir = plan.work_dir / plan.stem
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[evidence] {plan.stem}: running ({len(sets)} overrides, log {log_dir}/study.log)")
    load0, t0, commit = _load(), time.monotonic(), _commit(full=True)
    date0 = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    with open(log_dir / "study.log", "w") as log:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.monotonic() - t0
    meta = {
        "arm": plan.arm.name,
        "seed": plan.seed,
        "engine": plan.arm.engine,
        "sets": [s for s in plan.arm.sets] + plan.extra_sets,
        "task_length": length,
        "commit": commit,
        "dirty": _dirty(),
        "command": " ".join(map(shlex.quote, cmd)),
        "study_command": " ".join(map(shlex.quote, [sys.executable, *sys.argv])),
        "model": dict(plan.arm.model),
        "start_utc": date0,
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "wall_s": round(wall, 1),
        "loadavg_start": load0,
        "loadavg_end": _load(),
        "cpus": os.cpu_count(),
        "rc": rc,
        "status": DONE_STATUS.get(rc, "failed"),
    }
    plan.data_dir.mkdir(parents=True, exist_ok=True)
    metrics = log_dir / "metrics.jsonl"
    meta_path = plan.meta
    if rc in DONE_STATUS and metrics.exists():
        rows = [keep_row(json.loads(line)) for line in metrics.read_text().splitlines() if line]
        tmp = plan.data.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.rename(plan.data)
        meta["steps"] = len(rows)
    else:  # a failed attempt keeps its own meta file (the report lists it), next to the run's
        meta["status"] = "failed"
        meta["log_tail"] = (log_dir / "study.log").read_text()[-2000:]
        k = 1 + len(list(plan.data_dir.glob(f"{plan.stem}.failed*.meta.json")))
        meta_path = plan.data_dir / f"{plan.stem}.failed{k}.meta.json"
    tmp = meta_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    tmp.rename(meta_path)  # last and atomic: run_complete() reads it
    print(f"[evidence] {plan.stem}: {meta['status']} in {wall:.0f} s (load {load0} -> {_load()})")
    if meta["status"] != "failed" and meta["steps"] >= 2:
        w = min(10, meta["steps"] // 2)  # as tools/reward_summary.py prints it for main.sh
        first, last, _ = summary(str(plan.data), w)
        rose = "ROSE" if last > first + 0.05 else "did NOT rise"
        print(f"[evidence] {plan.stem}: reward first {w} {first:.4f}, last {w} {last:.4f}: {rose}")
    return meta["status"] != "failed"


# Exit codes whose run is an outcome: 0, and 3 (the trainer's bad-step guard stopped it: the
# plan counts it as an entropy dip).
DONE_STATUS = {0: "ok", 3: "bad_steps"}

# The pre-registered study (docs/evidence/plan.md, section 6): blocks run in order; within a
# block, seed by seed, the arm order rotated by the seed.
STUDY_DIR = ROOT / "docs" / "evidence" / "study" / "runs"
STUDY_WORK_DIR = ROOT / "runs" / "evidence_study"
STUDY_BLOCKS = (
    ("grpo-fp32", "gspo-fp32", "grpo-fp32-replay"),
    ("gspo-fp32-replay", "gspo-fp8", "gspo-bf16", "gspo-bf16-fp32head", "gspo-bf16-recompute"),
    ("grpo-fp32-deep", "gspo-fp32-deep", "grpo-fp32-replay-deep"),
)
# Seeds 3..12, not 0..9 (plan.md, amendment 2): runs are deterministic, so seeds 0..2 repeat the
# exploratory runs that suggested the hypotheses bit for bit and cannot confirm them.
STUDY_SEEDS = tuple(range(3, 13))
STUDY_NICE = 19


def study_order(
    blocks: tuple[tuple[str, ...], ...] = STUDY_BLOCKS, seeds: tuple[int, ...] = STUDY_SEEDS
) -> list[tuple[str, int]]:
    """(arm, seed) in the plan's run order: block by block, seed by seed, the block's arm order
    rotated left by seed mod its size."""
    out = []
    for block in blocks:
        for seed in seeds:
            k = seed % len(block)
            out += [(arm, seed) for arm in block[k:] + block[:k]]
    return out


def stop_deadline(stop_at: str, now: float) -> float:
    """The first moment at or after `now` (epoch seconds) whose UTC clock reads `stop_at`
    (HH:MM): a stop time earlier in the day than `now` means tomorrow (started at 23:36,
    `--stop-at 02:05` stops in 2.5 hours, not at once)."""
    try:
        hh, mm = (int(x) for x in stop_at.split(":"))
    except ValueError:
        raise ValueError(f"--stop-at {stop_at!r}: expected HH:MM (UTC)") from None
    if not (0 <= hh < 24 and 0 <= mm < 60):
        raise ValueError(f"--stop-at {stop_at!r}: expected HH:MM (UTC)")
    day = now - now % 86400
    at = day + hh * 3600 + mm * 60
    return at if at > now - 60 else at + 86400


def run_study(dry_run: bool, stop_at: str | None, timeout_s: float) -> int:
    """Run the pre-registered order, skipping runs that are done; stop starting runs at
    `stop_at` (UTC HH:MM, its next occurrence). Returns the number of failed runs."""
    failed, order = 0, study_order()
    deadline = stop_deadline(stop_at, time.time()) if stop_at else None
    unrunnable: dict[str, str | None] = {}
    for i, (name, seed) in enumerate(order):
        plan = Plan(ARMS[name], seed, STUDY_DIR, STUDY_WORK_DIR, nice=STUDY_NICE)
        done = run_complete(plan)
        if dry_run:
            print(f"{i + 1:3d} {plan.stem:32s} {'done' if done else 'to run'}")
            continue
        if done:
            continue
        if deadline is not None and time.time() >= deadline:
            print(f"[evidence] {stop_at} UTC reached: stopping before {plan.stem} ({i + 1}/"
                  f"{len(order)}); the same command resumes here")  # fmt: skip
            break
        if name not in unrunnable:
            unrunnable[name] = why_not(ARMS[name])
        if unrunnable[name]:
            print(f"[evidence] {plan.stem}: skipped: {unrunnable[name]}")
            continue
        failed += not run_one(plan, timeout_s)
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="", help="comma-separated arm names (see --list)")
    p.add_argument("--all", action="store_true", help="every arm that can run here")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--set", dest="extra", action="append", default=[], help="extra --set k=v")
    p.add_argument("--rerun", action="store_true", help="rerun runs whose data exists")
    p.add_argument("--report", action="store_true", help="only regenerate the report")
    p.add_argument("--list", action="store_true", help="list the arms and exit")
    p.add_argument("--quick", action="store_true", help="1 arm x 5 steps into runs/evidence_quick")
    p.add_argument("--data-dir", type=Path, help=f"default {DATA_DIR.relative_to(ROOT)}")
    p.add_argument("--out", type=Path, help=f"report file, default {REPORT.relative_to(ROOT)}")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--study", action="store_true", help="the pre-registered study's run order "
                   "(docs/evidence/plan.md) into docs/evidence/study/runs; resumes")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="with --study: print the order")
    p.add_argument("--stop-at", help="with --study: start no run after this UTC time (HH:MM)")
    a = p.parse_args(argv)
    from tools.evidence_report import write_report

    if a.study:
        if a.stop_at:
            try:
                stop_deadline(a.stop_at, time.time())
            except ValueError as e:
                p.error(str(e))
        if not a.dry_run and _dirty():
            p.error("the study runs from a clean checkout of the study commit (plan.md, section 5)")
        return 1 if run_study(a.dry_run, a.stop_at, a.timeout) else 0
    if a.list:
        for arm in ARMS.values():
            reason = why_not(arm)
            print(f"{arm.name:22s} {'SKIP: ' + reason if reason else 'runnable'}  ({arm.note})")
        return 0
    names = [n for n in a.arms.split(",") if n]
    extra = list(a.extra)
    data_dir, out, work_dir = a.data_dir or DATA_DIR, a.out or REPORT, WORK_DIR
    if a.quick:
        names = names or list(QUICK_ARMS)
        extra = [f"train.steps={QUICK_STEPS}", *extra]
        data_dir, out = a.data_dir or QUICK_DIR / "runs", a.out or QUICK_DIR / "evidence.md"
        work_dir = QUICK_DIR
    if a.all:
        names = list(ARMS)
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {unknown}; --list shows them")
    failed = 0
    if not a.report:
        seeds = [int(s) for s in a.seeds.split(",") if s]
        for name in names:
            arm = ARMS[name]
            reason = why_not(arm)
            if reason:
                print(f"[evidence] {name}: skipped: {reason}")
                continue
            for seed in seeds:
                plan = Plan(arm, seed, data_dir, work_dir, extra)
                if run_complete(plan) and not a.rerun:
                    print(f"[evidence] {plan.stem}: data exists, not rerun ({plan.data})")
                    continue
                failed += not run_one(plan, a.timeout)
    skipped = {n: why_not(x, check_engine=False) for n, x in ARMS.items()}
    preface = None
    if data_dir == DATA_DIR:  # the committed report: the pre-registered study first
        from tools.evidence_audit import audit_lines
        from tools.evidence_study_report import study_lines

        preface = study_lines([a for block in STUDY_BLOCKS for a in block]) + audit_lines()
    write_report(data_dir, out, ARMS, skipped, preface)
    print(f"[evidence] wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
