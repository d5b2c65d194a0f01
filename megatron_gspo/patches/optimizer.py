"""Resuming torch Adam inside megatron-core 0.19's distributed optimizer, without Apex / TE.

Two gaps in megatron-core's own load path, filled by `megatron_gspo.megatron.checkpoint`:

* A freshly built optimizer has no state to load into. megatron-core's loader first fills it
  with placeholders through the PRIVATE `DistributedOptimizer._init_optimizer_states_with_dummy_
  values` (a zero-gradient step); we call the same method.
* torch Adam keeps a `step` per parameter (Transformer Engine's FusedAdam, megatron-core's
  choice on GPU, one per param group: `STEP_LAYOUTS`; other optimizers are refused at start
  by `check_resumable`). The `dp_reshardable` format does not round-trip it,
  and `DistributedOptimizer.load_state_dict` (no Apex/TE branch) puts ONE step tensor, taken
  from the param groups, into every parameter's state; torch Adam then increments that shared
  tensor in place once per parameter. We save every parameter's step next to the checkpoint and
  give each parameter a tensor of its own on load (a reset step would redo bias correction).

`OPTIMIZER_STATE_PATCH.apply()` checks both assumptions and installs the two functions;
`resume_hooks()` hands them to the checkpoint code, so the fix cannot be used unchecked.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatron_gspo.patches.base import Patch, PatchError
from megatron_gspo.patches.pipeline import MCORE_VERSIONS

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

_DISTRIB = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
_DUMMY_INIT = "_init_optimizer_states_with_dummy_values"
# The statement in DistributedOptimizer.load_state_dict that shares one step tensor.
_SHARED_STEP = 's["step"] = step'


def chained(optimizer: MegatronOptimizer) -> list[Any]:
    """The megatron-core optimizers inside a (possibly) chained one."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _params(opt: MegatronOptimizer) -> list[torch.Tensor]:
    """The inner torch optimizer's parameters in param-group order (stable across rebuilds)."""
    return [p for group in opt.optimizer.param_groups for p in group["params"]]


def init_states_for_load(optimizer: MegatronOptimizer) -> None:
    """Give a fresh optimizer placeholder state to load into, as megatron-core's loader does.

    Only the distributed optimizer has the method; the others build state in their own
    `sharded_state_dict(is_loading=True)`."""
    for opt in chained(optimizer):
        init = getattr(opt, _DUMMY_INIT, None)
        if init is not None:
            init()


# Where each supported inner optimizer keeps Adam's step count:
# * torch.optim.Adam / AdamW: `state[param]["step"]`, one (tensor) per parameter;
# * Transformer Engine's FusedAdam (transformer_engine/pytorch/optimizers/fused_adam.py, what
#   megatron-core uses on GPU when TE is installed) and Apex's: `param_group["step"]`, ONE per
#   param group (an int, or an int tensor of shape [1] with capturable=True), and no "step" in
#   the per-parameter state (exp_avg, exp_avg_sq, master_param only).
# * SGD (torch's, TE's and Apex's FusedSGD): no step count; momentum lives in per-parameter
#   state, which megatron-core's checkpoint carries.
PER_PARAM, PER_GROUP, NO_STEP = "param", "group", "none"
STEP_LAYOUTS = {
    "torch.optim.sgd.SGD": NO_STEP,
    "transformer_engine.pytorch.optimizers.fused_sgd.FusedSGD": NO_STEP,
    "apex.optimizers.fused_sgd.FusedSGD": NO_STEP,
    "torch.optim.adam.Adam": PER_PARAM,
    "torch.optim.adamw.AdamW": PER_PARAM,
    "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam": PER_GROUP,
    "apex.optimizers.fused_adam.FusedAdam": PER_GROUP,
}


def step_layout(inner: torch.optim.Optimizer) -> str:
    """PER_PARAM, PER_GROUP or NO_STEP for a supported torch-level optimizer; else a PatchError that
    names it (an optimizer whose step we do not know how to resume is refused at start)."""
    return _layout(class_name(inner))


def class_name(inner: torch.optim.Optimizer) -> str:
    """`module.QualName` of a torch-level optimizer, as `STEP_LAYOUTS` keys it."""
    cls = type(inner)
    return f"{cls.__module__}.{cls.__qualname__}"


# What megatron-core 0.19's optimizer/__init__.py builds, chosen when it is imported:
# Transformer Engine's fused optimizers, else Apex's, else torch's (AdamW: decoupled decay).
_BUILT = (
    ("transformer_engine", "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam",
     "transformer_engine.pytorch.optimizers.fused_sgd.FusedSGD"),
    ("apex", "apex.optimizers.fused_adam.FusedAdam", "apex.optimizers.fused_sgd.FusedSGD"),
    ("torch", "torch.optim.adamw.AdamW", "torch.optim.sgd.SGD"),
)


def planned_optimizer(optimizer: str) -> str:
    """The inner optimizer class megatron-core builds for `optim.optimizer` ("adam" or "sgd")
    in this interpreter: its import-time choice (TE, else Apex, else torch), decided from which
    of those packages is installed, importing none of them (preflight, before any model)."""
    for package, adam, sgd in _BUILT:
        if package == "torch" or importlib.util.find_spec(package) is not None:
            return adam if optimizer == "adam" else sgd
    raise AssertionError("unreachable: torch is the last choice")


def optimizer_classes(optimizer: MegatronOptimizer) -> list[str]:
    """The class name of each inner optimizer of a built (possibly chained) one: what a
    checkpoint records (`checkpoint.files.OPTIMIZER_FILE`) and `check_resumable` takes."""
    return [class_name(opt.optimizer) for opt in chained(optimizer)]


def check_resumable(names: list[str], saved: list[str] | None = None, where: str = "") -> None:
    """A PatchError (one line) for an inner optimizer whose state the resume path does not
    know, or, with `saved` (the classes the state of the checkpoint `where` was written by),
    one that keeps Adam's step elsewhere than they did: the saved steps would not fit it.
    `names`: `optimizer_classes` of the built optimizer, or `[planned_optimizer(...)]` before
    it is built (preflight)."""
    now = {_layout(name) for name in names}
    if saved is None:
        return
    was = {STEP_LAYOUTS.get(name, "unknown") for name in saved}
    if was != now:
        raise PatchError(
            f"{where}: its optimizer state was written by {', '.join(sorted(set(saved)))} "
            f"(Adam's step kept {_kept(was)}), this run builds {', '.join(sorted(set(names)))} "
            f"({_kept(now)}): megatron-core takes Transformer Engine's, else Apex's, else "
            "torch's optimizer, by what is installed; resume where the checkpoint was written "
            "(the same optim.optimizer and packages), or start a new run from a conversion of "
            "the checkpoint (tools/convert_megatron_to_hf.py)"
        )


def _kept(layouts: set[str]) -> str:
    where = {PER_PARAM: "per parameter", PER_GROUP: "per param group", NO_STEP: "nowhere: SGD"}
    return " and ".join(sorted(where.get(x, x) for x in layouts))


def _layout(name: str) -> str:
    layout = STEP_LAYOUTS.get(name)
    if layout is None:
        raise PatchError(
            f"optimizer {name} is not supported by the Adam-step resume "
            f"(megatron_gspo.patches.optimizer knows {', '.join(sorted(STEP_LAYOUTS))}): "
            "set optim.optimizer=adam, or checkpoint.dir=null to train without checkpoints"
        )
    return layout


def adam_steps(optimizer: MegatronOptimizer) -> list[list[float | None]]:
    """Adam's step counts of every inner optimizer (None: no state yet): per parameter for
    torch Adam, per param group for FusedAdam (see STEP_LAYOUTS)."""
    out: list[list[float | None]] = []
    for opt in chained(optimizer):
        inner = opt.optimizer
        layout = step_layout(inner)
        if layout == NO_STEP:
            out.append([])
            continue
        if layout == PER_GROUP:
            out.append([float(g["step"]) if "step" in g else None for g in inner.param_groups])
            continue
        state = inner.state
        out.append(
            [float(state[p]["step"]) if "step" in state.get(p, {}) else None for p in _params(opt)]
        )
    return out


def _like(old: Any, step: float) -> Any:
    """`step` in the type of the value it replaces (tensor of the same shape/dtype, or int /
    float), never sharing storage with another parameter's or group's."""
    if torch.is_tensor(old):
        return torch.full_like(old, step)
    return int(step) if isinstance(old, int) else step


def restore_adam_steps(optimizer: MegatronOptimizer, steps: list[list[float | None]]) -> None:
    """Put back what `adam_steps` saved, one value of its own per parameter (or group)."""
    for opt, opt_steps in zip(chained(optimizer), steps, strict=True):
        inner = opt.optimizer
        layout = step_layout(inner)
        if layout == NO_STEP:
            continue
        if layout == PER_GROUP:
            for group, step in zip(inner.param_groups, opt_steps, strict=True):
                if step is not None:
                    group["step"] = _like(group.get("step", 0), step)
            continue
        state = inner.state
        for p, step in zip(_params(opt), opt_steps, strict=True):
            if step is None or "step" not in state.get(p, {}):
                continue
            state[p]["step"] = _like(state[p]["step"], step)


@dataclass(frozen=True)
class ResumeHooks:
    """What the patch installs: the three steps of an exact optimizer resume."""

    init_states_for_load: Callable[[Any], None]
    adam_steps: Callable[[Any], list[list[float | None]]]
    restore_adam_steps: Callable[[Any, list[list[float | None]]], None]


_installed: dict[str, ResumeHooks] = {}


def _check() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    init = getattr(DistributedOptimizer, _DUMMY_INIT, None)
    if init is None or list(inspect.signature(init).parameters) != ["self"]:
        raise PatchError(
            f"{_DISTRIB}.{_DUMMY_INIT} is gone or takes arguments now: find megatron-core's new "
            "way to give a fresh optimizer state before a load (megatron_gspo.patches.optimizer)"
        )
    if _SHARED_STEP not in inspect.getsource(DistributedOptimizer.load_state_dict):
        raise PatchError(
            f"{_DISTRIB}.load_state_dict no longer shares one `step` tensor among parameters: "
            "check whether torch Adam's per-parameter step now survives a dp_reshardable resume "
            "and drop the adam_steps side file if so"
        )


def _apply() -> None:
    _installed["hooks"] = ResumeHooks(init_states_for_load, adam_steps, restore_adam_steps)


OPTIMIZER_STATE_PATCH = Patch(
    name="mcore-adam-step-resume",
    package="megatron-core",
    versions=MCORE_VERSIONS,
    why="Resuming torch Adam (no Apex/TE) from a dp_reshardable checkpoint: a fresh "
    "DistributedOptimizer has no state to load into (filled through the private "
    f"{_DUMMY_INIT}, as megatron-core's own loader does), and load_state_dict sets ONE step "
    "tensor, shared by every parameter and incremented in place once per parameter, so Adam's "
    "bias correction restarts wrong. Per-parameter steps are saved next to the checkpoint "
    "(adam_steps_rank{r}.pt) and restored one tensor each.",
    remove_when="megatron-core round-trips torch Adam's per-parameter step in dp_reshardable "
    "checkpoints and exposes a public way to initialise optimizer state before a load.",
    apply_fn=_apply,
    check_fn=_check,
)
OPTIMIZER_PATCHES: tuple[Patch, ...] = (OPTIMIZER_STATE_PATCH,)


def resume_hooks() -> ResumeHooks:
    """Apply the patch (version and assumption checks, once) and return what it installed."""
    OPTIMIZER_STATE_PATCH.apply()
    return _installed["hooks"]
