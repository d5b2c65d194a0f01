"""`mcore-p2p-two-rank-order`: on a two-rank pipeline group a call that sends and receives in both
directions swaps the two messages without the patch and delivers them correctly with it.

Each rank sends an "activation" to its next rank and a "gradient" to its previous rank (the same
peer), distinguishable by shape and value, exactly as the interleaved schedule's steady state
does. The unpatched run is kept as a canary: when upstream fixes the order it fails, which is the
signal to delete the patch.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_gspo.testing.harness import spawn_ranks

ACT, GRAD = (5, 1, 4), (3, 1, 4)


def _exchange(comm: Any, rank: int, shape_act: tuple, shape_grad: tuple) -> dict[str, Any]:
    act = torch.full(shape_act, 10.0 + rank)
    grad = torch.full(shape_grad, 20.0 + rank)
    shapes = comm._communicate_shapes(act, grad, True, True)  # send_next, send_prev
    recv_prev, recv_next, _ = comm._communicate(
        tensor_send_next=act,
        tensor_send_prev=grad,
        recv_prev=True,
        recv_next=True,
        tensor_shape=shape_act,
        wait_on_reqs=True,
    )
    return {
        "shape_prev": shapes[0],
        "shape_next": shapes[1],
        "prev": recv_prev.detach().clone(),
        "next": recv_next.detach().clone(),
    }


def _ranks(rank: int, world: int) -> dict[str, Any]:
    if not torch.cuda.is_available():
        from megatron_gspo.patches import apply_cpu_runtime

        apply_cpu_runtime()
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from megatron_gspo.patches import P2P_ORDER_PATCH

    group = torch.distributed.group.WORLD

    def comm(variable: bool) -> P2PCommunicator:
        cfg = ModelParallelConfig(
            pipeline_model_parallel_size=2,
            pipeline_dtype=torch.float32,
            variable_seq_lengths=variable,
            batch_p2p_comm=True,
        )
        return P2PCommunicator(group, cfg)

    # Unpatched, only with equal byte counts: a swapped message of another size would break gloo.
    before = {
        "shapes": comm(True)._communicate_shapes(torch.zeros(ACT), torch.zeros(GRAD), True, True),
        "equal": _exchange(comm(False), rank, ACT, ACT),
    }
    P2P_ORDER_PATCH.apply()
    after = {
        "equal": _exchange(comm(False), rank, ACT, ACT),
        "variable": _exchange(comm(True), rank, ACT, GRAD),
    }
    return {"before": before, "after": after}


def test_two_rank_pipeline_p2p_order() -> None:
    results = spawn_ranks(_ranks, 2, timeout=300)
    for rank, res in enumerate(results):
        peer = 1 - rank
        # without the patch: the activation shape arrives as the gradient's and vice versa
        assert res["before"]["shapes"] == (list(GRAD), list(ACT)), res["before"]["shapes"]
        assert torch.all(res["before"]["equal"]["prev"] == 20.0 + peer)  # a gradient
        # with it: prev delivers the peer's activation, next its gradient
        eq = res["after"]["equal"]
        assert torch.all(eq["prev"] == 10.0 + peer) and torch.all(eq["next"] == 20.0 + peer)
        var = res["after"]["variable"]
        assert (var["shape_prev"], var["shape_next"]) == (list(ACT), list(GRAD))
        assert tuple(var["prev"].shape) == ACT and torch.all(var["prev"] == 10.0 + peer)
        assert tuple(var["next"].shape) == GRAD and torch.all(var["next"] == 20.0 + peer)
