"""Run megatron-core 0.19 on a machine with no GPU (torch CPU + gloo).

megatron-core assumes CUDA in many places. These fixes let its real code paths (TP/SP mappings,
MoE dispatchers, pipeline schedules, DDP grad buffers, the distributed optimizer) run on CPU so
that the test suite and the CPU demo exercise the same code a GPU run does. They are applied only
by `apply_cpu_runtime()`, and only when `torch.cuda.is_available()` is False.

The `torch.cuda` facade and the device-rewriting torch function mode are process-global (the mode
is thread-local: it is entered on the calling thread). Keep them to CPU processes.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import sys
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_gspo.patches.base import Patch, PatchError

if TYPE_CHECKING:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

MCORE_VERSIONS = ("0.19.2",)

_state: dict[str, Any] = {"mode": None}


def cpu_runtime_active() -> bool:
    """True once `apply_cpu_runtime()` has installed the fixes in this process."""
    return _state["mode"] is not None


# --------------------------------------------------------------------------------------------
# 1. triton import in a GPU-only MoE op module
# --------------------------------------------------------------------------------------------
_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


def _check_paged_stash() -> None:
    spec = importlib.util.find_spec("megatron.core.transformer.moe.ops")
    if spec is None or spec.submodule_search_locations is None:
        raise PatchError(
            f"{_PAGED_STASH_OPS}: package moved; review patch mcore-paged-stash-triton"
        )


def _apply_paged_stash() -> None:
    if importlib.util.find_spec("triton") is not None or _PAGED_STASH_OPS in sys.modules:
        return  # triton importable (torch's CUDA wheels ship it): nothing to stub

    def _unavailable(*_a: object, **_k: object) -> None:
        raise RuntimeError("moe_paged_stash needs triton and a GPU")

    stub = types.ModuleType(_PAGED_STASH_OPS)
    stub.__getattr__ = lambda name: _unavailable  # type: ignore[method-assign]
    sys.modules[_PAGED_STASH_OPS] = stub


# --------------------------------------------------------------------------------------------
# 2. torch.cuda facade (streams, events, current_device, nvtx, RNG state)
# --------------------------------------------------------------------------------------------
class _DummyStream:
    def __init__(self, *_a: object, **_k: object) -> None:
        pass

    def wait_stream(self, *_a: object) -> None:
        pass

    def wait_event(self, *_a: object) -> None:
        pass

    def record_event(self, event: _DummyEvent | None = None) -> _DummyEvent:
        return event or _DummyEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _DummyEvent:
    def __init__(self, *_a: object, **_k: object) -> None:
        pass

    def record(self, *_a: object) -> None:
        pass

    def wait(self, *_a: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, _other: object) -> float:
        return 0.0


_CUDA_FACADE: dict[str, Any] = {
    "current_device": lambda: torch.device("cpu"),
    "set_device": lambda *_a, **_k: None,
    "synchronize": lambda *_a, **_k: None,
    "Stream": _DummyStream,
    "Event": _DummyEvent,
    "stream": lambda *_a, **_k: contextlib.nullcontext(),
    "current_stream": lambda *_a, **_k: _DummyStream(),
    "default_stream": lambda *_a, **_k: _DummyStream(),
    "is_current_stream_capturing": lambda: False,
    "empty_cache": lambda: None,
    "get_rng_state": lambda *_a, **_k: torch.get_rng_state(),
    "set_rng_state": lambda state, *_a, **_k: torch.set_rng_state(state),
    "memory_allocated": lambda *_a, **_k: 0,
    "max_memory_allocated": lambda *_a, **_k: 0,
    "reset_peak_memory_stats": lambda *_a, **_k: None,
}
_NVTX = {
    "range_push": lambda *_a, **_k: None,
    "range_pop": lambda *_a, **_k: None,
    "range": lambda *_a, **_k: contextlib.nullcontext(),
    "mark": lambda *_a, **_k: None,
}


def _check_cuda_facade() -> None:
    missing = [n for n in (*_CUDA_FACADE, "nvtx") if not hasattr(torch.cuda, n)]
    if missing:
        raise PatchError(f"torch.cuda lost {missing}; review patch torch-cuda-facade")


def _apply_cuda_facade() -> None:
    for name, fn in _CUDA_FACADE.items():
        setattr(torch.cuda, name, fn)
    for name, fn in _NVTX.items():
        setattr(torch.cuda.nvtx, name, fn)
    torch.Tensor.record_stream = lambda self, *_a, **_k: None  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------
# 3. tensor-parallel RNG tracker on the CPU generator
# --------------------------------------------------------------------------------------------
def _tracker_add(self: CudaRNGStatesTracker, name: str, seed: int) -> None:
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


@contextlib.contextmanager
def _tracker_fork(self: CudaRNGStatesTracker, name: str = "model-parallel-rng"):  # type: ignore[no-untyped-def]
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    outer = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)


def _check_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    for attr in ("CudaRNGStatesTracker", "_get_cuda_rng_state", "_set_cuda_rng_state"):
        if not hasattr(mrandom, attr):
            raise PatchError(f"megatron.core.tensor_parallel.random.{attr} is gone")
    params = inspect.signature(mrandom.CudaRNGStatesTracker.add).parameters
    if list(params) != ["self", "name", "seed"]:
        raise PatchError(f"CudaRNGStatesTracker.add signature changed: {list(params)}")
    src = inspect.getsource(mrandom.CudaRNGStatesTracker.__init__)
    if "self.reset()" not in src or "states_" not in inspect.getsource(
        mrandom.CudaRNGStatesTracker.reset
    ):
        raise PatchError("CudaRNGStatesTracker no longer keeps its states in states_")


def _apply_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.add = _tracker_add
    mrandom.CudaRNGStatesTracker.fork = _tracker_fork
    mrandom._get_cuda_rng_state = lambda *_a, **_k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *_a, **_k: torch.set_rng_state(state)


# --------------------------------------------------------------------------------------------
# 4. device="cuda", .cuda(), pin_memory and Tensor.type() strings, through a torch function mode
# --------------------------------------------------------------------------------------------
def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


# The Tensor methods `CudaToCpuMode` rewrites whatever their keyword arguments.
_REWRITTEN = frozenset(
    (torch.Tensor.cuda, torch.Tensor.to, torch.Tensor.type, torch.Tensor.pin_memory)
)


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU for every torch call made on this thread."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # Fast path first: every torch call of the job comes through here (about 18k per
        # training step of the tiny MoE), and nearly none names a device or pinned memory.
        if func not in _REWRITTEN and (
            not kwargs or ("device" not in kwargs and "pin_memory" not in kwargs)
        ):
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(torch.device("cpu") if _is_cuda(a) else a for a in args)
        elif func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizer asserts `grad.type() == 'torch.cuda.FloatTensor'`.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        elif func is torch.Tensor.pin_memory:
            return args[0]
        return func(*args, **kwargs)


def without_cuda_mode[T](it: Iterator[T]) -> Iterator[T]:
    """`it`, each item produced with `CudaToCpuMode` off on this thread (the caller's code
    between items keeps it). The mode costs ~10 us per torch call, dozens per exported HF
    tensor; code that never names a CUDA device can skip it. Unchanged when the mode is off."""
    mode = _state["mode"]
    if mode is None:
        yield from it
        return
    while True:
        # Only when it is the innermost mode (another thread, or a mode pushed on top: keep).
        top = torch.overrides._get_current_function_mode() is mode
        with torch.overrides._pop_mode_temporarily() if top else contextlib.nullcontext():
            try:
                item = next(it)
            except StopIteration:
                return
        yield item


def _check_mode() -> None:
    with CudaToCpuMode():
        t = torch.ones(2, device="cuda")
        if t.device.type != "cpu" or t.cuda() is not t or t.type() != "torch.cuda.FloatTensor":
            raise PatchError("CudaToCpuMode no longer rewrites CUDA placements")


def _apply_mode() -> None:
    mode = CudaToCpuMode()
    mode.__enter__()  # stays pushed for the life of the process (on this thread)
    _state["mode"] = mode


# --------------------------------------------------------------------------------------------
# 5. sequence parallelism with the local-spec (torch) norms
# --------------------------------------------------------------------------------------------
def _check_torch_norm() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if "sequence parallel not supported" not in inspect.getsource(WrappedTorchNorm.__new__):
        raise PatchError("WrappedTorchNorm changed its sequence-parallel check; review the patch")


def _apply_torch_norm() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__
    if getattr(original, "_mgspo", False):
        return

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        shallow = copy.copy(config)
        object.__setattr__(shallow, "sequence_parallel", False)
        norm = original(cls, shallow, hidden_size, eps, *args, **kwargs)
        # What TE norms do: tagged params get their grads all-reduced over the TP group by
        # finalize_model_grads (the norm sees a different sequence shard, or different heads
        # for qk-norm, on every TP rank).
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    __new__._mgspo = True  # type: ignore[attr-defined]
    WrappedTorchNorm.__new__ = staticmethod(__new__)  # type: ignore[assignment]


# --------------------------------------------------------------------------------------------
# 6. MoE alltoall split sizes as numpy on CPU
# --------------------------------------------------------------------------------------------
def _check_move_to_cpu() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    src = inspect.getsource(moe_utils.maybe_move_tensor_to_cpu)
    if "tensor.is_cuda" not in src or not hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        raise PatchError("maybe_move_tensor_to_cpu changed; review patch mcore-alltoall-splits")


def _maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        if as_numpy:
            # gloo's all_to_all_single wants python/numpy split sizes, not tensors.
            return tensor.numpy()
    return tensor


def _apply_move_to_cpu() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu


_COMMON: dict[str, Any] = dict(package="megatron-core", versions=MCORE_VERSIONS)
CPU_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="mcore-paged-stash-triton",
        why="`import megatron.core` -> ModuleNotFoundError: triton, from the unconditional "
        "`import triton` in transformer/moe/ops/paged_stash.py (reached via pipeline schedules). "
        "Stubbed only when triton is not importable; the op is used only with moe_paged_stash.",
        remove_when="megatron-core guards that import (or triton is always installed).",
        apply_fn=_apply_paged_stash,
        check_fn=_check_paged_stash,
        **_COMMON,
    ),
    Patch(
        name="torch-cuda-facade",
        why="torch.cuda.Stream()/Event()/current_device()/synchronize()/nvtx raise without CUDA "
        "(MoE alltoall dispatcher creates a Stream, rotary/router call current_device, ~300 "
        "synchronize/stream sites).",
        remove_when="megatron-core gains a device abstraction for CPU (not planned upstream).",
        apply_fn=_apply_cuda_facade,
        check_fn=_check_cuda_facade,
        **_COMMON,
    ),
    Patch(
        name="mcore-rng-tracker-cpu",
        why="model_parallel_cuda_manual_seed -> AssertionError 'Torch not compiled with CUDA' "
        "from torch.cuda.get_rng_state() in CudaRNGStatesTracker.add; fork() would queue CUDA "
        "state changes that never happen. The tracker now forks the CPU generator.",
        remove_when="megatron-core's tracker accepts a CPU generator.",
        apply_fn=_apply_rng_tracker,
        check_fn=_check_rng_tracker,
        **_COMMON,
    ),
    Patch(
        name="cuda-to-cpu-function-mode",
        why="~90 hard-coded device='cuda' / .cuda() sites (causal mask, schedules' token counts, "
        "clip_grads, grad buffers), pin_memory=True in CP RoPE slicing, and optimizer asserts "
        "on `.type() == 'torch.cuda.FloatTensor'`.",
        remove_when="megatron-core stops hard-coding CUDA placements.",
        apply_fn=_apply_mode,
        check_fn=_check_mode,
        **_COMMON,
    ),
    Patch(
        name="mcore-torch-norm-sequence-parallel",
        why="WrappedTorchNorm asserts 'sequence parallel not supported by torch LayerNorm', and "
        "MoELayer refuses TP>1 without SP in training: TP>1 MoE training is impossible with the "
        "local spec. Norms are built as usual and tagged sequence_parallel=True (what TE does).",
        remove_when="the local spec supports sequence parallelism (megatron-core > 0.19).",
        apply_fn=_apply_torch_norm,
        check_fn=_check_torch_norm,
        **_COMMON,
    ),
    Patch(
        name="mcore-alltoall-splits",
        why="EP alltoall: TypeError all_to_all_single(): incompatible function arguments: "
        "maybe_move_tensor_to_cpu converts split sizes to numpy only if tensor.is_cuda.",
        remove_when="moe_utils.maybe_move_tensor_to_cpu honours as_numpy for CPU tensors.",
        apply_fn=_apply_move_to_cpu,
        check_fn=_check_move_to_cpu,
        **_COMMON,
    ),
)


def apply_cpu_runtime(force: bool = False) -> bool:
    """Install every CPU fix (idempotent). Returns False (and does nothing) when a GPU is present,
    unless `force`. Raises `PatchError` when the installed megatron-core does not match."""
    if torch.cuda.is_available() and not force:
        return False
    # The paged-stash stub must be in place before megatron.core is first imported.
    CPU_PATCHES[0].apply()
    for patch in CPU_PATCHES[1:]:
        patch.apply()
    return True
