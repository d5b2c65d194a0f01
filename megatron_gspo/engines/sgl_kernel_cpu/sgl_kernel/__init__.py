"""Test-only stand-in for `sgl_kernel`, so the unmodified SGLang server runs on a CPU.

Why: with `SGLANG_USE_CPU_ENGINE=1` SGLang imports `sgl_kernel`, whose PyPI wheel is CUDA-only
(no registry serves a CPU build). Without AMX, SGLang computes every layer on its torch-native
path and needs from the kernel library only two ops, called at start-up on AMX/arm64 machines
(`sglang/srt/distributed/bootstrap.py`). We register those two, with the upstream schemas.
Any other name SGLang imports from this module gets a placeholder that records its use and
raises, so a new SGLang version that needs real kernel code fails loudly, never silently.

`convert_weight_packed` is deliberately absent: SGLang detects its AMX backend by that op, and
without it `cpu_has_amx_support()` stays False, so no layer asks for a kernel we do not have.

Put on PYTHONPATH (first) only when launching SGLang on CPU (`engines/launch.py` does).
Written for sglang 0.5.23 (`megatron_gspo.engines.sgl_kernel_cpu.STUB_FOR_SGLANG`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

_LOG_ENV = "MGSPO_SGL_KERNEL_STUB_LOG"


def _record(event: str) -> None:
    # A file, not a logger: the callers are SGLang's scheduler subprocesses.
    path = os.environ.get(_LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {event}\n")


_lib = torch.library.Library("sgl_kernel", "DEF")
_lib.define("init_cpu_threads_env(str cpu_ids) -> str")
_lib.define("initialize(int size, int rank) -> ()")


def _init_cpu_threads_env(cpu_ids: str) -> str:
    # The real op pins one OpenMP thread per listed core; sizing torch's pool is what matters
    # for the torch-native path ("0-3,8" style lists).
    n = 0
    for part in cpu_ids.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi) - int(lo) + 1 if hi else 1
    torch.set_num_threads(max(1, n))
    _record(f"op init_cpu_threads_env {cpu_ids}")
    return f"sgl_kernel stand-in: {n} threads"


def _initialize(size: int, rank: int) -> None:
    # The real op sets up shared-memory all-reduce; with the stand-in SGLang does not use it
    # (is_shm_available needs AMX or arm64, and tensor parallelism on CPU is untested here).
    _record(f"op initialize {size} {rank}")


# Ops without tensor arguments: CompositeExplicitAutograd serves every dispatch key, as the
# upstream CatchAll registration does.
_lib.impl("init_cpu_threads_env", _init_cpu_threads_env, "CompositeExplicitAutograd")
_lib.impl("initialize", _initialize, "CompositeExplicitAutograd")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)  # keep importlib/inspect probes honest

    def placeholder(*args: Any, **kwargs: Any) -> Any:
        _record(f"called {name}")
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but the CPU test stand-in "
            "(megatron_gspo/engines/sgl_kernel_cpu) has no kernels: this SGLang version needs "
            "real kernel code on this path"
        )

    placeholder.__name__ = placeholder.__qualname__ = name
    _record(f"imported {name}")
    return placeholder
