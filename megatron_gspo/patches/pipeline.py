"""Pipeline point-to-point ordering fix for megatron-core 0.19 with a two-rank pipeline group.

With `pipeline_model_parallel_size == 2` the previous and the next pipeline rank are the same
process. Point-to-point messages between one pair of ranks are matched in posting order (gloo and
NCCL alike; tags do not help on NCCL), and megatron-core posts, in one batch,
`send_prev, recv_prev, send_next, recv_next`. The peer's first send is its `send_prev`, which we
must receive as `recv_next`, but our first receive is `recv_prev`: whenever one call carries both
directions the two messages are swapped. Only the interleaved (virtual pipeline) schedule makes
such calls (`send_forward_backward_recv_forward_backward` in its steady state), so 1F1B is
unaffected. With equal activation shapes the swap goes unnoticed in the shape exchange; with
packed variable-length micro-batches (`variable_seq_lengths=True`) a stage receives the next
micro-batch's length and fails in the THD rotary split; with `batch_p2p_comm=True` the activation
and gradient tensors themselves are swapped.

The fix posts sends in the order (prev, next) and receives in the order (next, prev), so that each
rank's k-th send to its peer meets the peer's k-th receive from it. For a group larger than two
ranks, prev and next are different peers and the order changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_gspo.patches.base import Patch, PatchError

if TYPE_CHECKING:
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

MCORE_VERSIONS = ("0.19.2",)
_P2P = "megatron.core.pipeline_parallel.p2p_communication"


def ordered_p2p_ops(
    *,
    send_prev: torch.Tensor | None,
    recv_prev: torch.Tensor | None,
    send_next: torch.Tensor | None,
    recv_next: torch.Tensor | None,
    prev_rank: int,
    next_rank: int,
    group: dist.ProcessGroup | None,
) -> list[dist.P2POp]:
    """P2P ops in an order that pairs correctly when `prev_rank == next_rank`."""
    ops = []
    if send_prev is not None:
        ops.append(dist.P2POp(dist.isend, send_prev, prev_rank, group))
    if send_next is not None:
        ops.append(dist.P2POp(dist.isend, send_next, next_rank, group))
    if recv_next is not None:
        ops.append(dist.P2POp(dist.irecv, recv_next, next_rank, group))
    if recv_prev is not None:
        ops.append(dist.P2POp(dist.irecv, recv_prev, prev_rank, group))
    return ops


def _batched_p2p_ops(
    *,
    tensor_send_prev: torch.Tensor | None,
    tensor_recv_prev: torch.Tensor | None,
    tensor_send_next: torch.Tensor | None,
    tensor_recv_next: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    prev_pipeline_rank: int,
    next_pipeline_rank: int,
) -> list[Any]:
    ops = ordered_p2p_ops(
        send_prev=tensor_send_prev,
        recv_prev=tensor_recv_prev,
        send_next=tensor_send_next,
        recv_next=tensor_recv_next,
        prev_rank=prev_pipeline_rank,
        next_rank=next_pipeline_rank,
        group=group,
    )
    return dist.batch_isend_irecv(ops) if ops else []


def _communicate_shapes(
    self: P2PCommunicator,
    tensor_send_next: torch.Tensor | None,
    tensor_send_prev: torch.Tensor | None,
    recv_prev: bool,
    recv_next: bool,
) -> tuple[list[int], list[int]]:
    if self.config.use_ring_exchange_p2p:  # not affected: one collective call
        return _state["shapes"](self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)
    device = torch.cuda.current_device()

    def shape_of(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.tensor(t.size(), device=device, dtype=torch.int64)

    def buffer(wanted: bool) -> torch.Tensor | None:
        return torch.empty((3,), device=device, dtype=torch.int64) if wanted else None

    prev_buf, next_buf = buffer(recv_prev), buffer(recv_next)
    ops = ordered_p2p_ops(
        send_prev=shape_of(tensor_send_prev),
        recv_prev=prev_buf,
        send_next=shape_of(tensor_send_next),
        recv_next=next_buf,
        prev_rank=self.prev_rank,
        next_rank=self.next_rank,
        group=self.pp_group,
    )
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        if torch.cuda.is_available():  # as upstream: guards batch_isend_irecv races on NCCL
            torch.cuda.synchronize()
    return (
        prev_buf.tolist() if prev_buf is not None else [0, 0, 0],
        next_buf.tolist() if next_buf is not None else [0, 0, 0],
    )


_state: dict[str, Any] = {}


def _check() -> None:
    import inspect

    from megatron.core.pipeline_parallel import p2p_communication as p2p

    comm = getattr(p2p, "P2PCommunicator", None)
    if comm is None or not hasattr(comm, "_communicate_shapes"):
        raise PatchError(f"{_P2P}.P2PCommunicator._communicate_shapes is gone: review the patch")
    expected = ["self", "tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next"]
    if list(inspect.signature(comm._communicate_shapes).parameters) != expected:
        raise PatchError(f"{_P2P}: _communicate_shapes signature changed: review the patch")
    fn = _state.get("batched", getattr(p2p, "_batched_p2p_ops", None))
    names = list(inspect.signature(fn).parameters) if fn else []
    if names != [
        "tensor_send_prev",
        "tensor_recv_prev",
        "tensor_send_next",
        "tensor_recv_next",
        "group",
        "prev_pipeline_rank",
        "next_pipeline_rank",
    ]:
        raise PatchError(f"{_P2P}: _batched_p2p_ops signature changed: review the patch")


def _apply() -> None:
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    _state["shapes"] = p2p.P2PCommunicator._communicate_shapes
    _state["batched"] = p2p._batched_p2p_ops
    p2p.P2PCommunicator._communicate_shapes = _communicate_shapes
    p2p._batched_p2p_ops = _batched_p2p_ops  # looked up by name inside _communicate


P2P_ORDER_PATCH = Patch(
    name="mcore-p2p-two-rank-order",
    package="megatron-core",
    versions=MCORE_VERSIONS,
    why="Interleaved pipeline with pipeline_model_parallel_size=2: "
    "P2PCommunicator._communicate_shapes and _batched_p2p_ops post recv_prev before recv_next "
    "to the same peer, so a call carrying both directions swaps the two messages. With packed "
    "variable-length micro-batches: RuntimeError split_with_sizes ... in the THD rotary "
    "embedding; with batch_p2p_comm and equal shapes: activations and gradients silently "
    "swapped. Applied by megatron_gspo.megatron.model.init_megatron on every device when pp > 1.",
    remove_when="megatron-core orders two-rank p2p ops by direction (or tags them) in both "
    "functions; tests/patches/test_pipeline_patch.py shows the swap without the fix.",
    apply_fn=_apply,
    check_fn=_check,
)
PIPELINE_PATCHES: tuple[Patch, ...] = (P2P_ORDER_PATCH,)
