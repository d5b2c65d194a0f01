"""`weights.grouped` (issue 36): which expert conversion tasks it serves and why not, on
megatron-bridge's real mapping classes (no process group here: EP, TP and PP are 1), and what
`local_export` asks of the bridge then. The bitwise checks against the bridge's export of real
Megatron models (EP 2 and 4, expert-TP 2 and PP 2 falling back) run in the multi-rank launches
of tests/weights/test_sync.py and tests/weights/test_owners.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron_gspo.patches.bridge import apply_bridge_imports
from megatron_gspo.weights import grouped
from megatron_gspo.weights.grouped import GroupedPlan, local_export
from megatron_gspo.weights.stream import StreamStats

L = "decoder.layers.0"
H, INTER = 8, 4


def _mappings() -> dict[str, Any]:
    apply_bridge_imports()
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping

    experts = "model.layers.*.mlp.experts.*"
    fc = "decoder.layers.*.mlp.experts.local_experts.*.linear_fc"
    return {
        "fc1": GatedMLPMapping(
            f"{fc}1.weight", gate=f"{experts}.gate_proj.weight", up=f"{experts}.up_proj.weight"
        ).resolve(("0", "1")),
        "fc1_plain": AutoMapping(f"{fc}1.weight", f"{experts}.up_proj.weight").resolve(("0", "1")),
        "fc1_bias": GatedMLPMapping(
            f"{fc}1.bias", gate=f"{experts}.gate_proj.bias", up=f"{experts}.up_proj.bias"
        ).resolve(("0", "1")),
        "fc2": AutoMapping(f"{fc}2.weight", f"{experts}.down_proj.weight").resolve(("0", "1")),
        "norm": AutoMapping(
            "decoder.layers.*.input_layernorm.weight", "model.layers.*.input_layernorm.weight"
        ).resolve(("0",)),
    }


def _task(mapping: Any, weight: torch.Tensor | None, **kw: Any) -> SimpleNamespace:
    config = SimpleNamespace(num_moe_experts=4)
    return SimpleNamespace(
        mapping=mapping,
        global_param_name=mapping.megatron_param,
        param_weight=weight,
        megatron_module=SimpleNamespace(config=config),
        export_hook=kw.get("export_hook"),
        weight_dtype=kw.get("weight_dtype"),
    )


class Bridge:
    """What `local_export` uses of an `AutoBridge`: its tasks and its export (recorded)."""

    export_weight_dtype = "bf16"

    def __init__(self, tasks: list[Any]) -> None:
        self.tasks = tasks
        self.exports: list[Any] = []

    def get_conversion_tasks(self, model: Any) -> list[Any]:
        return list(self.tasks)

    def export_hf_weights(self, model: Any, **kw: Any) -> Any:
        self.exports.append(kw.get("conversion_tasks", "all"))
        for task in kw.get("conversion_tasks") or self.tasks:
            yield str(task.mapping.hf_param), task.param_weight


def _model(num_experts: int = 4) -> list[Any]:
    chunk = torch.nn.Module()
    chunk.config = SimpleNamespace(num_moe_experts=num_experts)  # type: ignore[assignment]
    return [chunk]


def test_members_are_views_of_the_megatron_parameters() -> None:
    """fc1 [2I, H] is [gate; up] on dim 0 and fc2 [H, I] is down (the bridge's
    `GatedMLPMapping` chunk with expert-TP 1, the fc2 `AutoMapping`): the members are those
    rows, under the task's HF names, no copy; the bridge exports the other tasks only."""
    m = _mappings()
    fc1, fc2, norm = torch.randn(2 * INTER, H), torch.randn(H, INTER), torch.randn(H)
    bridge = Bridge([_task(m["norm"], norm), _task(m["fc1"], fc1), _task(m["fc2"], fc2)])
    stats, local, model = StreamStats(), {}, _model()
    got = list(local_export(bridge, model, local, grouped=True, stats=stats))
    names = [n for n, _ in got]
    assert names == [
        "model.layers.0.mlp.experts.1.gate_proj.weight",
        "model.layers.0.mlp.experts.1.up_proj.weight",
        "model.layers.0.mlp.experts.1.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
    ]
    gate, up, down, _ = (t for _, t in got)
    assert torch.equal(gate, fc1[:INTER]) and torch.equal(up, fc1[INTER:])
    assert torch.equal(down, fc2)
    assert gate.data_ptr() == fc1.data_ptr() and up.data_ptr() == fc1[INTER:].data_ptr()
    assert stats.direct_experts == 3 and local == {}  # EP 1: nothing for the EP step
    assert [len(tasks) for tasks in bridge.exports] == [1]  # the norm's task only
    # The next push of the same model reuses the plan (tasks listed once per model); the
    # members are taken again, so an update in place is what the next push sends.
    bridge.tasks = []
    fc1.add_(1.0)
    again = dict(local_export(bridge, model, {}, grouped=True))
    assert torch.equal(again["model.layers.0.mlp.experts.1.gate_proj.weight"], fc1[:INTER])
    assert [len(tasks) for tasks in bridge.exports] == [1, 1]


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("non_gated", "not a gated MLP's fc1 / fc2 weight"),
        ("bias", "not a gated MLP's fc1 / fc2 weight"),
        ("export_hook", "an export hook"),
        ("other_stage", "pipeline parallel"),
        ("fp8_export", "exports FP8"),
        ("legacy_grouped", "legacy GroupedMLP"),
        ("integer", "FP8, FSDP or quantised"),
    ],
)
def test_what_it_cannot_serve_goes_to_the_bridge_said_once(
    case: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each case falls back to the bridge's export of every task (the tasks already built are
    handed back, not built again), with the reason in the log once per process."""
    m = _mappings()
    fc1, fc2 = torch.randn(2 * INTER, H), torch.randn(H, INTER)
    tasks = [_task(m["fc1"], fc1), _task(m["fc2"], fc2)]
    if case == "non_gated":
        tasks[0] = _task(m["fc1_plain"], fc1)
    elif case == "bias":
        tasks.append(_task(m["fc1_bias"], torch.randn(2 * INTER)))
    elif case == "export_hook":
        tasks[1] = _task(m["fc2"], fc2, export_hook=lambda n, t: [(n, t)])
    elif case == "other_stage":
        tasks[1] = _task(m["fc2"], None)
    elif case == "legacy_grouped":
        tasks = [_task(m["norm"], torch.randn(H))]
    elif case == "integer":
        tasks[1] = _task(m["fc2"], fc2.to(torch.int8))
    bridge = Bridge(tasks)
    if case == "fp8_export":
        bridge.export_weight_dtype = "fp8"
    grouped._told.clear()
    plan, _, said = GroupedPlan.of(bridge, _model())  # type: ignore[arg-type]
    assert plan is None and why in said, said
    model = _model()
    for _ in range(2):  # two pushes of one model, then another model
        stats = StreamStats()
        with caplog.at_level(logging.WARNING, logger=grouped.__name__):
            got = list(local_export(bridge, model, {}, grouped=True, stats=stats))
        assert len(got) == len(tasks) and stats.direct_experts == 0
    list(local_export(bridge, _model(), {}, grouped=True))
    # The first push of a model hands the bridge the tasks just listed; later pushes let it
    # list its own, as the path without `weights.grouped` does.
    listed = "all" if case == "fp8_export" else tasks
    assert bridge.exports == [listed, "all", listed]
    told = [r.getMessage() for r in caplog.records if r.name == grouped.__name__]
    assert len(told) == 1 and why in told[0], told


def test_off_and_stand_in_bridges_walk_the_bridge() -> None:
    """`weights.grouped_export=off` asks the bridge for everything (no task list built); a
    stand-in bridge without conversion tasks is left to its own export."""
    m = _mappings()
    bridge = Bridge([_task(m["fc1"], torch.randn(2 * INTER, H))])
    assert len(list(local_export(bridge, _model(), {}, grouped=False))) == 1
    assert bridge.exports == ["all"]

    class StandIn:
        def export_hf_weights(self, model: Any, **kw: Any) -> Any:
            assert "conversion_tasks" not in kw
            yield "x", torch.zeros(1)

    plan, tasks, why = GroupedPlan.of(StandIn(), _model())  # type: ignore[arg-type]
    assert plan is None and tasks is None and "has no conversion tasks" in why
    assert [n for n, _ in local_export(StandIn(), _model(), {}, grouped=True)] == ["x"]  # type: ignore[arg-type]
