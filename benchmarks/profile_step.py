"""Where our GSPO step's time goes on CPU: wall and CPU seconds per section, per trainer rank.

    python benchmarks/profile_step.py --steps 8                  # embedded engine
    python benchmarks/profile_step.py --steps 10 --engine sglang # the real SGLang CPU server

Runs `megatron_gspo.train` on `examples/tiny_moe_cpu.yaml` with `benchmarks/vs_trl.py`'s
settings (same toy, 2 CPU ranks, EP=2, 1 thread each) and times, on each rank, from the third
update on (the first two pay first-call costs): `Policy.update` and inside it megatron-core's
schedule (forward + backward, the loss), the optimizer step, the metric reduction, packing,
the gradient finiteness check, the routing probe; every torch.distributed collective (count
and time: on a shared machine a collective's wall time is mostly waiting for the other rank to
be scheduled); the rollout (rank 0: `Rollout.next_batch`, and the engine's own per-request
`e2e_latency`, the rest being ours: HTTP, scheduler, reward, sample building; SGLang runs the
requests together, the embedded engine one at a time, so there the longest request is not the
engine's total); the broadcast of
the sequences to the other ranks; the weight push. CPU time (`time.process_time`) is what a
loaded machine does not stretch; wall time is what the step costs there.

The sections are measured by wrapping the functions named above in this process (nothing in
the package changes); nested sections overlap (the schedule holds the collectives).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 2  # updates not timed


def _rank_main(argv: list[str]) -> None:
    """The rank program: `megatron_gspo.train` with the sections timed."""
    import torch
    import torch.distributed as tdist

    from megatron_gspo import train
    from megatron_gspo.megatron import policy as mpolicy
    from megatron_gspo.megatron import step as mstep
    from megatron_gspo.megatron import transfer as mtransfer
    from megatron_gspo.rollout import experience as mexp
    from megatron_gspo.weights import sync as msync

    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    state = {"on": False, "updates": 0, "always": False}
    rollouts: list[dict[str, Any]] = []

    def add(key: str, t: float, c: float) -> None:
        w = acc[key]
        w[0] += time.perf_counter() - t
        w[1] += time.process_time() - c
        w[2] += 1

    def wrap(obj: Any, name: str, key: str, always: bool = False) -> None:
        orig = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            if not (state["on"] or (always and state["updates"] > WARMUP)):
                return orig(*a, **k)
            t, c = time.perf_counter(), time.process_time()
            try:
                return orig(*a, **k)
            finally:
                add(key, t, c)

        setattr(obj, name, timed)

    orig_update = mpolicy.Policy.update

    def update(self: Any, *a: Any, **k: Any) -> Any:
        state["updates"] += 1
        state["on"] = state["updates"] > WARMUP
        t, c = time.perf_counter(), time.process_time()
        try:
            return orig_update(self, *a, **k)
        finally:
            if state["on"]:
                add("update", t, c)
            state["on"] = False

    mpolicy.Policy.update = update  # type: ignore[method-assign]
    wrap(mstep, "_schedule", "update/schedule (fwd+bwd, loss)")
    wrap(mstep, "_policy_loss", "update/loss function")
    wrap(mstep, "reduce_metrics", "update/reduce_metrics")
    wrap(mstep, "grads_finite", "update/grads_finite")
    wrap(mstep, "plan_for_this_rank", "update/packing")
    wrap(mpolicy, "routing_snapshot", "update/routing probe forward")
    for n in (
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "all_to_all_single",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "broadcast",
        "barrier",
    ):
        wrap(tdist, n, f"collective/{n}")
    orig_build = mpolicy.Policy.build.__func__  # type: ignore[attr-defined]

    def build(cls: Any, cfg: Any) -> Any:
        policy = orig_build(cls, cfg)
        wrap(policy.optimizer, "step", "update/optimizer.step")
        return policy

    mpolicy.Policy.build = classmethod(build)  # type: ignore[method-assign, assignment]
    wrap(mtransfer, "broadcast_sequences", "step/broadcast_sequences", always=True)
    wrap(msync.WeightSync, "push", "step/weight push", always=True)
    orig_next, orig_reports = mexp.Rollout.next_batch, mexp.Rollout._step_reports

    def reports(self: Any, samples: list[Any]) -> Any:
        lat = [s.meta["e2e_latency"] for s in samples if s.meta.get("e2e_latency") is not None]
        rollouts.append({"samples": len(samples), "engine_e2e_max_s": max(lat, default=None)})
        return orig_reports(self, samples)

    def next_batch(self: Any) -> Any:
        t, c = time.perf_counter(), time.process_time()
        out = orig_next(self)
        rollouts[-1].update(
            wall_s=time.perf_counter() - t,
            cpu_s=time.process_time() - c,
            reward_s=out[1].get("time/reward_s"),
        )
        return out

    mexp.Rollout._step_reports = reports  # type: ignore[method-assign]
    mexp.Rollout.next_batch = next_batch  # type: ignore[method-assign]
    out = Path(os.environ["MGSPO_PROFILE_OUT"])
    rank = int(os.environ.get("RANK", "0"))
    try:
        train.main(argv)
    finally:
        timed = state["updates"] - WARMUP
        (out / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "updates_timed": timed,
                    "threads": [torch.get_num_threads(), torch.get_num_interop_threads()],
                    "sections": dict(acc),
                    "rollouts": rollouts[WARMUP:],
                }
            )
        )


def report(out: Path) -> None:
    for path in sorted(out.glob("rank*.json")):
        d = json.loads(path.read_text())
        n = max(1, d["updates_timed"])
        print(
            f"\n{path.stem}: {d['updates_timed']} steps timed; torch threads / interop "
            f"threads {d['threads'][0]} / {d['threads'][1]}; per step:"
        )
        print(f"  {'section':<38} {'wall ms':>8} {'CPU ms':>8} {'calls':>6}")
        for k, (w, c, calls) in sorted(d["sections"].items()):
            print(f"  {k:<38} {w / n * 1e3:8.1f} {c / n * 1e3:8.1f} {calls / n:6.1f}")
        rs = [r for r in d["rollouts"] if "wall_s" in r]
        if rs:
            mean = {k: sum(r[k] or 0.0 for r in rs) / len(rs) for k in rs[0] if k != "samples"}
            print(
                f"  rollout (next_batch): wall {mean['wall_s'] * 1e3:.1f} ms, CPU "
                f"{mean['cpu_s'] * 1e3:.1f} ms; the engine's longest request (e2e_latency) "
                f"{mean['engine_e2e_max_s'] * 1e3:.1f} ms; reward {mean['reward_s'] * 1e3:.1f} ms"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--engine", choices=("embedded", "sglang"), default="embedded")
    ap.add_argument("--out", default=None, help="keep logs and per-rank JSON here")
    ap.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.rank_worker:
        _rank_main(rest)
        return
    sys.path.insert(0, str(ROOT))
    import subprocess

    from benchmarks import vs_trl
    from tools import make_tiny_toy

    with tempfile.TemporaryDirectory(prefix="mgspo-profile-") as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        toy = make_tiny_toy.main(["--out", str(out / "toy")])
        cmd, env = vs_trl.ours_command(toy, out, args.steps, args.engine)
        i = cmd.index("megatron_gspo.train")  # `-m megatron_gspo.train` -> this file
        cmd[i - 1 : i + 1] = [str(Path(__file__).resolve()), "--rank-worker"]
        env["MGSPO_PROFILE_OUT"] = str(out)
        load0 = os.getloadavg()
        with (out / "train.log").open("w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if rc.returncode:
            raise SystemExit(f"training exited {rc.returncode}; see {out / 'train.log'}")
        a, b = load0, os.getloadavg()
        print(f"load average: {a[0]:.1f} {a[1]:.1f} {a[2]:.1f} -> {b[0]:.1f} {b[1]:.1f}")
        report(out)


if __name__ == "__main__":
    main()
