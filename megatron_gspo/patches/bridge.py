"""Import fixes for megatron-bridge 0.6 without Transformer Engine / modelopt.

Needed on CPU machines and on any GPU machine without Transformer Engine installed.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from megatron_gspo.patches.base import Patch, PatchError

if TYPE_CHECKING:
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping
    from megatron.core.transformer.module import MegatronModule

BRIDGE_VERSIONS = ("0.6.2",)
_LORA_MODULE = "megatron.bridge.peft.lora_layers"


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _bridge_file(rel: str) -> str:
    spec = importlib.util.find_spec("megatron.bridge")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("megatron.bridge is not installed")
    path = f"{list(spec.submodule_search_locations)[0]}/{rel}"
    with open(path, encoding="utf-8") as f:
        return f.read()


def _check_lora_te() -> None:
    if "import transformer_engine.pytorch as te" not in _bridge_file("peft/lora_layers.py"):
        raise PatchError(f"{_LORA_MODULE} no longer imports TE unconditionally: drop the patch")


def _fake_te() -> types.ModuleType:
    te = types.ModuleType("transformer_engine.pytorch")

    class _AnyAttr(type):  # annotations reach into e.g. te.ops.Sequential
        def __getattr__(cls, _name: str) -> type:
            return cls

    class _Missing(metaclass=_AnyAttr):  # TE-LoRA classes subclass these; never instantiated
        def __init__(self, *_a: object, **_k: object) -> None:
            raise RuntimeError("Transformer Engine is not installed")

    te.__getattr__ = lambda name: _Missing  # type: ignore[method-assign]
    return te


def _apply_lora_te() -> None:
    if _have("transformer_engine") or _LORA_MODULE in sys.modules:
        return
    real_import = builtins.__import__
    fake = _fake_te()

    # Served ONLY to lora_layers: a global fake TE would make megatron-core believe TE exists
    # (HAVE_TE=True) and take TE code paths.
    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):  # type: ignore[no-untyped-def]
        if (
            name.startswith("transformer_engine")
            and (globals or {}).get("__name__") == _LORA_MODULE
        ):
            return types.SimpleNamespace(pytorch=fake) if not fromlist else fake
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = guarded_import
    try:
        import megatron.bridge  # noqa: F401
        import megatron.bridge.peft.lora_layers  # noqa: F401
    finally:
        builtins.__import__ = real_import


def _check_modelopt() -> None:
    if "from modelopt" not in _bridge_file("models/conversion/auto_bridge.py"):
        raise PatchError("AutoBridge no longer imports modelopt: drop patch bridge-modelopt-stub")


def _apply_modelopt() -> None:
    if _have("modelopt"):
        return
    for name in ("modelopt", "modelopt.torch", "modelopt.torch.quantization"):
        sys.modules.setdefault(name, types.ModuleType(name))
    utils = types.ModuleType("modelopt.torch.quantization.utils")
    utils.is_quantized = lambda _model: False  # type: ignore[attr-defined]
    sys.modules.setdefault("modelopt.torch.quantization.utils", utils)


_EP_GATHER = "megatron.bridge.models.conversion.param_mapping.MegatronParamMapping"
_EP_GATHER_PARAMS = ["self", "megatron_weights", "megatron_module", "hf_param_name"]
# The override only acts inside `ep_gather_to_rank0()`: process-global like the bridge's own
# collectives (every rank enters and leaves the scope in the same export call).
_ep_scope = {"depth": 0}
_ep_original: dict[str, Any] = {}


def _check_ep_gather() -> None:
    import inspect

    from megatron.bridge.models.conversion import param_mapping as pm

    fn = _ep_original.get("fn", getattr(pm.MegatronParamMapping, "gather_from_ep_ranks", None))
    params = list(inspect.signature(fn).parameters) if fn else []
    if params != _EP_GATHER_PARAMS:
        raise PatchError(
            f"{_EP_GATHER}.gather_from_ep_ranks changed ({params}); review "
            "megatron_gspo.patches.bridge._gather_to_ep_rank0"
        )


def _expert_names_on_ep_ranks(
    self: MegatronParamMapping, module: MegatronModule | None, hf_param_name: str | None
) -> list[str]:
    """The HF name this rank's expert slot has on each EP rank, as the bridge numbers experts
    (its PP broadcast of the experts-per-rank count included, call for call)."""
    import re

    from megatron.bridge.utils.common_utils import extract_expert_number_from_param

    per_rank = None if module is None else self._get_config(module).num_moe_experts
    per_rank = per_rank // self.ep_size if per_rank is not None else None
    per_rank = self.broadcast_obj_from_pp_rank(per_rank, "num_experts_per_rank")
    local = extract_expert_number_from_param(self.megatron_param) % per_rank
    names = [
        re.sub(r"experts\.(\d+)", f"experts.{local + per_rank * i}", str(hf_param_name))
        for i in range(self.ep_size)
    ]
    return names


def _gather_to_ep_rank0(
    self: MegatronParamMapping,
    weights: Any,
    module: MegatronModule | None,
    hf_param_name: str | None,
) -> dict:
    """`gather_from_ep_ranks` with a `gather` to EP rank 0 instead of an all-gather.

    Returns the per-expert dict on EP rank 0 and `{}` elsewhere (the bridge then yields nothing
    for those names there). Everything else (expert-id arithmetic, the PP-broadcast of the
    experts-per-rank count) is kept call for call, so all ranks still issue the same collectives
    in the same order."""
    import torch

    names = _expert_names_on_ep_ranks(self, module, hf_param_name)
    dst = torch.distributed.get_global_rank(self.ep_group, 0)
    weights = weights.contiguous()
    if self.ep_rank != 0:
        torch.distributed.gather(weights, None, dst=dst, group=self.ep_group)
        return {}
    parts = [torch.empty_like(weights) for _ in range(self.ep_size)]
    torch.distributed.gather(weights, parts, dst=dst, group=self.ep_group)
    return dict(zip(names, parts, strict=True))


_ep_local: dict[str, tuple[list[str], Any]] = {}
"""Inside `ep_local_experts()`: local expert name -> (its name on every EP rank, EP group)."""


def _keep_local(
    self: MegatronParamMapping,
    weights: Any,
    module: MegatronModule | None,
    hf_param_name: str | None,
) -> dict:
    """`gather_from_ep_ranks` without a collective: this rank's expert under its own global
    name, recorded in `_ep_local` with the names the same slot has on every EP rank (the same
    arithmetic as `_gather_to_ep_rank0`, including its cached PP broadcast), so that
    `weights.ep_batch` gathers many experts in one collective."""
    names = _expert_names_on_ep_ranks(self, module, hf_param_name)
    _ep_local[names[self.ep_rank]] = (names, self.ep_group)
    return {names[self.ep_rank]: weights}


def gather_from_ep_ranks(
    self: MegatronParamMapping,
    megatron_weights: Any,
    megatron_module: MegatronModule | None,
    hf_param_name: str | None,
) -> dict:
    """Installed on `MegatronParamMapping`: the bridge's all-gather, or inside
    `ep_gather_to_rank0()` (and with EP > 1) a gather to EP rank 0, or inside
    `ep_local_experts()` no collective (the caller batches the gathers)."""
    original = _ep_original["fn"]
    if _ep_scope["depth"] == 0 or self.ep_size == 1:
        return original(self, megatron_weights, megatron_module, hf_param_name)
    if _ep_scope.get("local"):
        return _keep_local(self, megatron_weights, megatron_module, hf_param_name)
    return _gather_to_ep_rank0(self, megatron_weights, megatron_module, hf_param_name)


def _apply_ep_gather() -> None:
    from megatron.bridge.models.conversion import param_mapping as pm

    if "fn" not in _ep_original:
        _ep_original["fn"] = pm.MegatronParamMapping.gather_from_ep_ranks
    pm.MegatronParamMapping.gather_from_ep_ranks = gather_from_ep_ranks


@contextlib.contextmanager
def ep_gather_to_rank0() -> Iterator[None]:
    """While active, the bridge's expert export gathers to EP rank 0 instead of to all EP ranks
    (applies the `bridge-ep-gather-to-rank0` patch first, with its checks)."""
    EP_GATHER_PATCH.apply()
    _ep_scope["depth"] += 1
    try:
        yield
    finally:
        _ep_scope["depth"] -= 1


@contextlib.contextmanager
def ep_local_experts() -> Iterator[dict[str, tuple[list[str], Any]]]:
    """While active, the bridge's expert export does no EP collective: each EP rank yields its
    own experts, and the yielded name maps in the returned registry to (the slot's name on
    every EP rank, the EP group) until the caller pops it (`weights.ep_batch` gathers them per
    bucket)."""
    EP_GATHER_PATCH.apply()
    _ep_scope["depth"] += 1
    _ep_scope["local"] = _ep_scope.get("local", 0) + 1
    try:
        yield _ep_local
    finally:
        _ep_scope["local"] -= 1
        _ep_scope["depth"] -= 1
        if not _ep_scope["local"]:
            _ep_local.clear()


_COMMON: dict[str, Any] = dict(package="megatron-bridge", versions=BRIDGE_VERSIONS)
BRIDGE_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="bridge-lora-te-import",
        why="`import megatron.bridge` -> ModuleNotFoundError: transformer_engine, from the "
        "unconditional import in peft/lora_layers.py (TE is used only inside TE-LoRA classes).",
        remove_when="megatron-bridge guards that import.",
        apply_fn=_apply_lora_te,
        check_fn=_check_lora_te,
        **_COMMON,
    ),
    Patch(
        name="bridge-modelopt-stub",
        why="AutoBridge.save_hf_weights/export -> ModuleNotFoundError: modelopt (lazy "
        "`from modelopt.torch.quantization.utils import is_quantized`); no model of ours is "
        "modelopt-quantised.",
        remove_when="megatron-bridge makes modelopt optional there.",
        apply_fn=_apply_modelopt,
        check_fn=_check_modelopt,
        **_COMMON,
    ),
    Patch(
        name="bridge-ep-gather-to-rank0",
        why="The bridge's HF export all-gathers every expert to every EP rank "
        "(MegatronParamMapping.gather_from_ep_ranks); weight sync needs them on the sender only. "
        "The installed method gathers to EP rank 0 only inside ep_gather_to_rank0() (entered by "
        "megatron_gspo.weights.stream.experts_to_ep_rank0) and calls the bridge's own elsewhere.",
        remove_when="megatron-bridge can export experts to one destination rank.",
        apply_fn=_apply_ep_gather,
        check_fn=_check_ep_gather,
        **_COMMON,
    ),
)
EP_GATHER_PATCH = BRIDGE_PATCHES[-1]


def apply_bridge_imports() -> None:
    """Make `import megatron.bridge` and HF export work without TE / modelopt, and install the
    EP-gather override (inert outside `ep_gather_to_rank0()`). Idempotent. First the start-up
    fix (megatron_gspo/patches/startup.py): megatron-bridge's model bridges registered on
    first use."""
    from megatron_gspo.patches.startup import LAZY_REGISTRY_PATCH

    LAZY_REGISTRY_PATCH.apply()
    for patch in BRIDGE_PATCHES:
        patch.apply()
