"""The trainer's side of SGLang's weight-update process group (torch only, no SGLang import).

SGLang's engines join with `sglang.srt.utils.init_custom_process_group`: a TCP rendezvous
whose store is wrapped in `PrefixStore(group_name, ...)`, then a process group built outside
the default group. The trainer (rank 0) must build its group the same way or the two sides
never meet; this mirrors that construction so the trainer need not import SGLang.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist


def interface_of(address: str) -> str | None:
    """The local network interface that holds `address` (None if none does, or on loopback).

    Needs psutil (installed with the pinned environment); without it, None.
    """
    try:
        import psutil
    except ImportError:
        return None
    try:
        ips = {str(info[4][0]) for info in socket.getaddrinfo(address, None)}
    except OSError:
        return None
    if any(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip in ips):
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] in ips for a in addrs):
            return name
    return None


@contextlib.contextmanager
def gloo_device_on(address: str) -> Iterator[None]:
    """Make the gloo group built inside bind the interface that holds `address`.

    Gloo advertises to its peers the address of the device it creates, by default the one the
    host name resolves to (often 127.0.0.1 or 127.0.1.1: unreachable from another node). The
    rendezvous address is the one the engines reach us at, so the device goes on its interface.
    `GLOO_SOCKET_IFNAME` set by the user wins.
    """
    iface = None if os.environ.get("GLOO_SOCKET_IFNAME") else interface_of(address)
    if iface is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = iface  # read when the gloo backend is constructed
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def init_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int = 0,
    group_name: str = "weight_update_group",
    backend: str = "nccl",
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Join the weight-update group as `rank` (0 = the trainer); engines use ranks 1..N."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    timeout = timedelta(seconds=timeout_s)
    # The store SGLang's `rendezvous(tcp://...)` builds, made explicitly: under torchrun
    # (TORCHELASTIC_USE_AGENT_STORE=True in every worker's environment) `rendezvous` makes
    # rank 0 a client of a store it expects torchrun's agent to host, so nobody hosts this one
    # and trainer and engines wait for each other until the timeout.
    store: dist.Store = dist.TCPStore(
        host_name=master_address,
        port=master_port,
        world_size=world_size,
        is_master=rank == 0,
        timeout=timeout,
        multi_tenant=True,
        use_libuv=True,
    )
    store = PrefixStore(group_name, store)
    device = gloo_device_on(master_address) if backend == "gloo" else contextlib.nullcontext()
    # Private torch API, as in SGLang: it is the only way to build a group that does not
    # need (or disturb) the default process group the trainer already has.
    with device:
        pg, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend(backend),
            store,
            group_name=group_name,  # type: ignore[arg-type]  # torch's private GroupName
            backend_options=None,
            timeout=timeout,
        )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_weight_update_group(pg: dist.ProcessGroup) -> None:
    """Tear the group down (call after the engines were asked to leave it)."""
    dist.destroy_process_group(pg)


def flatten_for_broadcast(named_tensors: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The uint8 buffer SGLang's `FlattenedTensorBucket` builds, without importing SGLang.

    Broadcast it after `update_weights_from_distributed(..., flattened_bucket=True)` with the
    same names/dtypes/shapes in the same order. The receiver views each tensor at its byte
    offset, so every offset must be a multiple of that tensor's item size: put wide dtypes
    first (e.g. fp32 before bf16 before fp8) or keep one dtype per bucket.
    """
    if not named_tensors:
        raise ValueError("cannot broadcast an empty bucket")
    offset = 0
    for name, t in named_tensors:
        if offset % t.element_size():
            raise ValueError(
                f"{name}: byte offset {offset} is not a multiple of its item size "
                f"{t.element_size()}; order the bucket by decreasing item size"
            )
        offset += t.numel() * t.element_size()
    return torch.cat([t.contiguous().flatten().view(torch.uint8) for _, t in named_tensors])


def host_views(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """A bucket's tensors readable on the host, bitwise as they are: host tensors unchanged;
    device tensors through ONE device->host copy of the bucket flattened as on the wire
    (`flatten_for_broadcast`), viewed back per tensor (not one copy per tensor)."""
    if all(t.device.type == "cpu" for _, t in named):
        return list(named)
    return flat_views(named)


def flat_views(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors as views of ONE host copy of their flattened bytes (in order)."""
    flat = flatten_for_broadcast(list(named)).cpu()
    out, offset = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        out.append((name, flat[offset : offset + n].view(t.dtype).view(t.shape)))
        offset += n
    return out
