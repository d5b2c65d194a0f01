"""Process-group set-up and rank helpers: the one place that decides the device.

Every module that needs a free port, the rank, a broadcast or the job's device asks here, so the
CPU (gloo) and GPU (NCCL) paths differ in exactly one function (`init_distributed`).

Device rule (issue 12), two layers, both on purpose:

* Every tensor the job hands to a tensor collective or to the model lives on `device()`:
  micro-batches are moved there when planned, loss/metric/routing/bookkeeping tensors are
  created there. megatron-core's own process groups (TP, EP, DP, PP, CP) are NCCL-only on GPU,
  and our loss runs collectives on them (vocab-parallel log-softmax), so "CPU tensors are
  fine on the default group" would be a rule with exceptions; one rule without exceptions is
  checked by tests/megatron/test_devices.py.
* On GPU the default group is still created as `cpu:gloo,cuda:nccl`: object collectives
  (`broadcast` below, `all_gather_object`) and barriers then run over gloo on host memory.
  That is where the non-zero ranks wait while rank 0 generates a rollout: a host-side wait
  under `timeout_s` instead of an NCCL kernel parked on the GPU, and a CPU tensor reaching
  the default group by mistake works instead of failing on a cluster.

`timeout_s` (config `train.dist_timeout_s`) bounds every collective of the default group,
including those waits, so it must exceed the longest rollout (torch's default is 10 minutes).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Sequence
from typing import Any, Literal

import torch

DeviceChoice = Literal["auto", "cpu", "cuda"]

_DEVICE: torch.device | None = None


_HELD: dict[tuple[str, int], socket.socket] = {}


def hold_port(host: str, port: int = 0) -> socket.socket | None:
    """Bind `host:port` (0: a port the OS picks) and keep it bound, or None if it is taken.

    The hand-over (no bind-and-close race): an exclusive bind first proves nobody holds the
    port, then a socket with SO_REUSEADDR takes it and stays bound, not listening. While it is
    held, an exclusive bind (another job's probe) fails and the OS never hands the port out
    for a `bind(port 0)`, while the server it is meant for, which binds with SO_REUSEADDR
    itself (torch's TCPStore, uvicorn/SGLang, http.server, aiohttp), binds and listens on it.
    """
    probe = socket.socket()
    try:
        probe.bind((host, port))
    except OSError:
        probe.close()
        return None
    port = int(probe.getsockname()[1])
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    probe.close()
    try:
        held.bind((host, port))  # a port-0 probe elsewhere may win it meanwhile: None
    except OSError:
        held.close()
        return None
    return held


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that stays reserved for this process's server (see `hold_port`)
    until `release_port`, or until the process exits."""
    for _ in range(50):
        # The OS may hand the port another thread's probe just released to a second probe,
        # whose hold then loses to that thread's: ask again (another port comes back).
        held = hold_port(host, 0)
        if held is not None:
            break
    else:
        raise OSError(f"no free TCP port on {host}")
    port = int(held.getsockname()[1])
    _HELD[(host, port)] = held
    return port


def free_ports(host: str, count: int, start: int) -> int:
    """The first `count` consecutive ports at or above `start` that nobody holds, reserved like
    `free_port` (engine i of a job listens on base + i); returns the base. Two jobs on one node
    get distinct ranges: each one's reservations make the other's probes fail."""
    base = start
    while base + count <= 65536:
        held: list[socket.socket] = []
        for port in range(base, base + count):
            sock = hold_port(host, port)
            if sock is None:
                break
            held.append(sock)
        if len(held) == count:
            for port, sock in zip(range(base, base + count), held, strict=True):
                _HELD[(host, port)] = sock
            return base
        for sock in held:
            sock.close()
        base += len(held) + 1
    raise OSError(f"no {count} consecutive free TCP ports on {host} from {start}")


def release_port(host: str, port: int) -> None:
    """Stop holding a port `free_port`/`free_ports` reserved (its server is up, or gone)."""
    held = _HELD.pop((host, port), None)
    if held is not None:
        held.close()


def routable_address(peers: Sequence[str]) -> str:
    """This host's address as the `peers` reach it: the source address of the route to them.

    A remote peer's route wins over a loopback one (an engine on another node cannot reach
    127.0.0.1, while a local engine reaches every local address). Without peers, or when no
    route is found, the fully qualified host name, which the cluster's resolver maps to the
    node.
    """
    found: list[str] = []
    for host in peers:
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)  # UDP connect sends nothing: it only selects the route
                found.append(str(s.getsockname()[0]))
        except OSError:
            continue
    remote = [a for a in found if not ipaddress.ip_address(a).is_loopback]
    return (remote or found or [socket.getfqdn()])[0]


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

    gloo on CPU; `cpu:gloo,cuda:nccl` on GPU (see the module docstring). `timeout_s` bounds
    every collective of the default group (None: torch's default, 10 minutes).
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
    torch.distributed.init_process_group(backend_for(device()), **kwargs)


def backend_for(dev: torch.device) -> str:
    """The default group's backend string for the job's device (see the module docstring)."""
    return "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"


def rank() -> int:
    """The global rank: torch.distributed's once initialised, before that torchrun's $RANK."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def broadcast[T](obj: T, src: int = 0) -> T:
    """`obj` from rank `src` on every rank (pickled; for small control data)."""
    if world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def release_device_memory() -> None:
    """Give the accelerator's free memory back to the driver, for a colocated engine to use:
    `torch.cuda.ipc_collect()` (blocks shared over CUDA IPC whose receivers let go return to
    the allocator) then `torch.cuda.empty_cache()` (cached blocks return to the driver). A
    no-op on CPU, where there is neither a cache nor IPC handles."""
    if device().type == "cuda":
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


def barrier() -> None:
    if world_size() > 1:
        torch.distributed.barrier()


# OS thread names (/proc/self/task/*/comm) of torch.distributed's backends on CPU: gloo's
# transport loop and a process group's workers, the TCP store's libuv server.
COMM_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop", "pt_tcpstore_uv")


def comm_threads() -> list[str]:
    """The names of this process's threads that belong to a process group or store (Linux;
    an empty list elsewhere)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if name in COMM_THREADS:
            names.append(name)
    return names


def shutdown() -> None:
    """Destroy every process group of this process (local: no collective, so a rank whose
    peers are gone does not wait for them)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

