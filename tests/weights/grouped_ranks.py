"""Rank-side check of `weights.grouped` against the bridge's own export, run inside the
multi-rank launches of tests/weights/test_sync.py (TP 2, EP 2, PP 2, TP 2 x EP 2) and
tests/weights/test_owners.py (EP 4; EP 2 on two "nodes").

On each rank: the expert members `GroupedPlan` takes straight from the Megatron parameters
against (a) what megatron-bridge's export yields for the same experts under
`ep_local_experts()` (the path before: names, bytes, dtype, shape and the EP registry entry:
the slot's name on every EP rank and the group's ranks) and (b) the bridge's all-gathered
export of the whole model (`hf_state`); and the bridge's export of the remaining tasks, which
must hold no expert tensor at all. Returns small summaries, never tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_gspo.patches.bridge import ep_local_experts
from megatron_gspo.weights.grouped import GroupedPlan, local_export

Entry = tuple[list[str], list[int]] | None


def _entry(entry: tuple[list[str], Any] | None) -> Entry:
    """A registry entry comparable across paths: (names on every EP rank, the group's ranks)."""
    if entry is None:
        return None
    names, group = entry
    return list(names), torch.distributed.get_process_group_ranks(group)


def grouped_vs_bridge(bridge: Any, model: list, ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """This rank's grouped expert members against the bridge's export (see the module)."""
    plan, tasks, why = GroupedPlan.of(bridge, model)
    out: dict[str, Any] = {"why": why, "members": 0}
    if plan is None:
        return out
    before: dict[str, tuple[torch.Tensor, Entry]] = {}
    with ep_local_experts() as local:
        for name, t in bridge.export_hf_weights(model, cpu=False, show_progress=False):
            if ".mlp.experts." in name:
                before[name] = (t.detach().clone(), _entry(local.pop(name, None)))
    with ep_local_experts() as local:
        grouped = {name: (t, _entry(local.pop(name, None))) for name, t in plan.tensors(local)}
        rest = [n for n, _ in bridge.export_hf_weights(
            model, cpu=False, show_progress=False, conversion_tasks=plan.others
        )]  # fmt: skip
    # Every name some EP rank's grouped members carry (EP 1: this rank's own).
    every_rank = {n for _, e in grouped.values() if e for n in e[0]} or set(grouped)

    def same(name: str, t: torch.Tensor, entry: Entry) -> bool:
        old = before.get(name)
        return (
            old is not None
            and t.dtype == old[0].dtype
            and torch.equal(t, old[0])
            and entry == old[1]
        )

    out.update(
        members=len(grouped),
        names_differ=sorted(set(before) ^ set(grouped)),
        unequal=sorted(n for n, (t, e) in grouped.items() if not same(n, t, e)),
        unequal_to_export=sorted(n for n, (t, _) in grouped.items() if not torch.equal(t, ref[n])),
        registered=sum(e is not None for _, e in grouped.values()),
        rest_experts=sorted(n for n in rest if ".mlp.experts." in n),
        rest=len(rest),
        tasks=len(tasks or []),
        covered=sorted(set(ref) - set(rest) - every_rank),
        stale=_stale(bridge, model, plan),
    )
    return out


def _stale(bridge: Any, model: list, plan: GroupedPlan) -> list[str]:
    """Expert members that `local_export` (its plan kept on the model across pushes) does not
    take from the parameters' current values: the experts' signs are flipped in place between
    two exports (exactly undone after), as a training step updates the parameters in place."""

    def experts() -> dict[str, torch.Tensor]:
        with ep_local_experts() as local:
            got = local_export(bridge, model, local, grouped=True)
            return {n: t.detach().clone() for n, t in got if ".mlp.experts." in n}

    first = experts()
    for p in plan.experts:
        p.weight.data.neg_()
    try:
        again = experts()
    finally:
        for p in plan.experts:
            p.weight.data.neg_()
    return sorted(n for n, t in first.items() if n not in again or not torch.equal(again[n], -t))
