"""Where the sender's export time goes: cProfile of trainer rank 0 draining the export that
`WeightSync.push` uses (`stream.hf_tensors` with batched expert gathers), grouped by owner.

    python benchmarks/export_profile.py                    # small preset, EP=2
    python benchmarks/export_profile.py --layout tp2 --size medium

Two gloo ranks build the model of `benchmarks/weight_sync.py`; after a warm-up pass, rank 0
runs `--passes` exports under cProfile. The report gives the wall per pass, the share of
rank 0's time per owner (self time of the functions, grouped by the file they live in:
megatron-bridge's Python, megatron-core, our code, torch's Python, C calls such as the gloo
collectives, copies and casts), and the functions with the most self time.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.weight_sync import LAYOUTS, build_rank_model, save_bench_model  # noqa: E402
from megatron_gspo.testing.harness import spawn_ranks  # noqa: E402


def _owner(file: str, func: str) -> str:
    """Who owns a profiled function: a library by its path, or the kind of C call."""
    if file == "~":  # a C function: name it by what it does
        low = func.lower()
        for key, label in (
            ("gather", "C: gloo collectives (gather/all_gather/broadcast)"),
            ("broadcast", "C: gloo collectives (gather/all_gather/broadcast)"),
            ("barrier", "C: gloo collectives (gather/all_gather/broadcast)"),
            ("wait", "C: gloo collectives (gather/all_gather/broadcast)"),
            ("copy_", "C: tensor copies / casts (copy_, to, contiguous, cat, cpu)"),
            ("'to'", "C: tensor copies / casts (copy_, to, contiguous, cat, cpu)"),
            ("contiguous", "C: tensor copies / casts (copy_, to, contiguous, cat, cpu)"),
            ("cat", "C: tensor copies / casts (copy_, to, contiguous, cat, cpu)"),
            ("'cpu'", "C: tensor copies / casts (copy_, to, contiguous, cat, cpu)"),
            ("clone", "C: tensor copies / casts (copy_, to, contiguous, cat, cpu)"),
        ):
            if key in low:
                return label
        return "C: other (views, python builtins, ...)"
    for key, label in (
        ("megatron/bridge", "megatron-bridge (Python)"),
        ("megatron/core", "megatron-core (Python)"),
        ("megatron_gspo", "ours (megatron_gspo)"),
        ("torch/", "torch (Python)"),
    ):
        if key in file:
            return label
    return "other Python (stdlib, ...)"


def _references(gathered: int, nbytes: int, rank: int, repeats: int = 3) -> dict[str, float]:
    """Floors measured now: one gloo `gather` to rank 0 of `gathered` bytes in all (half from
    each rank, as EP=2 gathers the expert bytes; a TCP socket on one host) and a memcpy of
    `nbytes` (rank 0)."""
    dist = torch.distributed
    half = torch.ones(gathered // 2, dtype=torch.uint8)
    parts = [torch.empty_like(half) for _ in range(2)] if rank == 0 else None
    best_gather = best_copy = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        dist.gather(half, parts, dst=0)
        best_gather = min(best_gather, time.perf_counter() - t)
    if rank == 0:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.zeros_like(src)
        for _ in range(repeats):
            t = time.perf_counter()
            dst.copy_(src)
            best_copy = min(best_copy, time.perf_counter() - t)
    return dict(gather_s=best_gather, memcpy_s=best_copy, gathered=gathered)


def rank_main(rank: int, world: int, hf_dir: str, layout: dict, mb: float, passes: int) -> Any:
    from megatron_gspo.weights.stream import hf_tensors

    bridge, model = build_rank_model(hf_dir, layout)

    expert_bytes = 0

    def drain() -> tuple[int, int]:
        nonlocal expert_bytes
        n = nbytes = expert_bytes = 0
        for name, t in hf_tensors(bridge, model, cpu=True, expert_batch_bytes=int(mb * 2**20)):
            n += 1
            nbytes += t.numel() * t.element_size()
            expert_bytes += t.numel() * t.element_size() if ".experts." in name else 0
        return n, nbytes

    drain()  # warm-up: first-call costs
    prof = cProfile.Profile()
    walls = []
    for _ in range(passes):
        torch.distributed.barrier()
        t = time.perf_counter()
        prof.enable()
        n, nbytes = drain()
        prof.disable()
        walls.append(time.perf_counter() - t)
    # EP=2: half the expert bytes come from the other rank (TP=2: half of every TP-split one)
    # What one pass spends planning: the bridge rebuilds its conversion tasks at every export.
    plan_s = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        bridge.get_conversion_tasks(model)
        plan_s = min(plan_s, time.perf_counter() - t)
    if os.environ.get("MGSPO_PROFILE_DUMP"):  # the raw profile, for pstats / snakeviz
        prof.dump_stats(f"{os.environ['MGSPO_PROFILE_DUMP']}.rank{rank}")
    ref = _references(expert_bytes if layout.get("ep") else nbytes, nbytes, rank)
    stats = pstats.Stats(prof)
    owners: collections.Counter = collections.Counter()
    funcs = []
    for (file, line, func), (_, calls, tottime, _cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        owners[_owner(file, func)] += tottime
        funcs.append((tottime, calls, f"{Path(file).name}:{line} {func}"))
    funcs.sort(reverse=True)
    out = dict(walls=walls, tensors=n, bytes=nbytes, owners=owners, funcs=funcs[:25], **ref)
    out["plan_s"] = plan_s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="ep2", choices=sorted(LAYOUTS))
    ap.add_argument("--size", default="small")
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mgspo-export-prof-") as tmp:
        hf = save_bench_model(Path(tmp) / "hf", args.size)
        both = spawn_ranks(rank_main, 2, str(hf), LAYOUTS[args.layout], args.bucket_mb, args.passes)
    res = both[0]
    total = sum(res["owners"].values())
    print(
        f"\nexport profile: {args.layout}, size {args.size}, {res['tensors']} HF tensors, "
        f"{res['bytes'] / 1e6:.1f} MB; load average {load[0]:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print("wall per pass (s, under cProfile): " + " ".join(f"{w:.3f}" for w in res["walls"]))
    print(f"per HF tensor: {1e3 * total / args.passes / res['tensors']:.2f} ms of profiled time")
    gb = res["bytes"] / 1e9
    best = min(res["walls"])
    print(
        f"floors measured in the same run: memcpy of {gb:.3f} GB {res['memcpy_s']:.4f} s "
        f"({gb / res['memcpy_s']:.2f} GB/s); one gloo gather of the same bytes (half per rank) "
        f"{res['gather_s']:.4f} s ({gb / res['gather_s']:.2f} GB/s = "
        f"{res['memcpy_s'] / res['gather_s']:.3f}x memcpy); fastest export pass {best:.3f} s "
        f"({gb / best:.2f} GB/s = {res['memcpy_s'] / best:.3f}x memcpy)"
    )
    print(
        f"the bridge's task planning alone (get_conversion_tasks, done inside every export): "
        f"{res['plan_s']:.4f} s ({100 * res['plan_s'] / best:.0f}% of the fastest pass)"
    )
    for rank, r in enumerate(both):
        tot = sum(r["owners"].values())
        print(f"\nrank {rank} self time by owner ({tot:.3f} s over {args.passes} passes):")
        for owner, sec in r["owners"].most_common():
            print(f"  {100 * sec / tot:5.1f}%  {sec:7.3f} s  {owner}")
        print(f"rank {rank} functions with the most self time:")
        for tottime, calls, where in r["funcs"][:15]:
            print(f"  {100 * tottime / tot:5.1f}%  {tottime:7.3f} s  {calls:7d} calls  {where}")


if __name__ == "__main__":
    main()
