"""Every random number generator a training step draws from, for checkpoints.

An exact resume needs all of them back where they were:

* `torch_rng` / `py_rng`: torch's CPU generator and Python's `random`;
* `cuda_rng`: this rank's CUDA generator (`torch.cuda.get_rng_state()` of its device); dropout
  outside tensor-parallel regions draws from it. Only when CUDA is initialised;
* `rng_tracker`: megatron-core's tensor-parallel RNG tracker
  (`tensor_parallel.random.get_cuda_rng_tracker().get_states()`: one generator state per name,
  e.g. "model-parallel-rng", which dropout inside TP regions and expert init fork to). On
  CPU the tracker's states are CPU generator states (patches/cpu_runtime.py) and round-trip
  the same way.

A checkpoint written before issue 20 has only the first two; the others are then left as
they are (with a line on stderr, so a non-exact resume on GPU is visible).
"""

from __future__ import annotations

import random
import sys
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

__all__ = ["rng_state", "set_rng_state"]


def _tracker() -> CudaRNGStatesTracker | None:
    """megatron-core's tracker when it holds states (None before `init_megatron`)."""
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:  # the tools without megatron-core
        return None
    tracker = mrandom.get_cuda_rng_tracker()
    return tracker if tracker.get_states() else None


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def rng_state() -> dict[str, Any]:
    """This rank's generator states (see the module docstring); `torch.save`-able with
    `weights_only=True` loading."""
    state: dict[str, Any] = {"torch_rng": torch.get_rng_state(), "py_rng": random.getstate()}
    if _cuda_ready():
        state["cuda_rng"] = torch.cuda.get_rng_state()
    if (tracker := _tracker()) is not None:
        state["rng_tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what `rng_state` returned (on the same rank of the same layout)."""
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["py_rng"])
    missing = []
    if "cuda_rng" in state and _cuda_ready():
        torch.cuda.set_rng_state(state["cuda_rng"])
    elif _cuda_ready():
        missing.append("cuda_rng")
    tracker = _tracker()
    if "rng_tracker" in state and tracker is not None:
        tracker.set_states({k: v.clone() for k, v in state["rng_tracker"].items()})
    elif tracker is not None:
        missing.append("rng_tracker")
    if missing:
        print(
            f"[checkpoint] no {' / '.join(missing)} in this checkpoint (written before they were "
            "saved): those generators continue from their fresh seeds, so the resume is not "
            "bit-exact",
            file=sys.stderr,
            flush=True,
        )
