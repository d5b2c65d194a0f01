"""The Adam-step resume patch against each optimizer's step layout (issue 20, defect 7).

Transformer Engine's FusedAdam (what megatron-core builds on GPU) is not installable here; the
stand-in below keeps its step exactly where TE's source does
(transformer_engine/pytorch/optimizers/fused_adam.py, `FusedAdam.step`): `group["step"]`, an
int (an int32 tensor of shape [1] with capturable=True), incremented once per step, and no
"step" in the per-parameter state.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_gspo.patches import PatchError
from megatron_gspo.patches import optimizer as optimizer_patch
from megatron_gspo.patches.optimizer import (
    adam_steps,
    check_resumable,
    optimizer_classes,
    planned_optimizer,
    restore_adam_steps,
)


class FusedAdamLayout(torch.optim.Optimizer):
    def __init__(self, params, capturable: bool = False) -> None:
        super().__init__(params, {"lr": 1e-3})
        self.capturable = capturable

    def step(self, closure=None):  # the layout only: no update math
        for group in self.param_groups:
            if "step" in group:
                group["step"] += 1
            else:
                group["step"] = torch.tensor([1], dtype=torch.int) if self.capturable else 1
            for p in group["params"]:
                self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                self.state[p].setdefault("exp_avg_sq", torch.zeros_like(p))


FusedAdamLayout.__module__ = "transformer_engine.pytorch.optimizers.fused_adam"
FusedAdamLayout.__qualname__ = "FusedAdam"


def _megatron(inner: torch.optim.Optimizer) -> types.SimpleNamespace:
    """A chained megatron-core optimizer around `inner` (the attributes the patch reads)."""
    return types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=inner)])


@pytest.mark.parametrize("capturable", [False, True])
def test_fused_adam_group_steps_round_trip(capturable):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    inner = FusedAdamLayout([{"params": params[:2]}, {"params": params[2:]}], capturable)
    for _ in range(3):
        inner.step()
    opt = _megatron(inner)
    saved = adam_steps(opt)
    assert saved == [[3.0, 3.0]]
    fresh = FusedAdamLayout([{"params": params[:2]}, {"params": params[2:]}], capturable)
    fresh.step()  # the dummy-value step megatron-core's loader makes before loading
    restore_adam_steps(_megatron(fresh), saved)
    for group in fresh.param_groups:
        step = group["step"]
        if capturable:
            assert torch.is_tensor(step) and step.shape == (1,) and step.dtype == torch.int
        assert int(step) == 3
    a, b = (g["step"] for g in fresh.param_groups)
    if capturable:
        assert a.data_ptr() != b.data_ptr()  # one tensor per group, as TE increments in place
    for p in params:
        assert "step" not in fresh.state[p]


def test_torch_adam_steps_stay_per_parameter():
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
    inner = torch.optim.AdamW(params)
    for n in range(2):
        params[n].grad = torch.ones(2)
        inner.step()  # parameter 0 steps twice, parameter 1 once (it has no grad the first time)
        params[0].grad = torch.ones(2)
    saved = adam_steps(_megatron(inner))
    assert saved == [[2.0, 1.0]]
    restore_adam_steps(_megatron(inner), [[5.0, 7.0]])
    assert [float(inner.state[p]["step"]) for p in params] == [5.0, 7.0]


def test_sgd_has_no_step_and_other_optimizers_are_refused_by_name():
    p = torch.nn.Parameter(torch.zeros(1))
    check_resumable(optimizer_classes(_megatron(torch.optim.SGD([p], lr=0.1, momentum=0.9))))
    assert adam_steps(_megatron(torch.optim.SGD([p], lr=0.1))) == [[]]
    with pytest.raises(PatchError, match=r"torch\.optim\.rmsprop\.RMSprop .*optim\.optimizer"):
        check_resumable(optimizer_classes(_megatron(torch.optim.RMSprop([p]))))


def test_planned_optimizer_is_the_one_megatron_core_builds_here():
    """Before any model: the class megatron-core 0.19 picks for optim.optimizer among the
    installed packages, against its own import-time choice in this interpreter."""
    import megatron.core.optimizer as mco

    if mco.USING_PYTORCH_OPTIMIZER:  # its Adam branch: AdamW (decoupled decay, our setting)
        adam, sgd = torch.optim.AdamW, torch.optim.SGD
    else:
        adam, sgd = mco.Adam, mco.SGD
    for name, cls in (("adam", adam), ("sgd", sgd)):
        assert planned_optimizer(name) == f"{cls.__module__}.{cls.__qualname__}"


def test_planned_optimizer_follows_what_is_installed(monkeypatch):
    """With Transformer Engine installed megatron-core takes its fused optimizers (found, not
    imported)."""
    found = {"transformer_engine"}
    monkeypatch.setattr(
        optimizer_patch.importlib.util,
        "find_spec",
        lambda name, *a: object() if name in found else None,
    )
    assert planned_optimizer("adam").endswith("fused_adam.FusedAdam")
    assert planned_optimizer("adam").startswith("transformer_engine.")
    found = {"apex"}
    assert planned_optimizer("sgd") == "apex.optimizers.fused_sgd.FusedSGD"


def test_a_checkpoint_of_another_step_layout_is_refused():
    """torch AdamW (a step per parameter) does not resume Transformer Engine's FusedAdam state
    (a step per param group), nor the other way round; the same layout does."""
    te = "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"
    torch_adam = "torch.optim.adamw.AdamW"
    check_resumable([torch_adam], [torch_adam, torch_adam], "ckpt/step_000002")
    check_resumable([te], [te, "apex.optimizers.fused_adam.FusedAdam"], "ckpt")
    for now, saved in ((torch_adam, te), (te, torch_adam)):
        with pytest.raises(PatchError) as e:
            check_resumable([now], [saved, saved], "ckpt/step_000002")
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("ckpt/step_000002: its optimizer state")
        assert saved in msg and now in msg
