"""How a trainer rank ends, launched many times (issue 40: a successful run sometimes exited
134, `terminate called without an active exception`, once in ~40 launches).

    python benchmarks/teardown_loop.py --launches 200            # the trainer's exit path
    python benchmarks/teardown_loop.py --launches 200 --old      # the exit before issue 40
    nice -n 10 python benchmarks/teardown_loop.py ...            # beside other work (load)

Each launch forks 2 ranks from this process, which imported torch and megatron-core once (a
launch then costs seconds, not the ~30 s of imports per rank on a loaded 2-core machine); each
rank ends as its own interpreter would (SystemExit, finalization, C++ static destructors). It
joins a fresh gloo group (torchrun's environment variables, a new port), builds its parallel state
for EP=2 (the tiny example's 24 gloo groups), runs collectives on several groups (async ones
too, left to complete as the last step's did) and ends:

* default: `teardown.end_process(0)`, what `train.cli` runs;
* `--old`: `torch.distributed.destroy_process_group()` and a normal interpreter exit, what
  `train.main` / `train.cli` did before.

Prints one table: launches, exit codes seen, launches with `terminate called` in a rank's
output, and the backend threads each rank still had before its interpreter exit.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))


def rank_main(old: bool) -> None:
    """One rank: the groups, collectives and end of a trainer rank (see the docstring)."""
    import torch

    from megatron_gspo import dist
    from megatron_gspo.layout import Layout
    from megatron_gspo.megatron.model import init_megatron
    from megatron_gspo.run import teardown

    dist.init_distributed("cpu")
    init_megatron(Layout(ep=2), seed=0)
    from megatron.core import parallel_state as ps

    groups = [None, ps.get_data_parallel_group(), ps.get_expert_model_parallel_group()]
    groups.append(ps.get_data_parallel_group(with_context_parallel=True))
    works = []
    for step in range(3):
        for group in groups:
            t = torch.full((1024,), float(step))
            torch.distributed.all_reduce(t, group=group)
            works.append(torch.distributed.all_reduce(torch.ones(64), group=group, async_op=True))
    for w in works:
        w.wait()
    dist.barrier()
    if old:
        print(f"[rank {dist.rank()}] threads {len(dist.comm_threads())}", flush=True)
        torch.distributed.destroy_process_group()
        return
    left = teardown.release_process_groups()
    print(f"[rank {dist.rank()}] threads {len(left)}", flush=True)
    teardown.end_process(0)


def launch(old: bool, port: int, out: Path) -> list[int]:
    """Two ranks of `rank_main`, forked from this process (its imports are paid once); their
    exit codes (-6: SIGABRT, what a shell reports as 134). Their output goes to `out`."""
    pids = []
    for r in range(2):
        pid = os.fork()
        if pid == 0:  # the rank: its own interpreter exit ends it (SystemExit propagates)
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ |= {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
            os.environ |= {"MASTER_PORT": str(port), "RANK": str(r), "LOCAL_RANK": str(r)}
            rank_main(old)
            raise SystemExit(0)
        pids.append(pid)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--old", action="store_true", help="the exit path before issue 40")
    ap.add_argument("--log", type=Path, default=None, help="append each failed launch's output")
    args = ap.parse_args(argv)
    import tempfile

    import megatron.core.parallel_state  # noqa: F401 - imported once, before any fork
    import torch  # noqa: F401

    from megatron_gspo.dist import free_port
    from megatron_gspo.megatron import model  # noqa: F401

    codes: collections.Counter[int] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    terminated = failed = 0
    t0 = time.monotonic()
    for i in range(args.launches):
        with tempfile.NamedTemporaryFile("r", suffix=".log") as f:
            rcs = launch(args.old, free_port(), Path(f.name))
            out = f.read()
        codes.update(rcs)
        threads.update(line.split()[-1] for line in out.splitlines() if " threads " in line)
        bad = any(rcs) or "terminate called" in out
        terminated += "terminate called" in out
        failed += bad
        if bad and args.log is not None:
            with args.log.open("a") as f:
                f.write(f"--- launch {i}: exit codes {rcs}\n{out}\n")
        if (i + 1) % 20 == 0:
            print(f"  {i + 1} launches, {failed} failed, {time.monotonic() - t0:.0f} s", flush=True)
    mode = "old (destroy_process_group, interpreter exit)" if args.old else "end_process"
    print("| exit path | launches | rank exit codes | 'terminate called' | failed launches "
          "| backend threads left per rank |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {mode} | {args.launches} | {dict(sorted(codes.items()))} | {terminated} | {failed} "
        f"| {dict(sorted(threads.items()))} |"
    )


if __name__ == "__main__":
    main()
