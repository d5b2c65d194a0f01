"""GPU acceptance: the whole job on every GPU of one machine, from the job's own command line.

    trainer=$(bash scripts/gpu_env.sh)/bin/python       # environments: built once, not timed
    engine=$(bash scripts/engine_env.sh)/bin/python
    PYTHONPATH=. "$trainer" tests/gpu/acceptance.py --engine-python "$engine"

What runs (each phase is one `python -m torch.distributed.run --nproc_per_node N ... -m
megatron_gspo.train` job, one trainer rank per GPU it is given, NCCL between them; the job
launches real SGLang 0.5.23 servers itself, health-checks them and shuts them down). With G
GPUs (`--gpus`, default all that torch sees):
  colocated    3 GSPO steps on G ranks: a tiny Qwen3-MoE (GPU-sized: hidden 256, head_dim 64,
               8 experts) in bf16 on megatron-bridge's Transformer Engine layer spec, expert
               parallel over as many ranks as divide both G and the 8 experts (EP 8 on 8
               GPUs); G engines, one per GPU, share the GPUs (`--enable-memory-saver`: their
               memory is released during updates), the trainer's state leaves the GPUs while
               they generate (megatron/offload.py), weights go by CUDA IPC
               (weights.transport=tensor) from trainer rank 0 to every engine.
  dist_fp8     2 steps, the GPUs split: G/2 trainer ranks (EP as above) and G - G/2 engines on
               GPUs of their own serving a block-FP8 copy of the model (its config carries the
               quantization_config); weights go FP8 through an NCCL process group with the
               engines (weights.transport=distributed). With one GPU the engine shares it and
               the group is gloo (NCCL refuses two ranks on one device). FP8 needs compute
               capability >= 8.9 (Ada, Hopper, Blackwell); on an older GPU this phase runs a
               bf16 engine and says so.
Then one table: per-phase times, weight versions, verification, first-mini-batch mismatch
(bf16 engine vs bf16 trainer) against BF16_MISMATCH_BOUND, finite metrics, trainer memory
before/while offloaded; exit 0 only if every check passes.

What one machine cannot cover (needs a multi-node run; the rules: `megatron_gspo/plan/topology.py`):
engines started by each node's local rank 0 on other nodes (engines/nodes.py) and rank 0
reaching them; torchrun's c10d rendezvous placing global rank 0 on another node than the
first host; a weight-update group whose NCCL ranks span nodes (and CUDA IPC being refused
across them); inter-node expert all-to-all and pipeline stages over InfiniBand; the recipes'
real sizes (Qwen3-30B-A3B / 235B-A22B memory, 8k-token responses, engines at TP 2-8) and the
Slurm scripts that start them.

`--dry-run` (CPU, CI: tests/gpu/test_acceptance_dry_run.py) writes the same inputs and checks
every command line the run would execute, for 1, 2 and 8 GPUs, against the parsers that will
read it: torchrun's (`torch.distributed.run.parse_args`), the trainer's
(`megatron_gspo.config.parse_cli`: the full config validation; then `preflight` at the job's
world size: model directory, dtype, layout, prompts, reward) and, for every engine command the
job derives from that config (`engines.launch.engine_command`), SGLang's own
`prepare_server_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_gspo.testing.sglang_server import GPU_TINY_ENGINE_ARGS

ROOT = Path(__file__).resolve().parents[2]

GPU_TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,  # one 128x128 FP8 block wide
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,  # SGLang's GPU attention kernels want >= 64
    num_experts=8,  # expert parallel up to 8 ranks (one 8-GPU node)
)
BF16_MISMATCH_BOUND = 0.05
"""Max `mismatch/abs_logp_diff` (mean |engine - trainer| per token, first mini-batch, where the
whole ratio is mismatch) for a bf16 engine vs the bf16 trainer. The same bound as the GPU smoke
test's engine-vs-HF-bf16 rescoring (tests/gpu/test_sglang_server.py); the CPU server measured a
mean of 0.0009 (tests/engines/test_sglang_server_cpu.py). Different kernels (SGLang's decode
with KV cache vs TE's fused attention) make it nonzero; a wrong weight mapping gives > 0.5."""
RUN_BUDGET_S = 8 * 60
"""The issue's budget for the whole run (environment build excluded)."""

# SGLang flags for a tiny model (no CUDA-graph capture, backends that take any head/vocab size);
# the GPU smoke test's own, as the list `rollout.launch.extra_args` holds.
ENGINE_EXTRA = list(GPU_TINY_ENGINE_ARGS)


@dataclass
class Phase:
    name: str
    steps: int
    sets: dict[str, Any]
    colocated: bool
    checks_mismatch: bool
    nproc: int = 1
    """Trainer ranks (torchrun --nproc_per_node): one per GPU the phase trains on."""
    result: dict[str, Any] = field(default_factory=dict)


def expert_parallel(ranks: int, experts: int = GPU_TINY["num_experts"]) -> int:
    """The largest EP that divides both the trainer ranks and the experts."""
    return max(d for d in range(1, min(ranks, experts) + 1) if ranks % d == 0 and experts % d == 0)


def prepare(out: Path) -> dict[str, Path]:
    """The tiny GPU-sized model (+ toy tokenizer), its block-FP8 copy and the toy prompts."""
    from transformers.utils import logging as hf_logging

    from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
    from megatron_gspo.data.toy import save_toy_tokenizer, write_toy_dataset
    from megatron_gspo.weights.hf_io import write_fp8_checkpoint

    hf_logging.disable_progress_bar()
    model, fp8, data = out / "model", out / "model_fp8", out / "toy.jsonl"
    if not (model / "config.json").exists():
        save_tiny_hf_checkpoint(model, seed=0, perturb_norms=False, **GPU_TINY)
        save_toy_tokenizer(model)
    if not (fp8 / "config.json").exists():
        write_fp8_checkpoint(model, fp8)
    if not data.exists():
        write_toy_dataset(data, 512, seed=0, ops=("copy",), min_len=1, max_len=2)
    return {"model": model, "fp8": fp8, "data": data}


def phases(
    out: Path, inputs: dict[str, Path], engine_python: str, gpus: int, fp8: bool = True
) -> list[Phase]:
    """The two jobs on `gpus` GPUs; `fp8=False` (a GPU without FP8 kernels) gives the second
    bf16 engines."""
    common = {
        "model.hf_path": inputs["model"],
        "model.dtype": "bf16",
        "train.device": "cuda",
        "data.train_path": inputs["data"],
        "rl.prompts_per_rollout": 8,
        "rl.group_size": 4,
        "rl.mini_batches_per_rollout": 2,
        "rollout.max_new_tokens": 8,
        "rollout.launch.backend": "sglang",
        "rollout.launch.python": engine_python,
        "rollout.launch.base_port": 0,
        "rollout.launch.startup_timeout_s": 300,
        "rollout.launch.extra_args": "[" + ",".join(ENGINE_EXTRA) + "]",
        "weights.dtype": "bfloat16",
        "weights.verify_every": 1,  # "verified" below: every step's push, not the schedule's
        "logging.tensorboard": "false",
        "logging.progress": "false",
        "checkpoint.save_every": 0,
    }
    colocated = Phase(
        "colocated",
        3,
        {
            **common,
            "train.steps": 3,
            "parallel.ep": expert_parallel(gpus),
            "rollout.launch.num_engines": gpus,  # one per GPU, next to that GPU's trainer rank
            "rollout.launch.colocated": "true",
            "rollout.launch.mem_fraction_static": 0.4,
            "weights.transport": "tensor",
        },
        colocated=True,
        checks_mismatch=True,
        nproc=gpus,
    )
    # Two GPUs or more: the trainer takes the first half, the engines the rest (base_gpu_id)
    # and the transport NCCL; one GPU: shared, gloo.
    own_gpu = gpus >= 2
    trainer = gpus // 2 if own_gpu else 1
    dist_fp8 = Phase(
        "dist_fp8",
        2,
        {
            **common,
            "train.steps": 2,
            "parallel.ep": expert_parallel(trainer),
            "rollout.launch.model_path": inputs["fp8" if fp8 else "model"],
            "rollout.launch.num_engines": gpus - trainer if own_gpu else 1,
            "rollout.launch.colocated": "false",
            "rollout.launch.base_gpu_id": trainer if own_gpu else 0,
            "rollout.launch.mem_fraction_static": 0.5 if own_gpu else 0.3,
            "weights.transport": "distributed",
            "weights.fp8": str(fp8).lower(),
            "weights.backend": "nccl" if own_gpu else "gloo",
        },
        colocated=False,
        checks_mismatch=False,  # FP8 engine vs bf16 trainer: reported, not bounded
        nproc=trainer,
    )
    for p in (colocated, dist_fp8):
        p.sets["logging.dir"] = out / p.name
        p.sets["checkpoint.dir"] = out / p.name / "ckpt"
    return [colocated, dist_fp8]


def command(phase: Phase, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(phase.nproc)]
    cmd += ["--master_port", str(port), "-m", "megatron_gspo.train"]
    # --overwrite: a second acceptance run in the same --out replaces the first.
    cmd += ["--config", str(ROOT / "examples/tiny_moe_cpu.yaml"), "--overwrite"]
    for key, value in phase.sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


# -- dry run -------------------------------------------------------------------------------
def check_command(phase: Phase, cmd: list[str], engines: list[list[str]]) -> list[str]:
    """Parse `cmd` as torchrun, then the trainer, then the engine command derived from the
    trainer's config as SGLang; returns a line per checked command and appends the engine
    command's arguments to `engines`."""
    from sglang.srt.server_args import prepare_server_args
    from torch.distributed.run import parse_args as torchrun_args

    from megatron_gspo.config import parse_cli
    from megatron_gspo.dist import free_port
    from megatron_gspo.engines.launch import engine_command
    from megatron_gspo.run.preflight import preflight

    assert cmd[1:3] == ["-m", "torch.distributed.run"], cmd
    run = torchrun_args(cmd[3:])
    assert run.module and run.training_script == "megatron_gspo.train", run
    assert (run.nproc_per_node, run.nnodes) == (str(phase.nproc), "1:1"), run
    cfg, cli = parse_cli(run.training_script_args)
    assert cli.overwrite and not cli.resume
    # The trainer's own input checks (model dir, dtype for the device, layout vs world size,
    # prompts, reward), as train.main runs them, on a fresh run directory: --overwrite would
    # delete a previous acceptance run's results here.
    with tempfile.TemporaryDirectory() as fresh:
        probe = dataclasses.replace(
            cfg,
            logging=dataclasses.replace(cfg.logging, dir=fresh),
            checkpoint=dataclasses.replace(cfg.checkpoint, dir=f"{fresh}/ckpt"),
        )
        preflight(probe, resume=False, overwrite=False, world_size=phase.nproc)
    launch = cfg.rollout.launch
    assert launch is not None and launch.backend == "sglang"
    assert cfg.model.dtype == "bf16" and cfg.train.steps == phase.steps
    assert launch.extra_args == ENGINE_EXTRA, launch.extra_args
    assert launch.colocated == phase.colocated
    assert cfg.parallel.ep == expert_parallel(phase.nproc), cfg.parallel
    # As the job does (engines/nodes.py): reserved ports from base_port 0 at launch.
    base = free_port(launch.host)
    # The first and the last engine: the others differ from them only in port and GPU.
    for i in sorted({0, launch.num_engines - 1}):
        engine = engine_command(dataclasses.replace(launch, base_port=base), i)
        assert engine[:3] == [launch.python, "-m", "sglang.launch_server"], engine[:3]
        server = prepare_server_args(engine[3:])
        engines.append(engine[3:])
        assert server.model_path == launch.model_path and server.dtype == "bfloat16"
        assert server.enable_memory_saver == phase.colocated
        assert server.skip_tokenizer_init
        assert server.base_gpu_id == launch.base_gpu_id + i * launch.gpus_per_engine
    if cfg.weights.fp8:
        qcfg = json.loads((Path(server.model_path) / "config.json").read_text())
        assert qcfg["quantization_config"]["weight_block_size"] == [128, 128], qcfg
    return [
        f"[dry-run] {phase.name}: torchrun ok ({run.nproc_per_node} proc, "
        f"-m {run.training_script}, ep={cfg.parallel.ep}, {launch.num_engines} engines)",
        f"[dry-run] {phase.name}: trainer config + preflight ok "
        f"({len(run.training_script_args)} args, "
        f"transport={cfg.weights.transport}, fp8={cfg.weights.fp8}, "
        f"backend={cfg.weights.backend})",
        f"[dry-run] {phase.name}: sglang.launch_server ok x{launch.num_engines} "
        f"({' '.join(engine[3:])})",
    ]


def check_engine_interpreter(python: str, engines: list[list[str]]) -> str:
    """The engine commands parsed once more by the interpreter that will run them (the engine
    venv's own SGLang), when it is given (scripts/test.sh exports MGSPO_ENGINE_PYTHON)."""
    if not Path(python).is_file():
        return "[dry-run] engine interpreter not given: its own SGLang parse skipped"
    code = (
        "import json, sys\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "for argv in json.loads(sys.stdin.read()):\n"
        "    prepare_server_args(argv)\n"
    )
    proc = subprocess.run(
        [python, "-c", code], input=json.dumps(engines), capture_output=True, text=True
    )
    if proc.returncode:
        raise RuntimeError(f"{python} rejects an engine command:\n{proc.stderr[-3000:]}")
    return f"[dry-run] {python}: its SGLang parses all {len(engines)} engine commands"


# -- the run -------------------------------------------------------------------------------
def run_phase(phase: Phase, port: int) -> None:
    from megatron_gspo.run.metrics_log import read_metrics

    log_dir = Path(phase.sets["logging.dir"])
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    env.setdefault("OMP_NUM_THREADS", "4")
    t0 = time.perf_counter()
    with open(log_dir / "job.log", "w") as out:
        proc = subprocess.run(
            command(phase, port), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    phase.result["wall_s"] = time.perf_counter() - t0
    phase.result["rc"] = proc.returncode
    metrics = log_dir / "metrics.jsonl"
    by_step = read_metrics(metrics) if metrics.exists() else {}
    phase.result["rows"] = [by_step[k] for k in sorted(by_step)]
    if proc.returncode:
        tail = (log_dir / "job.log").read_text()[-3000:]
        print(f"[acceptance] {phase.name} exited {proc.returncode}; job.log tail:\n{tail}")


def _finite(rows: list[dict[str, Any]]) -> bool:
    return all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, int | float))


def summarise(ps: list[Phase], total_s: float) -> tuple[str, bool]:
    cols = [
        ("phase", 10), ("rc", 3), ("steps", 5), ("wall s", 7), ("rollout s", 9),
        ("train s", 8), ("sync s", 7), ("versions", 9), ("verified", 8),
        ("mismatch mb1", 20), ("finite", 6), ("trainer GB before/offloaded", 27),
    ]  # fmt: skip
    lines = ["  ".join(f"{c:>{w}}" for c, w in cols)]
    ok_all = True
    for p in ps:
        rows = p.result.get("rows", [])

        def get(k: str, rows: list[dict[str, Any]] = rows) -> list[Any]:
            return [r[k] for r in rows if k in r]

        def mean(k: str, rows: list[dict[str, Any]] = rows) -> float:
            return sum(get(k, rows)) / max(1, len(get(k, rows)))

        versions = get("weights/version")
        verified = get("weights/verified")
        mism = get("mismatch/abs_logp_diff")
        checks = {
            "rc": p.result.get("rc") == 0,
            "steps": len(rows) == p.steps,
            "versions": len(versions) == p.steps and versions == sorted(set(versions)),
            "verified": len(verified) == p.steps and all(v == 1.0 for v in verified),
            "finite": bool(rows) and _finite(rows),
        }
        mm = f"{mism[0]:.4f}" if mism else "missing"
        if p.checks_mismatch:
            checks["mismatch"] = bool(mism) and mism[0] < BF16_MISMATCH_BOUND
            mm += f" < {BF16_MISMATCH_BOUND}"
        else:
            mm += " (fp8, info)"
        mem = "-"
        if p.colocated:
            before = get("memory/trainer_allocated_gb_before_offload")
            during = get("memory/trainer_allocated_gb_offloaded")
            checks["offload"] = bool(before) and all(d < b for b, d in zip(before, during))
            mem = f"{before[-1]:.3f}/{during[-1]:.3f}" if before and during else "not logged"
        vals = [
            p.name, p.result.get("rc", "-"), len(rows), f"{p.result.get('wall_s', 0):.0f}",
            f"{mean('time/rollout_s'):.2f}", f"{mean('time/train_s'):.2f}",
            f"{mean('time/sync_s'):.2f}", ",".join(str(int(v)) for v in versions) or "-",
            f"{sum(verified):.0f}/{p.steps}", mm, "yes" if checks["finite"] else "NO", mem,
        ]  # fmt: skip
        lines.append("  ".join(f"{v!s:>{w}}" for v, (_, w) in zip(vals, cols)))
        failed = [k for k, v in checks.items() if not v]
        if failed:
            lines.append(f"  {p.name}: FAILED {', '.join(failed)}")
        ok_all &= not failed
    within = "ok" if total_s <= RUN_BUDGET_S else "OVER"
    lines.append(f"total run {total_s:.0f} s (budget {RUN_BUDGET_S} s): {within}")
    lines.append("ACCEPTANCE " + ("PASSED" if ok_all else "FAILED"))
    return "\n".join(lines), ok_all


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="check command lines only (CPU)")
    p.add_argument("--out", default=str(ROOT / "runs/gpu_acceptance"))
    p.add_argument(
        "--engine-python",
        default=os.environ.get("MGSPO_ENGINE_PYTHON"),
        help="the engine venv's python (bash scripts/engine_env.sh)/bin/python",
    )
    p.add_argument("--gpus", type=int, default=None, help="default: torch.cuda.device_count()")
    p.add_argument("--master-port", type=int, default=0, help="torchrun's; 0: a free port")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    gpus = args.gpus if args.gpus is not None else torch.cuda.device_count()
    if not args.dry_run and gpus < 1:
        print("[acceptance] no CUDA device: run with --dry-run, or on a GPU machine")
        return 2
    if not args.dry_run and not args.engine_python:
        print("[acceptance] --engine-python is required (bash scripts/engine_env.sh)")
        return 2
    engine_python = args.engine_python or "ENGINE_PYTHON"
    inputs = prepare(out)
    # SGLang's FP8 kernels need compute capability 8.9 (Ada, Hopper) or newer.
    fp8 = args.dry_run or torch.cuda.get_device_capability(0) >= (8, 9)
    if not fp8:
        print("[acceptance] GPU below sm_89: the dist_fp8 phase runs a bf16 engine (FP8 skipped)")
    ps = phases(out, inputs, engine_python, max(gpus, 1), fp8=fp8)
    if args.dry_run:
        # One GPU (shared, gloo transport), two (engine on its own GPU, NCCL), a full node.
        variants = [gpus] if args.gpus is not None else [1, 2, 8]
        engines: list[list[str]] = []
        for n in variants:
            for i, phase in enumerate(phases(out, inputs, engine_python, n)):
                cmd = command(phase, args.master_port + i or 29517)
                for line in check_command(phase, cmd, engines):
                    print(f"{line} [{n} GPU]")
        print(check_engine_interpreter(engine_python, engines))
        steps = sum(p.steps for p in ps)
        print(f"[dry-run] ok: {len(ps)} jobs x {len(variants)} placements, {steps} steps")
        return 0
    t0 = time.perf_counter()
    from megatron_gspo.dist import free_port

    for i, phase in enumerate(ps):
        print(f"[acceptance] {phase.name}: {phase.steps} steps ...", flush=True)
        run_phase(phase, args.master_port + i if args.master_port else free_port())
    table, ok = summarise(ps, time.perf_counter() - t0)
    print(table)
    (out / "summary.txt").write_text(table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
