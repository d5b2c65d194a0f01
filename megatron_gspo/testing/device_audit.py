"""Catch a tensor on the wrong device on a CPU-only machine: a simulated accelerator.

On CPU every tensor is on the CPU, so a training step that forgets to move a micro-batch, or
hands a host tensor to an NCCL collective, passes every CPU test and fails on the first GPU
step. `DeviceAudit` makes the job's device a *different* device that still computes on the
CPU: `dist.device()` becomes `cuda:0` while megatron_gspo's CPU runtime (the `CudaToCpuMode`
patch) still places the data in host memory, and this audit remembers which storages were
placed "on the accelerator":

* placement: a factory call with `device=cuda`, `.cuda()`, `.to(cuda)` (or `.to(t)` of such a
  tensor) marks its result's storage; `.cpu()` / `.to("cpu")` gives an unmarked copy. Every
  other torch call's fresh outputs are marked when one of its tensor inputs is (outputs follow
  inputs, as on a GPU); views share their base's storage and so its mark. Marked tensors report
  `device == cuda:0` and `is_cuda`, so `torch.zeros(..., device=x.device)` follows `x`.
* the model "lives on the accelerator": `place_on_device` marks every parameter, buffer, tensor
  attribute, gradient buffer and optimizer state of the chunks, which is what megatron-core's
  GPU build does (`use_cpu_initialization=False`); that part is megatron-core's, not ours.

Then it records a violation, with the innermost project frame, wherever a GPU would fail:
1. a tensor handed to a torch.distributed tensor collective is not on the job's device (NCCL);
2. a tensor handed to the model (positional, keyword, or inside `PackedSeqParams`) is not
   where the parameters are;
3. one torch call mixes marked and unmarked tensors of one or more dimensions (0-dim host
   tensors are scalars to CUDA kernels and are allowed), or indexes a host tensor with a device
   index; `.numpy()` of a device tensor;
4. an object collective (`all_gather_object`, `broadcast_object_list`, ...) carries a device
   tensor: it would be unpickled onto the sender's GPU index on every receiver.

Not covered, on purpose: calls made by autograd's C++ engine during backward create gradients
on the devices of the forward's tensors by construction, and are invisible to a torch function
mode; collectives and mixes run inside a backward node are therefore not judged (the gradient
buffers megatron-core reduces after backward are, being marked model state).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from megatron_gspo import dist

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

SIMULATED = torch.device("cuda", 0)

_TENSOR_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)
_OBJECT_COLLECTIVES = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)
# Calls that legitimately take tensors on two devices (copies between them), or only report.
_MIXING_ALLOWED = {
    torch.Tensor.to,
    torch.Tensor.copy_,
    torch.Tensor.__setitem__,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.Tensor.data.__set__,  # type: ignore[attr-defined]
    torch.Tensor.grad.__set__,  # type: ignore[attr-defined,union-attr]
    torch.Tensor.set_,
}
_PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOT_A_CALL_SITE = {__file__, os.path.join(_PROJECT, "patches", "cpu_runtime.py")}


def _is_cuda(d: object) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)  # an int device is a CUDA index


def _where() -> str:
    """The innermost frame of the project (not this file, not the CPU runtime's torch function
    mode, which every torch call passes through), else the innermost one."""
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename not in _NOT_A_CALL_SITE]
    ours = [f for f in frames if f.filename.startswith(_PROJECT) or "/tests/" in f.filename]
    f = (ours or frames)[-1]
    return f"{os.path.relpath(f.filename, os.path.dirname(_PROJECT))}:{f.lineno} ({f.name})"


def _in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


class DeviceAudit(TorchFunctionMode):
    """Records device violations (see the module docstring); use `audit()` to enter it."""

    def __init__(self) -> None:
        super().__init__()
        self._marked: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.violations: list[str] = []
        self._seen: set[tuple[str, str]] = set()
        self._depth = 0  # inside an audited collective (torch's own nested calls)
        self.counts = {"collectives": 0, "model_calls": 0, "object_collectives": 0}
        self._handles: list[Any] = []

    # -- marks ---------------------------------------------------------------------------
    def mark(self, t: torch.Tensor) -> None:
        with torch._C.DisableTorchFunction():
            self._marked[t.untyped_storage()] = True

    def on_device(self, t: torch.Tensor) -> bool:
        with torch._C.DisableTorchFunction():
            return t.untyped_storage() in self._marked

    def place_on_device(
        self, model: list[torch.nn.Module], optimizer: MegatronOptimizer | None = None
    ) -> None:
        """Mark the model's state as living on the simulated device (megatron-core's GPU build
        puts it there; see the module docstring)."""
        for chunk in model:
            for m in chunk.modules():
                # Unbound calls: megatron-core's DDP shadows `buffers` with its grad buffers.
                own = [*nn.Module.parameters(m, recurse=False), *nn.Module.buffers(m, False)]
                for v in own:
                    self.mark(v)
                for v in vars(m).values():
                    for t in tree_leaves(v):
                        if isinstance(t, torch.Tensor):
                            self.mark(t)
            for p in chunk.parameters():
                g = getattr(p, "main_grad", None)
                if isinstance(g, torch.Tensor):
                    self.mark(g)
            grad_buffers = [
                b
                for name in ("buffers", "expert_parallel_buffers")
                if isinstance(getattr(chunk, name, None), list)
                for b in getattr(chunk, name)
            ]
            for buf in grad_buffers:
                for name in ("param_data", "grad_data"):
                    t = getattr(buf, name, None)
                    if isinstance(t, torch.Tensor):
                        self.mark(t)
        if optimizer is not None:
            for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
                inner = getattr(opt, "optimizer", None)
                for state in getattr(inner, "state", {}).values():
                    for t in tree_leaves(state):
                        if isinstance(t, torch.Tensor) and t.dim() > 0:
                            self.mark(t)

    def watch(
        self, model: list[torch.nn.Module], optimizer: MegatronOptimizer | None = None
    ) -> None:
        """`place_on_device`, then check the inputs of every forward call of these chunks."""
        self.place_on_device(model, optimizer)
        for chunk in model:
            self._handles.append(
                chunk.register_forward_pre_hook(self.check_model_inputs, with_kwargs=True)
            )

    def violation(self, what: str, example: str = "") -> None:
        """Record `what` once per source location (`example`: the first instance's shapes)."""
        where = _where()
        if (what, where) not in self._seen:
            self._seen.add((what, where))
            self.violations.append(f"{what} {example} at {where}")

    # -- checks --------------------------------------------------------------------------
    def check_collective(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _in_backward():
            return  # see the module docstring
        self.counts["collectives"] += 1
        leaves = tree_leaves((args, kwargs))
        leaves += [getattr(op, "tensor", None) for op in leaves if isinstance(op, tdist.P2POp)]
        for t in leaves:
            if isinstance(t, torch.Tensor) and not self.on_device(t):
                self.violation(
                    f"torch.distributed.{name} got a host tensor",
                    f"{tuple(t.shape)} {t.dtype} (job device {dist.device()})",
                )

    def check_object_payload(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self.counts["object_collectives"] += 1
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and self.on_device(t):
                self.violation(f"torch.distributed.{name} pickles a device tensor", str(t.shape))

    def check_model_inputs(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self.counts["model_calls"] += 1
        params = [p for p in module.parameters()][:1]
        want = self.on_device(params[0]) if params else True
        leaves = tree_leaves((args, kwargs))
        for v in list(leaves):
            if dataclasses.is_dataclass(v) and not isinstance(v, type):  # PackedSeqParams
                leaves += [getattr(v, f.name) for f in dataclasses.fields(v)]
        for t in leaves:
            if isinstance(t, torch.Tensor) and self.on_device(t) != want:
                self.violation(
                    f"model input on {'the device' if self.on_device(t) else 'the host'}, "
                    f"parameters on {'the device' if want else 'the host'}:",
                    f"{tuple(t.shape)} {t.dtype}",
                )

    # -- the mode ------------------------------------------------------------------------
    def __torch_function__(  # type: ignore[override]
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _DEVICE_GETTERS:
            t = args[0]
            return _DEVICE_GETTERS[func] if self.on_device(t) else func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        target = self._target(func, args, kwargs, tensors)
        if not _in_backward():
            self._check_mixing(func, args, tensors)
        if func is torch.Tensor.numpy and self.on_device(args[0]):
            self.violation("numpy() of a device tensor")
        out = func(*args, **kwargs)
        if func in _MOVES and isinstance(out, torch.Tensor) and target is not None:
            src = args[0]
            with torch._C.DisableTorchFunction():
                same = out.untyped_storage() is src.untyped_storage()
            if same and self.on_device(src) != target:
                with torch._C.DisableTorchFunction():
                    out = out.clone()  # a real move makes a new tensor; the source stays put
        if target:
            inputs = {id(t) for t in tensors}
            for o in tree_leaves(out):
                if isinstance(o, torch.Tensor) and id(o) not in inputs:
                    self.mark(o)
        return out

    def _target(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[torch.Tensor],
    ) -> bool | None:
        """Whether the call's fresh outputs are on the device (None: no tensor output rule)."""
        if kwargs.get("device") is not None:
            return _is_cuda(kwargs["device"])
        if func is torch.Tensor.cuda:
            return True
        if func is torch.Tensor.cpu:
            return False
        if func is torch.Tensor.to:
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    return self.on_device(a)
                if isinstance(a, torch.device | str | int) and not isinstance(a, bool):
                    return _is_cuda(a)
            other = kwargs.get("other")
            if isinstance(other, torch.Tensor):
                return self.on_device(other)
            return self.on_device(args[0])
        return any(self.on_device(t) for t in tensors)

    def _check_mixing(
        self, func: Callable[..., Any], args: tuple[Any, ...], tensors: list[torch.Tensor]
    ) -> None:
        if func in _MIXING_ALLOWED or len(tensors) < 2:
            return
        name = getattr(func, "__name__", str(func))
        if func is torch.Tensor.__getitem__:
            # CUDA tensors accept host indices; a host tensor does not accept device indices.
            if not self.on_device(args[0]) and any(self.on_device(t) for t in tensors[1:]):
                self.violation("a host tensor indexed with a device index")
            return
        places = {self.on_device(t) for t in tensors if t.dim() > 0}
        if len(places) > 1:
            shapes = [(tuple(t.shape), "device" if self.on_device(t) else "host") for t in tensors]
            self.violation(f"{name} mixes device and host tensors", str(shapes))


# What a tensor on the simulated device reports.
_DEVICE_GETTERS: dict[Any, Any] = {
    torch.Tensor.device.__get__: SIMULATED,  # type: ignore[attr-defined]
    torch.Tensor.is_cuda.__get__: True,  # type: ignore[attr-defined]
    torch.Tensor.get_device: 0,
}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}


def _wrap(audit: DeviceAudit, name: str, fn: Callable[..., Any], obj: bool) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # torch's collectives re-enter through their (patched) module name when a torch
        # function mode is active: judge the outermost call only.
        if audit._depth == 0:
            if obj:
                audit.check_object_payload(name, args, kwargs)
            else:
                audit.check_collective(name, args, kwargs)
        audit._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            audit._depth -= 1

    wrapper._mgspo_audited = fn  # type: ignore[attr-defined]
    return wrapper


@contextlib.contextmanager
def audit() -> Iterator[DeviceAudit]:
    """Simulate an accelerator as the job's device and audit every torch call of this thread
    and every torch.distributed collective (also under megatron-core's module-level aliases);
    `auditor.watch(model, optimizer)` puts a model on the simulated device and checks its
    inputs. Everything is restored on exit."""
    if not dist.on_cpu():
        raise RuntimeError("the device audit simulates an accelerator on a CPU job")
    auditor = DeviceAudit()
    saved: list[tuple[Any, str, Any]] = []
    wrapped: dict[int, Callable[..., Any]] = {}
    for name in (*_TENSOR_COLLECTIVES, *_OBJECT_COLLECTIVES):
        fn = getattr(tdist, name)
        wrapped[id(fn)] = _wrap(auditor, name, fn, name in _OBJECT_COLLECTIVES)
    # `torch.distributed.X`, torch's internal calls and module-level aliases
    # (megatron-core's `dist_all_gather_func = torch.distributed.all_gather_into_tensor`).
    modules = [tdist, tdist.distributed_c10d] + [
        m for n, m in list(sys.modules.items()) if n.startswith(("megatron", "tests")) and m
    ]
    for mod in modules:
        for attr, value in list(vars(mod).items()):
            if callable(value) and id(value) in wrapped:
                saved.append((mod, attr, value))
                setattr(mod, attr, wrapped[id(value)])
    old_device, old_current = dist.device(), torch.cuda.current_device
    dist.set_device(SIMULATED)  # torch.cuda.set_device is a no-op under the CPU runtime
    # megatron-core places its own buffers with `device=torch.cuda.current_device()`.
    torch.cuda.current_device = lambda: SIMULATED  # type: ignore[assignment,return-value]
    try:
        with auditor:
            yield auditor
    finally:
        for h in auditor._handles:
            h.remove()
        torch.cuda.current_device = old_current  # type: ignore[method-assign]
        dist.set_device(old_device)
        for mod, attr, value in saved:
            setattr(mod, attr, value)
