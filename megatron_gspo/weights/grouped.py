"""Experts straight from the Megatron expert parameters, not from the bridge's per-HF-tensor walk
(`weights.grouped_export`, issue 36).

megatron-bridge's export (`AutoBridge.export_hf_weights`) runs one conversion task per Megatron
parameter and yields one HF tensor at a time: for a MoE layer's experts that is, per local
expert, the fc1 task (gate and up) and the fc2 task (down), each through its mapping, the PP
broadcast check, the EP step (`patches.bridge.ep_local_experts`: no collective, the slot's name
on every EP rank) and the bridge's finalising; 2,304 expert tensors per rank for Qwen3-30B-A3B
at EP 8, the largest term of the push's projection (docs/performance.md). Pushes in SGLang's
own layout then fuse those HF tensors back into each layer's stacked `w13_weight` /
`w2_weight`, whose rows are exactly the Megatron parameters:

    Megatron, per local expert i:   linear_fc1.weight [2I, H] = cat(gate, up) on dim 0
                                    linear_fc2.weight [H, I]  = down
    HF (the bridge's mappings):     gate_proj, up_proj = chunk(linear_fc1.weight, 2, dim 0)
                                    down_proj = linear_fc2.weight

That is what megatron-bridge 0.6.2 exports with expert-TP 1: `GatedMLPMapping.megatron_to_hf`
splits the fused weight with `torch.chunk(w, 2, dim=0)` (concatenation, no interleave; only its
expert-TP > 1 branch re-orders each TP shard's [gate_k; up_k]) and the fc2 `AutoMapping`
(row parallel) returns the weight itself; the EP step only renames it (local expert i of EP
rank r is global expert r * n_local + i: the bridge's own name in the task's mapping). So here
the bridge's conversion tasks are split (`AutoBridge.get_conversion_tasks`, the pre-built
`conversion_tasks` argument of `export_hf_weights`, both public API): the expert tasks never
reach the bridge, their members are views of the parameters under the bridge's HF names (the
same bytes, no copy), registered as the EP step registers them, and every other task goes
through the bridge as before. Tested bitwise against the bridge's export (tests/weights/
test_owners.py, test_sync.py).

Where it cannot serve, the push takes the bridge's experts (`GroupedPlan.of` says why, once in
the log): a stand-in bridge without conversion tasks, FP8 export, PP > 1 (the bridge broadcasts
other stages' experts to every stage, which the owners' routes count on), expert-TP > 1 (the
bridge's TP gather and shard interleave), non-gated MLPs, expert biases, legacy `GroupedMLP`
(`weight1` / `weight2`: no per-expert task), LoRA / export hooks / FP8 or FSDP parameters.
The decision is taken on every rank alike (one `all_gather_object`, so no rank walks a path
its peers do not), once per model: the plan is kept on the model (`_DECIDED`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_gspo import dist

if TYPE_CHECKING:
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.conversion.model_bridge import WeightConversionTask
    from torch.distributed import ProcessGroup

    from megatron_gspo.weights.stream import StreamStats

__all__ = ["GroupedPlan", "local_export"]

logger = logging.getLogger(__name__)

_FC1 = re.compile(r"\.experts\.(local_experts\.\d+\.)?linear_fc1\.weight\d*$")
_FC2 = re.compile(r"\.experts\.(local_experts\.\d+\.)?linear_fc2\.weight\d*$")
_EXPERT_NO = re.compile(r"experts\.(\d+)")
_told: set[str] = set()
"""Fallback reasons already logged by this process (said once each)."""


@dataclass(frozen=True, slots=True)
class ExpertParam:
    """One local expert parameter and what the bridge would export of it."""

    weight: torch.Tensor
    """The Megatron parameter (this rank's, whole: expert-TP 1)."""
    names: tuple[str, ...]
    """Its HF members' names in row order: (gate, up) for fc1, (down,) for fc2."""
    on_ep_ranks: tuple[tuple[str, ...], ...]
    """Per member, the name the same slot has on every EP rank (empty: EP 1)."""
    group: ProcessGroup | None
    """The expert-parallel group (None: EP 1)."""


@dataclass(frozen=True, slots=True)
class GroupedPlan:
    """The bridge's conversion tasks split into this rank's expert parameters and the rest."""

    experts: tuple[ExpertParam, ...]
    others: list[WeightConversionTask]
    """Every other task, in the bridge's order (it still exports these)."""

    @staticmethod
    def of(
        bridge: AutoBridge, model: list[torch.nn.Module]
    ) -> tuple[GroupedPlan | None, list[WeightConversionTask] | None, str]:
        """(the plan on this rank, or None; the bridge's tasks when it could list them, so a
        fallback does not build them twice; why the bridge must export the experts)."""
        if getattr(bridge, "export_weight_dtype", None) == "fp8":
            return None, None, "the bridge exports FP8 (export_weight_dtype=fp8)"
        get_tasks = getattr(bridge, "get_conversion_tasks", None)
        if get_tasks is None:
            return None, None, f"{type(bridge).__name__} has no conversion tasks"
        try:
            tasks = [t for t in get_tasks(model) if t is not None]
        except (ValueError, AttributeError) as e:
            return None, None, f"the bridge cannot list its conversion tasks ({e})"
        experts: list[ExpertParam] = []
        others: list[WeightConversionTask] = []
        for task in tasks:
            if not getattr(task.mapping, "is_expert", False):
                others.append(task)
                continue
            one = _expert_param(task)
            if isinstance(one, str):
                return None, tasks, one
            experts.append(one)
        if not experts and _num_experts(model):
            why = "no per-expert conversion task (legacy GroupedMLP's weight1 / weight2?)"
            return None, tasks, why
        return GroupedPlan(tuple(experts), others), tasks, ""

    def tensors(
        self, local: dict[str, tuple[list[str], ProcessGroup]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The expert members as the bridge yields them under `ep_local_experts()` (views of
        the parameters), each registered in `local` as the bridge's EP step registers it."""
        for p in self.experts:
            w = p.weight.detach()
            members = torch.chunk(w, 2, dim=0) if len(p.names) == 2 else (w,)
            for j, (name, t) in enumerate(zip(p.names, members, strict=True)):
                if p.group is not None:
                    local[name] = (list(p.on_ep_ranks[j]), p.group)
                yield name, t


def _expert_param(task: WeightConversionTask) -> ExpertParam | str:
    """What one expert task's parameter is, or why this path cannot serve it."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping

    m, name, w = task.mapping, task.global_param_name, task.param_weight
    if w is None or m.pp_size > 1:
        return "pipeline parallel (the bridge broadcasts each stage's experts to every stage)"
    if m.tp_size > 1:
        return f"expert tensor parallel {m.tp_size} (the bridge gathers and re-orders shards)"
    if task.export_hook is not None or task.weight_dtype is not None or ".to_wrap." in name:
        return f"{name}: an export hook, dtype or adapter on an expert"
    if type(w.data) is not torch.Tensor or not w.dtype.is_floating_point:
        return f"{name}: a {type(w.data).__name__} of {w.dtype} (FP8, FSDP or quantised)"
    if _FC1.search(name) and type(m) is GatedMLPMapping:
        names: tuple[str, ...] = (m.hf_param["gate"], m.hf_param["up"])
    elif _FC2.search(name) and type(m) is AutoMapping and m.permute_dims is None:
        names = (str(m.hf_param),)
    else:
        return f"{name}: {type(m).__name__} (not a gated MLP's fc1 / fc2 weight)"
    if m.ep_size == 1:
        return ExpertParam(w, names, (), None)
    config = getattr(task.megatron_module, "config", None)
    n = getattr(config, "num_moe_experts", None)
    if not n or n % m.ep_size:
        return f"{name}: {n} experts over EP {m.ep_size}"
    per = n // m.ep_size
    found = [int(x) for nm in names for x in _EXPERT_NO.findall(nm)]
    if len(found) != len(names) or any(e // per != m.ep_rank for e in found):
        return f"{name}: HF names {names} are not EP rank {m.ep_rank}'s experts"
    on_ranks = tuple(
        tuple(_EXPERT_NO.sub(f"experts.{found[0] % per + per * r}", nm) for r in range(m.ep_size))
        for nm in names
    )
    return ExpertParam(w, names, on_ranks, m.ep_group)


def _num_experts(model: list[torch.nn.Module]) -> int:
    """Routed experts per MoE layer of the (wrapped) model; 0 for a dense one."""
    inner: object = model[0]
    while not hasattr(inner, "config") and hasattr(inner, "module"):
        inner = getattr(inner, "module")  # noqa: B009 - `object` has no `module`
    return int(getattr(getattr(inner, "config", None), "num_moe_experts", None) or 0)


def _agreed(why: str) -> str:
    """`why` of the first rank that cannot take the grouped path ("" when every rank can):
    the same answer on every rank (one collective)."""
    if dist.world_size() == 1:
        return why
    every: list[str] = [""] * dist.world_size()
    torch.distributed.all_gather_object(every, why)
    return next((w for w in every if w), "")


@dataclass(frozen=True, slots=True)
class _Decided:
    """One model's agreed decision, kept across pushes (`_DECIDED`)."""

    models: tuple[int, ...]
    """`id` of the bridge and of every model chunk it was taken for."""
    plan: GroupedPlan | None
    why: str


_DECIDED = "_mgspo_grouped_export"
"""The attribute of a model's first chunk that keeps its agreed plan (`_Decided`). Listing the
bridge's tasks walks every Megatron parameter (measured on CPU: most of a walk without gathers,
docs/performance.md), so it is done once per model, not per push: the tasks hold the parameter
objects, which the trainer updates in place (offloading keeps them too: `megatron.offload`),
and the members are views taken at each push. Kept on the model, not in a global map, since
the tasks reference the model: it lives and dies with it."""


def _decide(
    bridge: AutoBridge, model: list[torch.nn.Module]
) -> tuple[GroupedPlan | None, list[WeightConversionTask] | None, str]:
    """The agreed (plan, tasks listed now or None, why not), from `_DECIDED` after the first
    push of a model (collective the first time, on every rank alike: every rank first sees a
    model at the same push)."""
    key = (id(bridge), *map(id, model))
    cached = getattr(model[0], _DECIDED, None)
    if isinstance(cached, _Decided) and cached.models == key:
        return cached.plan, None, cached.why
    plan, tasks, why = GroupedPlan.of(bridge, model)
    why = _agreed(why)
    setattr(model[0], _DECIDED, _Decided(key, None if why else plan, why))
    return (None if why else plan), tasks, why


def local_export(
    bridge: AutoBridge,
    model: list[torch.nn.Module],
    local: dict[str, tuple[list[str], ProcessGroup]],
    *,
    grouped: bool,
    stats: StreamStats | None = None,
    show_progress: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The bridge's HF export inside `patches.bridge.ep_local_experts()` (whose registry is
    `local`), with `grouped` the experts taken straight from the Megatron parameters where
    `GroupedPlan.of` allows (on every rank, or on none: collective on a model's first push).
    Counts those in `stats.direct_experts`."""
    plan, tasks, why = _decide(bridge, model) if grouped else (None, None, "")
    if plan is None:
        if why and why not in _told and dist.rank() == 0:
            _told.add(why)
            logger.warning("weights.grouped_export: the bridge exports the experts: %s", why)
        # The tasks just listed are the bridge's own (`get_conversion_tasks`); on later pushes
        # the bridge lists its own, as it always does.
        kw = {} if tasks is None else {"conversion_tasks": tasks}
        yield from bridge.export_hf_weights(model, cpu=False, show_progress=show_progress, **kw)
        return
    for item in plan.tensors(local):
        if stats is not None:
            stats.direct_experts += 1
        yield item
    yield from bridge.export_hf_weights(
        model, cpu=False, show_progress=show_progress, conversion_tasks=plan.others
    )
