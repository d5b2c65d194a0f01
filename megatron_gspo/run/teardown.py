"""How a trainer rank ends: its process groups and their threads first, then the interpreter.

A run that wrote its last checkpoint sometimes exited 134 (`terminate called without an active
exception`, about once in 40 launches on a loaded 2-core machine; issue 40). What was still
alive at interpreter exit (measured on every rank of the tiny example, /proc/self/task):
24 gloo process groups' threads (`gloo_tcp_loop`, 2 x `pt_gloo_runloop` each) after
`torch.distributed.destroy_process_group()`, which shuts groups down but frees none that a
reference still holds: megatron-core's parallel-state globals (its `destroy_model_parallel`
misses two of them, `megatron/model.py: release_parallel_state`) and, once megatron-core is
imported after `init_process_group` (as the trainer does), the default group itself, held from
C++ (12 references, none from a Python object; a plain `torch` process frees it). A gloo worker
that drops the last reference to a tensor while the interpreter finalizes must take the GIL;
Python ends such a thread with `pthread_exit`, whose unwinding through a C++ destructor (which
may not throw) calls `std::terminate`: the abort, after every file was written.

So `end_process` ends in order: every group destroyed, megatron-core's references dropped, a
garbage collection; then, if gloo threads are still alive (the default group's), the streams are
flushed and the process ends with `os._exit`, skipping an interpreter finalization those
threads could abort. Everything of the run (metrics, logs, checkpoints, engines, workers) is
closed by `train.main` before this is called.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from typing import NoReturn

from megatron_gspo import dist

__all__ = ["end_process", "release_process_groups"]


def release_process_groups() -> list[str]:
    """Destroy every process group, drop megatron-core's references to them (if it was
    imported) and collect; returns the names of the backend threads still alive."""
    dist.shutdown()
    if "megatron.core.parallel_state" in sys.modules:
        from megatron_gspo.megatron.model import release_parallel_state

        release_parallel_state()
    gc.collect()
    return dist.comm_threads()


def end_process(code: int) -> NoReturn:
    """End this rank with exit code `code` once its process groups are released (see the
    module docstring); never returns."""
    left = release_process_groups()
    if not left:
        raise SystemExit(code)
    logging.shutdown()  # what the interpreter's own exit would have flushed
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed or lost console: nothing left to flush
            pass
    os._exit(code)
