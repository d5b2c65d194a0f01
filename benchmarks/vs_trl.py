"""The whole GSPO step, ours against TRL's `GRPOTrainer`, on CPU, side by side in one run.

    python benchmarks/vs_trl.py --steps 10          # both, then one table
    python benchmarks/vs_trl.py --steps 10 --only ours

Both train the same tiny Qwen3-MoE (HF weights and toy tokenizer built locally by
`tools/make_tiny_toy.py`) on the same toy prompts with the same toy reward and GSPO settings:
sequence-level importance ratios, clip eps 3e-4 / 4e-4, no KL, group-normalised advantages,
8 prompts x 8 responses per rollout, at most 4 new tokens, temperature 1, 4 optimizer steps
(mini-batches of 16) per rollout, Adam lr 3e-3 constant, grad clip 1.0, fp32.

* ours: `megatron_gspo.train` on `examples/tiny_moe_cpu.yaml` as `scripts/main.sh` runs it:
  2 CPU ranks (EP=2, 1 thread each), the embedded rollout engine (its own process), a weight
  push per step; old log-probs are the engine's (`rl.pi_old: engine`).
* TRL: `GRPOTrainer` (`importance_sampling_level="sequence"`, `loss_type="grpo"`, `beta=0`),
  one process with 2 threads, HF `generate` on the policy itself (no weight sync); old
  log-probs from an extra forward pass of the policy (4 optimizer steps per generation).

TRL is not a project dependency: it runs in a benchmark-only venv
(benchmarks/requirements-trl.txt; `--trl-python`, default `$MGSPO_TRL_PYTHON` or
~/.cache/megatron-gspo/trl-bench-venv/bin/python), which reuses the trainer venv's torch and
transformers through a .pth file:

    V=$(bash scripts/env.sh); T=~/.cache/megatron-gspo/trl-bench-venv
    python3.12 -m venv $T && echo "$V/lib/python3.12/site-packages" \\
        > $T/lib/python3.12/site-packages/trainer-venv.pth
    $T/bin/pip install -r benchmarks/requirements-trl.txt

Per step (one rollout + its 4 optimizer steps), the mean over the steps after the first
(warm-up): `rollout` = generation + reward (+ TRL's old-log-prob forward, shown apart in
`old_lp`), `train` = the optimizer steps, `sync` = the weight push (TRL: none), `step`; peak
RSS of the whole process tree (ours: trainer ranks + engine + reward worker), sampled every
0.1 s; tokens/s = prompt + response tokens of the rollout / step time; reward = mean reward of
the last step's rollout and the mean over the last 3 steps. For TRL (one process) also its CPU
seconds per step (process time): on a shared machine wall time stretches, CPU time does not.
Where our step's time goes: benchmarks/profile_step.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV_PYTHON = Path.home() / ".cache/megatron-gspo/trl-bench-venv/bin/python"
PROMPTS, GROUP, MINI_BATCHES, MAX_NEW = 8, 8, 4, 4
LR, EPS_LOW, EPS_HIGH, CLIP = 3e-3, 3e-4, 4e-4, 1.0


# ---- peak memory of a process tree --------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _tree_rss(pid: int) -> int:
    """Sum of VmRSS (bytes) over `pid` and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
        todo += _children(p)
    return total


def run_measured(cmd: list[str], env: dict[str, str], log: Path) -> tuple[int, int, float]:
    """Run `cmd` (output to `log`); returns (exit code, peak tree RSS in bytes, wall s)."""
    peak = 0
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.1):
                peak = max(peak, _tree_rss(proc.pid))

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        rc = proc.wait()
        done.set()
        th.join()
    return rc, peak, time.perf_counter() - t0


# ---- ours -----------------------------------------------------------------------------------
def ours_command(
    toy: Path, out: Path, steps: int, engine: str = "embedded"
) -> tuple[list[str], dict[str, str]]:
    """The torchrun command line and environment of our run (benchmarks/profile_step.py
    times the same run)."""
    sets: dict[str, Any] = {
        "model.hf_path": toy / "model",
        "data.train_path": toy / "toy.jsonl",
        "logging.dir": out / "ours",
        "checkpoint.dir": out / "ours/ckpt",
        "checkpoint.save_every": 0,
        "train.steps": steps,
        "rl.group_size": GROUP,
        "rl.prompts_per_rollout": PROMPTS,
        "rl.mini_batches_per_rollout": MINI_BATCHES,
        "rollout.max_new_tokens": MAX_NEW,
        "optim.lr": LR,
        "loss.eps_low": EPS_LOW,
        "loss.eps_high": EPS_HIGH,
        "logging.tensorboard": "false",
        "logging.progress": "false",
    }
    if engine == "sglang":  # as `scripts/main.sh --engine sglang`: the real server, bf16
        from megatron_gspo.testing.sglang_server import engine_python

        sets |= {
            "rollout.launch.backend": "sglang",
            "rollout.launch.device": "cpu",
            "rollout.launch.python": engine_python(),
        }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(_free_port()), "-m", "megatron_gspo.train"]
    cmd += ["--config", str(ROOT / "examples/tiny_moe_cpu.yaml")]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    env["OMP_NUM_THREADS"] = "1"  # as scripts/main.sh: 2 ranks on 2 cores
    return cmd, env


def run_ours(toy: Path, out: Path, steps: int, engine: str = "embedded") -> dict[str, Any]:
    cmd, env = ours_command(toy, out, steps, engine)
    rc, peak, wall = run_measured(cmd, env, out / "ours.log")
    if rc:
        raise SystemExit(f"ours exited {rc}; see {out / 'ours.log'}")
    rows = [json.loads(x) for x in (out / "ours/metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) >= 1 and "time/step_s" in r]
    per_step = []
    for r in rows:
        tokens = r["perf/tokens_per_s"] * r["time/train_s"]  # prompt + response tokens
        per_step.append(
            dict(
                rollout=r["time/step_s"] - r["time/train_s"] - r["time/sync_s"],
                old_lp=0.0,  # the engine's log-probs (rl.pi_old: engine)
                train=r["time/train_s"],
                sync=r["time/sync_s"],
                step=r["time/step_s"],
                tokens=tokens,
                reward=r["reward/mean"],
            )
        )
    return dict(per_step=per_step, peak_rss=peak, wall=wall)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- TRL (runs in the TRL venv: `--trl-worker`) ---------------------------------------------
def trl_worker(toy: Path, out: Path, steps: int, threads: int) -> None:
    """GRPOTrainer with GSPO settings; writes `out/trl_steps.json` (per rollout step)."""
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_gspo.rewards.toy import toy_reward

    rows = [json.loads(x) for x in (toy / "toy.jsonl").read_text().splitlines()]
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def reward(prompts: list, completions: list, answer: list, **_: Any) -> list[float]:
        return [toy_reward(p, c, a) for p, c, a in zip(prompts, completions, answer, strict=True)]

    cfg = GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        seed=0,
        per_device_train_batch_size=PROMPTS * GROUP // MINI_BATCHES,
        gradient_accumulation_steps=1,
        steps_per_generation=MINI_BATCHES,
        num_generations=GROUP,
        max_completion_length=MAX_NEW,
        temperature=1.0,
        top_p=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=CLIP,
        beta=0.0,
        epsilon=EPS_LOW,
        epsilon_high=EPS_HIGH,
        importance_sampling_level="sequence",
        loss_type="grpo",
        scale_rewards="group",
        max_steps=steps * MINI_BATCHES,
        logging_steps=MINI_BATCHES,
        report_to=[],
        save_strategy="no",
        bf16=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(toy / "model", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(toy / "model")
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok
    )
    times: dict[str, float] = {"gen": 0.0, "score": 0.0, "step": 0.0, "cpu": 0.0}
    events: list[dict[str, Any]] = []

    def timed(fn: Any, key: str) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[key] += time.perf_counter() - t

        return wrapper

    trainer._generate = timed(trainer._generate, "gen")  # HF generate (+ tokenisation)
    # generation + reward + old log-prob forward + advantages
    trainer._generate_and_score_completions = timed(
        trainer._generate_and_score_completions, "score"
    )

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            times["step"] += time.perf_counter() - self.t
            times["cpu"] += time.process_time() - self.cpu  # the process's CPU seconds
            if state.global_step % MINI_BATCHES == 0:  # one rollout and its optimizer steps
                events.append({"times": dict(times)})
                for k in times:
                    times[k] = 0.0

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any):
            events.append({"log": dict(logs or {})})

    trainer.add_callback(StepTimes())
    trainer.train()
    (out / "trl_steps.json").write_text(json.dumps(events))


def run_trl(toy: Path, out: Path, steps: int, python: str, threads: int) -> dict[str, Any]:
    cmd = [python, str(Path(__file__).resolve()), "--trl-worker", "--toy", str(toy)]
    cmd += ["--out", str(out), "--steps", str(steps), "--trl-threads", str(threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    env["OMP_NUM_THREADS"] = str(threads)
    rc, peak, wall = run_measured(cmd, env, out / "trl.log")
    if rc:
        raise SystemExit(f"TRL exited {rc}; see {out / 'trl.log'}")
    events = json.loads((out / "trl_steps.json").read_text())
    timed = [e["times"] for e in events if "times" in e]
    logged = [e["log"] for e in events if "log" in e and "reward" in e["log"]]
    per_step, tokens_seen = [], 0.0
    for t, log in zip(timed, logged, strict=False):
        tokens = float(log.get("num_tokens", 0.0)) - tokens_seen
        tokens_seen = float(log.get("num_tokens", 0.0))
        per_step.append(
            dict(
                rollout=t["score"],
                old_lp=t["score"] - t["gen"],
                train=t["step"] - t["score"],
                sync=0.0,
                step=t["step"],
                cpu=t.get("cpu", float("nan")),
                tokens=tokens,
                reward=float(log["reward"]),
            )
        )
    return dict(per_step=per_step, peak_rss=peak, wall=wall)


# ---- table ----------------------------------------------------------------------------------
def summarise(name: str, res: dict[str, Any]) -> dict[str, Any]:
    steps = res["per_step"]
    warm = steps[1:] or steps  # the first step pays first-call costs

    def mean(key: str) -> float:
        return sum(s[key] for s in warm) / len(warm)

    last3 = [s["reward"] for s in steps[-3:]]
    cpu = [s["cpu"] for s in warm if "cpu" in s]
    return dict(
        name=name,
        steps=len(steps),
        **{k: mean(k) for k in ("rollout", "old_lp", "train", "sync", "step")},
        tok_s=sum(s["tokens"] for s in warm) / sum(s["step"] for s in warm),
        rss_gb=res["peak_rss"] / 1e9,
        reward_first=steps[0]["reward"],
        reward_last=steps[-1]["reward"],
        reward_last3=sum(last3) / len(last3),
        wall=res["wall"],
        cpu=sum(cpu) / len(cpu) if cpu else None,
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'run':<6} {'steps':>5} {'rollout':>8} {'old_lp':>7} {'train':>7} {'sync':>7} "
        f"{'step':>7} {'tok/s':>7} {'RSS GB':>7} {'reward 1st':>10} {'last':>6} {'last3':>6} "
        f"{'wall':>6}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['name']:<6} {r['steps']:5d} {r['rollout']:8.3f} {r['old_lp']:7.3f} "
            f"{r['train']:7.3f} {r['sync']:7.3f} {r['step']:7.3f} {r['tok_s']:7.0f} "
            f"{r['rss_gb']:7.2f} {r['reward_first']:10.3f} {r['reward_last']:6.3f} "
            f"{r['reward_last3']:6.3f} {r['wall']:6.0f}"
        )
    for r in rows:
        if r["cpu"] is not None:  # a loaded machine stretches wall time, not CPU time
            print(f"{r['name']}: {r['cpu']:.3f} CPU s per step (process time, 1 process)")
    if len(rows) == 2:
        ours, trl = rows
        print(f"ours / TRL step time: {ours['step'] / trl['step']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="rollout steps per run")
    ap.add_argument("--only", choices=("ours", "trl"), default=None)
    ap.add_argument(
        "--engine",
        choices=("embedded", "sglang"),
        default="embedded",
        help="our rollout engine: the embedded one (scripts/main.sh) or the real SGLang CPU "
        "server (scripts/main.sh --engine sglang)",
    )
    ap.add_argument("--trl-python", default=os.environ.get("MGSPO_TRL_PYTHON", TRL_VENV_PYTHON))
    ap.add_argument(
        "--trl-threads",
        type=int,
        default=1,
        help="torch threads of the TRL run (2 on the shared 2-core machine: OpenMP threads "
        "oversubscribed, 20x slower steps; docs/performance.md)",
    )
    ap.add_argument("--out", default=None, help="keep logs and metrics here (default: tmp)")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--toy", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(Path(args.toy), Path(args.out), args.steps, args.trl_threads)
        return
    sys.path.insert(0, str(ROOT))
    from tools import make_tiny_toy

    with tempfile.TemporaryDirectory(prefix="mgspo-vs-trl-") as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        toy = make_tiny_toy.main(["--out", str(out / "toy")])
        rows, loads = [], []
        for name in ("ours", "trl"):
            if args.only not in (None, name):
                continue
            load0 = os.getloadavg()
            if name == "ours":
                res = run_ours(toy, out, args.steps, args.engine)
            else:
                res = run_trl(toy, out, args.steps, str(args.trl_python), args.trl_threads)
            loads.append((name, load0, os.getloadavg()))
            rows.append(summarise(name, res))
    print(
        f"\nGSPO step on CPU, ours ({args.engine} engine) vs TRL ({args.trl_threads} thread(s)): "
        f"{PROMPTS} prompts x {GROUP} responses, <= {MAX_NEW} "
        f"new tokens, {MINI_BATCHES} optimizer steps per rollout, {args.steps} steps; means "
        "over steps 2..N (seconds)"
    )
    for name, a, b in loads:
        print(f"load average {name}: {a[0]:.1f} {a[1]:.1f} {a[2]:.1f} -> {b[0]:.1f} {b[1]:.1f}")
    print_table(rows)


if __name__ == "__main__":
    main()
