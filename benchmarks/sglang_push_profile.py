"""Where the REAL SGLang CPU server spends a weight push: timed pushes of a locally built
Qwen3-MoE into `python -m sglang.launch_server --device cpu` (bf16), with a py-spy profile of
the server's processes while they run.

    python benchmarks/sglang_push_profile.py                      # small preset, tensor
    python benchmarks/sglang_push_profile.py --size medium --pushes 3

The sender is `WeightSync` (tensor transport, bf16, verification on every push so that the
engine's `/weights_checker` hashing is in the profile) fed by a stand-in bridge that yields the
checkpoint's HF tensors (no Megatron: this measures the engine side). py-spy (from the engine
venv) samples every process of the server at 100 Hz for the whole series of pushes; the report
lists the SGLang / torch functions with the largest inclusive share of samples, i.e. where the
engine's time goes: payload decode, the model's `load_weights` (its per-name expert mapping),
the checksum pass.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.weight_sync import SIZES, save_bench_model  # noqa: E402


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def summarise_raw(raw: Path, top: int = 25) -> list[tuple[float, str]]:
    """(share of samples, function) with the largest inclusive shares in a py-spy `--format
    raw` file (collapsed stacks: `frame;frame;... count`), idle frames dropped."""
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        if any(k in frames[-1] for k in ("select", "poll", "wait", "sleep", "recv", "accept")):
            continue  # idle: waiting for work
        total += int(n)
        for f in set(frames):
            inclusive[f] += int(n)
    return [(c / max(total, 1), f) for f, c in inclusive.most_common(top)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=None, help="keep the server log and profile here")
    args = ap.parse_args()

    from megatron_gspo.dist import free_port
    from megatron_gspo.engines.client import ClientConfig, SGLangClient
    from megatron_gspo.engines.launch import ServerGroup
    from megatron_gspo.testing import sglang_server
    from megatron_gspo.testing.weights import load_hf_state
    from megatron_gspo.weights.config import WeightSyncConfig
    from megatron_gspo.weights.sync import WeightSync
    from tests.engines.helpers import HFBridge

    python = sglang_server.engine_python()
    if python is None:
        raise SystemExit("no SGLang engine venv: run `bash scripts/engine_env.sh` first")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mgspo-sglang-push-") as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        hf = save_bench_model(Path(tmp) / "hf", args.size)
        weights = {n: t.to(torch.bfloat16) for n, t in load_hf_state(str(hf)).items()}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        # A free port: the default (30000) may be another job's engine on a shared machine.
        cfg = sglang_server.cpu_launch_config(
            str(hf), python=python, log_dir=str(out), base_port=free_port()
        )
        group = ServerGroup(cfg)
        t = time.perf_counter()
        group.start()
        startup = time.perf_counter() - t
        client = SGLangClient(ClientConfig(engine_urls=cfg.engine_urls))
        spy = None
        try:
            sync_cfg = WeightSyncConfig(
                transport="tensor",
                dtype="bfloat16",
                experts_to_first=False,
                verify_every=1,
                bucket_mb=args.bucket_mb,
            )
            sync = WeightSync(HFBridge(weights), [client], sync_cfg)
            sync.push([])  # warm-up: first-call costs, naming learnt
            if not args.no_profile:
                pids = _tree(group.engines[0].pid)
                spy_bin = str(Path(python).parent / "py-spy")
                raw = out / "engine_push.raw"
                cmd = [spy_bin, "record", "--format", "raw", "-r", "100", "-o", str(raw)]
                cmd += ["--pid", str(pids[0]), "--subprocesses", "--nonblocking"]
                spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                time.sleep(2.0)  # py-spy attaches
            reports = []
            for _ in range(args.pushes):
                reports.append(sync.push([]))
            if spy is not None:
                spy.send_signal(2)  # SIGINT: py-spy writes the profile and exits
                spy.wait(60)
        finally:
            client.close()
            group.shutdown()
        raw = out / "engine_push.raw"
        top = summarise_raw(raw) if spy is not None and raw.exists() else []
    load1 = os.getloadavg()
    best = min(reports, key=lambda r: r.seconds)
    ph = best.stats.seconds
    print(
        f"\nreal SGLang CPU server (bf16), size {args.size}: {nbytes / 1e6:.1f} MB, "
        f"{best.stats.tensors} tensors, {best.stats.buckets} buckets of {args.bucket_mb:g} MiB; "
        f"server startup {startup:.0f} s\nload average {load0[0]:.1f} -> {load1[0]:.1f}"
    )
    print("pushes (s): " + " ".join(f"{r.seconds:.2f}" for r in reports))
    print(
        f"fastest push {best.seconds:.3f} s = {nbytes / 1e9 / best.seconds:.3f} GB/s; phases: "
        + ", ".join(f"{k} {v:.3f}" for k, v in sorted(ph.items()))
    )
    if top:
        print("\nengine side, inclusive share of busy samples (py-spy, all server processes):")
        for share, f in top:
            print(f"  {100 * share:5.1f}%  {f}")
    elif spy is not None and spy.stderr is not None:
        print("py-spy:", spy.stderr.read().decode()[-2000:])


if __name__ == "__main__":
    main()
