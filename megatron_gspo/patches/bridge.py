"""Import fixes for megatron-bridge 0.6 without Transformer Engine / modelopt.

Needed on CPU machines and on any GPU machine without Transformer Engine installed.
"""

from __future__ import annotations

import builtins
import importlib.util
import sys
import types
from typing import Any

from megatron_gspo.patches.base import Patch, PatchError

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
        def __init__(self, *_a: Any, **_k: Any) -> None:
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


def _check_ep_gather() -> None:
    import inspect

    from megatron.bridge.models.conversion import param_mapping as pm

    fn = getattr(pm.MegatronParamMapping, "gather_from_ep_ranks", None)
    params = list(inspect.signature(fn).parameters) if fn else []
    if params != ["self", "megatron_weights", "megatron_module", "hf_param_name"]:
        raise PatchError(
            f"MegatronParamMapping.gather_from_ep_ranks changed ({params}); review "
            "megatron_gspo.weights.stream.experts_to_ep_rank0"
        )


_COMMON = dict(package="megatron-bridge", versions=BRIDGE_VERSIONS)
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
        "Applied scoped, only during our export, by megatron_gspo.weights.stream."
        "experts_to_ep_rank0, which runs this check first.",
        remove_when="megatron-bridge can export experts to one destination rank.",
        apply_fn=lambda: None,
        check_fn=_check_ep_gather,
        **_COMMON,
    ),
)
EP_GATHER_PATCH = BRIDGE_PATCHES[-1]


def apply_bridge_imports() -> None:
    """Make `import megatron.bridge` and HF export work without TE / modelopt (idempotent)."""
    for patch in BRIDGE_PATCHES:
        patch.apply()
