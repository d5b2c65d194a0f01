"""Process-group set-up and rank helpers: the one place that decides the device.

Every module that needs a free port, the rank, a broadcast or the job's device asks here, so the
CPU (gloo) and GPU (NCCL) paths differ in exactly one function (`init_distributed`).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Literal

import torch

DeviceChoice = Literal["auto", "cpu", "cuda"]

_DEVICE: torch.device | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def resolve_device(choice: DeviceChoice = "auto") -> torch.device:
    """`train.device` -> a torch device: auto is cuda when available, else cpu."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "train.device=cuda but torch sees no CUDA device; set train.device=cpu or auto"
        )
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def set_device(device: torch.device) -> None:
    """Record the job's device (init_distributed does it; tests that spawn ranks may too)."""
    global _DEVICE
    _DEVICE = device
    if device.type == "cuda":
        torch.cuda.set_device(device)


def device() -> torch.device:
    """The job's device (cpu until `init_distributed`/`set_device` said otherwise)."""
    return _DEVICE if _DEVICE is not None else torch.device("cpu")


def on_cpu() -> bool:
    return device().type == "cpu"


def init_distributed(choice: DeviceChoice = "auto", *, timeout_s: float | None = None) -> None:
    """Join torchrun's env:// rendezvous (or become a 1-rank job under plain `python`).

    gloo on CPU, NCCL on GPU. `timeout_s` bounds every collective (None: torch's default).
    """
    set_device(resolve_device(choice))
    if torch.distributed.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()),
        )
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    torch.distributed.init_process_group("nccl" if device().type == "cuda" else "gloo", **kwargs)


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def broadcast(obj: Any, src: int = 0) -> Any:
    """`obj` from rank `src` on every rank (pickled; for small control data)."""
    if world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if world_size() > 1:
        torch.distributed.barrier()
