"""`weights.senders=owners` in SGLang's own layout at the Qwen3-30B-A3B shapes: who sends what.

    python benchmarks/owners_layout.py

The senders' own decisions (`weights.owners_fused`: `_Loads`, `_Experts._assign`, run for every
rank of one node) over the projection's HF shapes as meta tensors (`weight_sync.QWEN3`, bf16,
fused by the same `fused_stream` the sender runs; no weights, no ranks): per trainer rank the
fused parameters it sends, the bytes it sends to the engines and the bytes it receives from the
other EP ranks (the point-to-point gathers where an engine rank's experts are spread over k
trainer ranks), and the busiest rank's (received + sent) over the model, against the issue's
bound 2/n. One node of 8 ranks, trainer EP 8 (the colocated 30B recipe), into engines of
TP 2 / EP 1 (the recipe's), TP 8 / EP 8 (one engine over the node) and TP 1.

Second table: the colocated home path (`weights.owners_home`, `simulate_home`: every engine
rank fed by the trainer rank on its GPU) for four TP-2 / EP-1 engines and one TP-8 / EP-8
engine per node: per rank the bytes received from other trainer ranks, the bytes written into
its own GPU's send buffers, the fused parameters sent, and, for the per-parameter senders, the
bytes engine ranks read from other GPUs' buffers (docs/performance.md, "Colocated pushes that
never cross GPUs").
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.weight_sync import QWEN3, qwen3_moe_hf_shapes  # noqa: E402


def simulate(
    cfg: dict, trainer_ep: int, engine_tp: int, engine_ep: int, slices: bool = False
) -> dict[str, float]:
    """Every rank's decisions for one push; returns the table's numbers. slices: the engines
    load expert slices and the push is unverified (`weights.expert_slices`): each rank sends
    its own experts, no gather."""
    from megatron_gspo.engines.weight_layout import engine_layout, fused_stream
    from megatron_gspo.engines.weight_shards import EngineLayout
    from megatron_gspo.weights.owners import SenderGrid
    from megatron_gspo.weights.owners_fused import _Experts, _Loads, expert_route

    n = trainer_ep
    lay = engine_layout(EngineLayout.of(cfg, 1, engine_ep), engine_tp)
    grids = [
        SenderGrid(
            rank=r,
            nodes=(0,) * n,
            ep_ranks=tuple(range(n)),
            per_node=True,
            sending=(True,) * n,
            engine_eps=(frozenset({lay.ep_size}),) * n,
        )
        for r in range(n)
    ]
    route, why = expert_route(grids[0], {lay.ep_size}, cfg["num_experts"])
    assert route is not None, why
    route = dataclasses.replace(route, slices=slices)
    loads = [_Loads(g.scope()) for g in grids]
    experts = [_Experts(g, route, x) for g, x in zip(grids, loads, strict=True)]
    recv, sent, tensors = [0] * n, [0] * n, [0] * n
    named = [(k, torch.empty(s, dtype=torch.bfloat16, device="meta")) for k, s in
             qwen3_moe_hf_shapes(cfg)]  # fmt: skip
    model = sum(t.numel() * 2 for _, t in named)
    for name, item in fused_stream(named, num_experts=cfg["num_experts"], lazy=True):
        size = item.numel() * 2
        if name.endswith((".w13_weight", ".w2_weight")):
            share = size // n
            if route.slices and route.peers > 1:  # every rank its own experts, a slice each
                for r, x in enumerate(experts):
                    assert x._assign_slices(share) == r  # one replica per EP rank here
                    sent[r] += share
                    tensors[r] += 1
                continue
            for r, (receiver, peers) in enumerate(x._assign(share) for x in experts):
                if r == receiver:
                    recv[r] += (len(peers) - 1) * share
                    sent[r] += len(peers) * share
                    tensors[r] += 1
            continue
        owners = {x.pick(list(range(n))) for x in loads}
        assert len(owners) == 1  # every rank decides alike
        owner = owners.pop()
        for x in loads:
            x.add(owner, size)
        sent[owner] += size
        tensors[owner] += 1
    through = [a + b for a, b in zip(recv, sent, strict=True)]
    return {
        "k": route.peers,
        "tensors_min": min(tensors),
        "tensors_max": max(tensors),
        "tensors": sum(tensors),
        "sent_gb_max": max(sent) / 1e9,
        "recv_gb_max": max(recv) / 1e9,
        "busiest": max(through) / model,
        "bound": 2 / n,
    }


def simulate_home(cfg: dict, trainer_ep: int, engine_tp: int, engine_ep: int) -> dict[str, Any]:
    """The colocated home path (`weights.owners_home`) on one node of `trainer_ep` GPUs, one
    trainer EP rank per GPU, engines of `engine_tp` ranks side by side over the GPUs (engine i
    on GPUs i*tp..): per rank the bytes it receives from other trainer ranks, the bytes it
    writes into its own GPU's send buffers (its engine rank's parts) and the fused params it
    sends; against it, the per-parameter senders' (`owners_fused`) bytes that engine ranks read
    from OTHER GPUs' buffers through CUDA IPC (uncounted there: the NVLink traffic it hides)."""
    from megatron_gspo.engines.weight_layout import engine_layout, fused_stream, rank_piece
    from megatron_gspo.engines.weight_shards import EngineLayout
    from megatron_gspo.weights.owners_fused import _Loads
    from megatron_gspo.weights.owners_home import EngineRank, expert_transfers

    n, ne = trainer_ep, cfg["num_experts"]
    model_lay = EngineLayout.of(cfg, 1, engine_ep)
    lay = engine_layout(model_lay, engine_tp)
    homes = [EngineRank(g // engine_tp, engine_tp, g % engine_tp, g) for g in range(n)]
    loads = _Loads(list(range(n)))
    recv, written, tensors = [0] * n, [0] * n, [0] * n
    owners_sender = _Loads(list(range(n)))  # the per-parameter senders, for the IPC column
    across = 0
    named = [(k, torch.empty(s, dtype=torch.bfloat16, device="meta")) for k, s in
             qwen3_moe_hf_shapes(cfg)]  # fmt: skip
    model = sum(t.numel() * 2 for _, t in named)
    for name, item in fused_stream(named, num_experts=ne, lazy=True):
        pieces = [rank_piece(name, item, h.rank, lay) for h in homes]
        sizes = [0 if p is None else p.nbytes for p in pieces]
        sender = owners_sender.pick(list(range(n)))  # today's sender of this parameter
        owners_sender.add(sender, item.numel() * 2)
        across += sum(b for g, b in enumerate(sizes) if g != sender)
        if name.endswith((".w13_weight", ".w2_weight")):
            per_expert = item.numel() * 2 // ne
            moves = expert_transfers(homes, range(n), range(n), model_lay, n, loads, per_expert)
            for move in moves:
                if move.source != move.home.home:
                    recv[move.home.home] += len(move.experts) * per_expert // lay.moe_tp
        for g, b in enumerate(sizes):
            written[g] += b
            tensors[g] += b > 0
    return {
        "recv_gb": (min(recv) / 1e9, max(recv) / 1e9),
        "written_gb": (min(written) / 1e9, max(written) / 1e9),
        "tensors": (min(tensors), max(tensors)),
        "recv_over_experts": max(recv) / sum(t.numel() * 2 for k, t in named if ".experts." in k),
        "written_over_model": max(written) / model,
        "across_gb": across / 1e9,
    }


def main() -> None:
    cfg = QWEN3["Qwen3-30B-A3B"]
    print(
        "| engine TP / EP | k | fused params per push | per sender | max GB sent | "
        "max GB received | busiest / model | 2/n |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for tp, ep, slices in ((2, 1, False), (2, 1, True), (8, 8, False), (1, 1, False),
                           (1, 1, True)):  # fmt: skip
        r = simulate(cfg, 8, tp, ep, slices)
        print(
            f"| {tp} / {ep}{' slices' if slices else ''} | {r['k']} | {r['tensors']} "
            f"| {r['tensors_min']}-{r['tensors_max']} "
            f"| {r['sent_gb_max']:.2f} | {r['recv_gb_max']:.2f} | {r['busiest']:.3f} "
            f"| {r['bound']:.2f} |"
        )

    print()
    print(
        "| engine TP / EP (engines per node) | GB received from peers, per rank | GB written "
        "into its own GPU's send buffers | fused params sent | received / experts | "
        "written / model | owners path: GB engine ranks read from other GPUs (node) |"
    )
    print("|---|---|---|---|---:|---:|---:|")
    for tp, ep in ((2, 1), (8, 8)):
        h = simulate_home(cfg, 8, tp, ep)
        print(
            f"| {tp} / {ep} ({8 // tp}) | {h['recv_gb'][0]:.2f}-{h['recv_gb'][1]:.2f} "
            f"| {h['written_gb'][0]:.2f}-{h['written_gb'][1]:.2f} "
            f"| {h['tensors'][0]}-{h['tensors'][1]} | {h['recv_over_experts']:.3f} "
            f"| {h['written_over_model']:.3f} | {h['across_gb']:.1f} |"
        )


if __name__ == "__main__":
    main()
