"""Run a function on N gloo ranks (spawned processes) and collect what each rank returns.

Ranks fork from a forkserver that imported torch and megatron once per test session; a launch
still costs seconds (process group, model build), so tests batch many checks into one launch:
the function receives its rank and world size, runs every layout it was asked to, and returns a
picklable result (tensors included). Exceptions on any rank fail the launch with that rank's
traceback.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from megatron_gspo.dist import free_port

# Ranks fork from one forkserver that imported torch and megatron once (testing/preload.py),
# instead of each spawned rank importing them again (~9 s per rank on 2 cores). The forkserver
# keeps the environment and working directory of the first launch, so each rank takes the
# launcher's current ones (what a spawned rank would see).
_PRELOAD = ["megatron_gspo.testing.preload"]


def _context() -> ForkServerContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def rank_context() -> ForkServerContext:
    """The multiprocessing context the ranks fork from (torch and megatron imported once per
    session), for tests that start their own processes and queues."""
    return _context()


def _worker(
    rank: int,
    world: int,
    port: int,
    out: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    cwd: str,
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pt"
    try:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
        # Gloo's init returns on a rank once its own side of the mesh is up, not the peers':
        # a rank whose `fn` ends at once would tear its sockets down while a slower peer still
        # connects ("connectFullMesh failed ... Connection closed by peer", seen under load).
        torch.distributed.barrier()
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def spawn_ranks(
    fn: Callable[..., Any], world_size: int, *args: object, timeout: float = 900.0
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return per-rank results.

    `fn` must be importable (a module-level function) because ranks are spawned.
    """
    ctx = _context()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    with tempfile.TemporaryDirectory(prefix="mgspo-ranks-") as out:
        procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, port, out, fn, args, env, cwd), daemon=False
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        for r in range(world_size):
            path = Path(out) / f"rank{r}.pt"
            if not path.exists():
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                continue
            payload = torch.load(path, weights_only=False)
            if payload["ok"]:
                results.append(payload["result"])
            else:
                errors.append(f"rank {r}:\n{payload['error']}")
        if hung:
            errors.insert(0, f"ranks {hung} timed out after {timeout:.0f} s")
        if errors:
            raise RuntimeError("multi-rank launch failed:\n" + "\n".join(errors))
        return results
