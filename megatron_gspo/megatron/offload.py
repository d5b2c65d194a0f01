"""Colocated memory: the trainer's parameters, gradients and optimizer state leave the
accelerator while the engines generate on the same GPUs, and come back before the update.

    mem = TrainerOffload.from_policy(policy)
    mem.offload()   # before the engines generate: trainer memory back to the driver
    mem.reload()    # before the update: the same tensors, the same values

The mechanism is megatron-core's own, storage level: gradients go through
`DistributedDataParallel.offload_grad_buffers` / `restore_grad_buffers` (their storage is
resized to 0 bytes and back, zeroed: every step starts with `zero_grad_buffer` anyway).
Parameters and optimizer state get the same treatment as `_ParamAndGradBuffer.offload_to_cpu`
gives parameter buffers, applied to every storage they use: the bytes are copied to a host
buffer (pinned on CUDA), the storage is resized to 0 (its memory returns to the allocator, then
`empty_cache` hands it to the driver, i.e. to SGLang), and on reload the storage is resized back
and refilled. Every tensor object, view and alias keeps pointing at the same storage, so
megatron's param/grad buffer views, the distributed optimizer's shards (views of the param
buffer with fp32 parameters) and step tensors shared across parameters stay what they were.

Why not `MegatronOptimizer.offload_to_cpu` (megatron-core 0.19.2): it rebinds `p.data` of the
optimizer's parameters. With fp32 parameters those are the model's parameters (or views of its
param buffer); after the rebind they no longer alias the buffer, so updates miss the model and
the distributed optimizer all-gathers stale data. It also splits step tensors shared across
parameters into copies, and it only acts on CUDA tensors, so no CPU test could exercise it.

Storages are moved only when they live on the trainer's device (`home`), so on GPU the CPU step
counters stay put; on a CPU run home is the CPU and the round trip is real (memory freed,
refilled from the copy), which is how the CPU tests prove it changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

    from megatron_gspo.megatron.policy import Policy

__all__ = ["TrainerOffload", "offload_trainer", "reload_trainer"]


def _tensors(obj: object) -> Iterator[torch.Tensor]:
    """Every tensor inside optimizer state values (tensors, lists, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def _torch_optimizers(optimizer: MegatronOptimizer) -> list[Any]:
    """The torch optimizers under a megatron-core optimizer (chained or not) or a plain one."""
    if optimizer is None:
        return []
    if hasattr(optimizer, "chained_optimizers"):
        return [o for c in optimizer.chained_optimizers for o in _torch_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return [inner]
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else []


def _key_of(storage: torch.UntypedStorage) -> int:
    # The StorageImpl's address: shared by every tensor and view of one storage, and stable
    # across resize_ (a CUDA storage's data pointer changes when it is reallocated).
    return storage._cdata


def _key(t: torch.Tensor) -> int:
    return _key_of(t.untyped_storage())


@dataclass
class _Moved:
    """One storage and its host copy (kept across steps: pinned allocations are slow)."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None

    def _view(self) -> torch.Tensor:
        # A flat uint8 tensor over the whole storage, whatever dtypes its tensors have.
        return torch.empty(0, dtype=torch.uint8, device=self.storage.device).set_(
            self.storage, 0, (self.nbytes,), (1,)
        )

    def save_and_free(self, pin: bool) -> None:
        if self.host is None:
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host.copy_(self._view(), non_blocking=pin)

    def free(self) -> None:
        self.storage.resize_(0)

    def restore(self, pin: bool) -> None:
        self.storage.resize_(self.nbytes)
        assert self.host is not None
        self._view().copy_(self.host, non_blocking=pin)


@dataclass
class TrainerOffload:
    """Offload/reload of one rank's model chunks (megatron-core DDP) and optimizer.

    params / grads / optimizer_state choose what leaves the device; `home` is the device whose
    storages move (default: where the first parameter lives).
    """

    model: Sequence[torch.nn.Module]
    optimizer: MegatronOptimizer
    params: bool = True
    grads: bool = True
    optimizer_state: bool = True
    home: torch.device | None = None
    offloaded: bool = False
    _moved: list[_Moved] = field(default_factory=list)
    _by_key: dict[int, _Moved] = field(default_factory=dict)
    _hosts: dict[int, torch.Tensor] = field(default_factory=dict)
    _bytes: dict[str, int] = field(default_factory=dict)
    _before: int = 0
    _metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.home is None:
            first = next((p for c in self.model for p in c.parameters()), None)
            self.home = first.device if first is not None else torch.device("cpu")

    @classmethod
    def from_policy(cls, policy: Policy, **kw: Any) -> TrainerOffload:
        return cls(policy.model, policy.optimizer, **kw)

    # -- what moves ----------------------------------------------------------------------
    def _ddp_chunks(self) -> list[Any]:
        return [c for c in self.model if hasattr(c, "offload_grad_buffers")]

    def _grad_buffer_keys(self) -> set[int]:
        keys = set()
        for chunk in self._ddp_chunks():
            for buf in chunk.buffers + chunk.expert_parallel_buffers:
                if buf.grad_data is not None and buf.grad_data.untyped_storage().nbytes():
                    keys.add(_key(buf.grad_data))
        return keys

    def _candidates(self) -> Iterable[tuple[str, torch.Tensor]]:
        if self.params:
            for chunk in self.model:
                for p in chunk.parameters():
                    yield "params", p
        if self.optimizer_state:
            for opt in _torch_optimizers(self.optimizer):
                for group in opt.param_groups:  # main (fp32) params and their grads
                    for p in group["params"]:
                        yield "optimizer", p
                        if p.grad is not None:
                            yield "optimizer", p.grad
                for state in opt.state.values():
                    for t in _tensors(state):
                        yield "optimizer", t
        if self.grads and not self._ddp_chunks():
            # Plain modules (no megatron DDP buffers): their .grad tensors move like the rest.
            for chunk in self.model:
                for p in chunk.parameters():
                    if p.grad is not None:
                        yield "grads", p.grad

    def _collect(self) -> None:
        """Storages on `home` that hold parameters / optimizer state, each once (a storage
        shared by several tensors, e.g. a param buffer and its views, moves once)."""
        skip = self._grad_buffer_keys() if self.grads else set()
        self._bytes = {"params": 0, "optimizer": 0, "grads": 0, "kept": 0}
        for kind, t in self._candidates():
            if t.device != self.home:
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            key = _key(t)
            if not nbytes or key in skip or key in self._by_key:
                continue
            if not storage.resizable():
                # e.g. CPU storages moved to shared memory by a tensor-transport push (torch
                # multiprocessing's file_system strategy): they stay, counted as kept.
                self._by_key[key] = _Moved(storage, 0)
                self._bytes["kept"] += nbytes
                continue
            m = self._by_key[key] = _Moved(storage, nbytes)
            host = self._hosts.get(key)
            m.host = host if host is not None and host.numel() == nbytes else None
            self._moved.append(m)
            self._bytes[kind] += nbytes

    # -- the pair --------------------------------------------------------------------------
    @property
    def _cuda(self) -> bool:
        return self.home is not None and self.home.type == "cuda"

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.home) if self._cuda else 0

    def offload(self) -> dict[str, float]:
        """Free this rank's trainer memory on `home`; returns what moved (metrics)."""
        if self.offloaded:
            raise RuntimeError("TrainerOffload.offload: already offloaded (call reload first)")
        t0 = time.perf_counter()
        self._before = self._allocated()
        self._moved, self._by_key = [], {}
        self._collect()
        pin = self._cuda
        grad_bytes = 0
        for m in self._moved:
            m.save_and_free(pin)
            assert m.host is not None
            self._hosts[_key_of(m.storage)] = m.host
        if self._cuda:
            torch.cuda.synchronize(self.home)  # the host copies are complete before the frees
        for m in self._moved:
            m.free()
        if self.grads:
            for chunk in self._ddp_chunks():
                for buf in chunk.buffers + chunk.expert_parallel_buffers:
                    if buf.grad_data is not None:
                        grad_bytes += buf.grad_data.untyped_storage().nbytes()
                chunk.offload_grad_buffers(synchronize=self._cuda, empty_cache=False)
        self._bytes["grads"] += grad_bytes
        if self._cuda:
            torch.cuda.empty_cache()  # cached blocks go back to the driver (to the engine)
        self.offloaded = True
        gb = 1024**3
        self._metrics = {
            "memory/offload_params_gb": self._bytes["params"] / gb,
            "memory/offload_optimizer_gb": self._bytes["optimizer"] / gb,
            "memory/offload_grads_gb": self._bytes["grads"] / gb,
            "memory/offload_kept_gb": self._bytes["kept"] / gb,
            "memory/trainer_allocated_gb_before_offload": self._before / gb,
            "memory/trainer_allocated_gb_offloaded": self._allocated() / gb,
            "time/offload_s": time.perf_counter() - t0,
        }
        return dict(self._metrics)

    def reload(self) -> dict[str, float]:
        """Bring everything back (same storages, same values; gradients zeroed). Returns the
        offload's metrics plus the reload time, so one call site can log both."""
        if not self.offloaded:
            raise RuntimeError("TrainerOffload.reload: nothing is offloaded")
        t0 = time.perf_counter()
        pin = self._cuda
        for m in self._moved:
            m.restore(pin)
        if self.grads:
            for chunk in self._ddp_chunks():
                chunk.restore_grad_buffers(synchronize=False)
        if self._cuda:
            torch.cuda.synchronize(self.home)  # copies land before the update reads them
        self.offloaded = False
        return self._metrics | {"time/reload_s": time.perf_counter() - t0}

    @property
    def moved_bytes(self) -> dict[str, int]:
        """Bytes per kind moved by the last offload (params, optimizer, grads) and kept on the
        device because their storage cannot be resized (kept)."""
        return dict(self._bytes)


# -- the two calls of the training loop ----------------------------------------------------
# One per policy of this process (the job has one); the policy is kept so its id stays its own.
_ACTIVE: dict[int, tuple[Any, TrainerOffload]] = {}


def _enabled(policy: Policy) -> bool:
    return bool(policy.spec.offload_trainer)


def offload_trainer(policy: Policy) -> dict[str, float]:
    """Before the engines generate: colocated runs (rollout.launch.colocated and
    rollout.launch.offload_trainer: `PolicySpec.offload_trainer`) move this rank's trainer
    state off its device; else no-op."""
    if not _enabled(policy):
        return {}
    if id(policy) not in _ACTIVE:
        _ACTIVE[id(policy)] = (policy, TrainerOffload.from_policy(policy))
    return _ACTIVE[id(policy)][1].offload()


def reload_trainer(policy: Policy) -> dict[str, float]:
    """Before the update: undo `offload_trainer` (no-op when it did nothing); returns the
    offload's metrics (bytes moved, allocated memory before/while offloaded, times)."""
    entry = _ACTIVE.get(id(policy))
    if not _enabled(policy) or entry is None or not entry[1].offloaded:
        return {}
    return entry[1].reload()
