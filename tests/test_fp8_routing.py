"""benchmarks/fp8_routing.py: the route recorder and the disagreement count (planted routes)."""

from __future__ import annotations

import torch

from benchmarks.fp8_routing import RouteRecorder, disagreement


def test_disagreement_ignores_order_within_top_k() -> None:
    logits = torch.zeros(2, 4)
    ref = [[(logits, torch.tensor([[0, 1], [2, 3]])), (logits, torch.tensor([[0, 1], [0, 1]]))]]
    var = [[(logits, torch.tensor([[1, 0], [2, 1]])), (logits, torch.tensor([[1, 0], [0, 1]]))]]
    assert disagreement(ref, var) == [0.5, 0.0]
    assert disagreement(ref, ref) == [0.0, 0.0]


def test_recorder_sees_every_moe_layer_and_a_planted_flip() -> None:
    from megatron_gspo.data.tiny_model import build_tiny_hf_model

    model = build_tiny_hf_model(seed=0)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    rec = RouteRecorder(model)
    with torch.no_grad():
        model(input_ids=ids)
        same = rec.take()
        model(input_ids=ids)
        again = rec.take()
        gate = model.model.layers[1].mlp.gate.weight
        gate.copy_(-gate)  # reversed router logits: layer 1's top 2 of 4 become its bottom 2
        model(input_ids=ids)
        flipped = rec.take()
    assert len(same) == model.config.num_hidden_layers and same[0][1].shape == (6, 2)
    assert disagreement([same], [again]) == [0.0, 0.0]
    assert disagreement([same], [flipped]) == [0.0, 1.0]
