"""Start-up time fix: what every trainer rank imports and never uses.

Every rank of a launch (and every process that builds a model) imports megatron-bridge; on a
2-core CPU machine that is a large part of a launch's start-up. `bridge-lazy-model-registry`:
`import megatron.bridge` imports all of its ~60 model bridges (and the diffusion ones), each
with its Hugging Face modelling code, to register them. Here `megatron.bridge` and
`megatron.bridge.models` are installed as their packages without running their `__init__`:
`AutoBridge` and the Qwen bridges are imported on first use, and `AutoBridge` calls
`load_model_bridges(architectures)` before it looks a model up, which registers the bridge of
any other architecture by running the two `__init__`s in full, as the plain import would have.
Any other attribute of either package runs them too: nothing the plain import offered is lost.
(Deferring megatron-core's `torch.compile` decorations was tried and dropped: the MoE router
runs a compiled kernel on CPU too, so it only moved the compiler's import into the first step.)
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from megatron_gspo.patches.base import Patch, PatchError

BRIDGE_VERSIONS = ("0.6.2",)


def _source(module: str, rel: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(f"{module} is not installed")
    with open(f"{list(spec.submodule_search_locations)[0]}/{rel}", encoding="utf-8") as f:
        return f.read()


# --- bridge-lazy-model-registry --------------------------------------------------------------

_PACKAGES = ("megatron.bridge.models", "megatron.bridge")  # run in this order when completed
_DEFAULT_BRIDGES = "megatron.bridge.models.qwen"  # Qwen2 / Qwen3 / Qwen3-MoE / Qwen3.5
# Architectures (HF config `architectures`) whose bridge the module above registers.
DEFAULT_ARCHITECTURES = frozenset({"Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})
_state: dict[str, Any] = {"complete": False}
_lock = threading.RLock()


def _check_lazy_registry() -> None:
    init = _source("megatron.bridge", "__init__.py")
    for line in (
        "import megatron.bridge.diffusion.models",
        "import megatron.bridge.models",
        "from megatron.bridge.models.conversion.auto_bridge import AutoBridge",
    ):
        if line not in init:
            raise PatchError(
                f"megatron/bridge/__init__.py no longer has {line!r}: review patch "
                "bridge-lazy-model-registry (megatron_gspo/patches/startup.py)"
            )
    if "Qwen3MoEBridge" not in _source("megatron.bridge", "models/qwen/__init__.py"):
        raise PatchError("megatron.bridge.models.qwen no longer registers Qwen3MoEBridge")
    auto = _source("megatron.bridge", "models/conversion/auto_bridge.py")
    for line in (
        "def __init__(self, hf_pretrained",
        "def _validate_config(cls, config",
        "def list_supported_models(cls)",
        "get_model_bridge._exact_types",
    ):
        if line not in auto:
            raise PatchError(
                f"AutoBridge no longer has {line!r}: review patch bridge-lazy-model-registry"
            )


def complete_bridge_registry() -> None:
    """Run `megatron.bridge.models`' and `megatron.bridge`'s own `__init__` (every model
    bridge registered, every name they export defined), as `import megatron.bridge` does."""
    with _lock:
        if _state["complete"]:
            return
        _state["complete"] = True
        for name in _PACKAGES:
            module = sys.modules[name]
            module.__dict__.pop("__getattr__", None)
            module.__spec__.loader.exec_module(module)  # type: ignore[union-attr]


def _default_bridges() -> None:
    with _lock:
        importlib.import_module(_DEFAULT_BRIDGES)


def _architectures(config: object) -> list[str] | None:
    """The HF `architectures` of a config, a pretrained wrapper (`.config`) or None."""
    return getattr(getattr(config, "config", config), "architectures", None)


def _auto_bridge() -> type:
    """`AutoBridge`, with the Qwen bridges registered and its three registry look-ups preceded
    by `load_model_bridges` (so an AutoBridge of any architecture finds its bridge)."""
    _default_bridges()
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge

    with _lock:
        if not getattr(AutoBridge, "_mgspo_lazy", False):
            init, validate = AutoBridge.__init__, AutoBridge._validate_config.__func__
            listed = AutoBridge.list_supported_models.__func__

            @functools.wraps(init)
            def __init__(
                self: object, hf_pretrained: object, *args: object, **kwargs: object
            ) -> None:
                load_model_bridges(_architectures(hf_pretrained))
                init(self, hf_pretrained, *args, **kwargs)

            @functools.wraps(validate)
            def _validate_config(
                cls: type, config: object, *args: object, **kwargs: object
            ) -> None:
                load_model_bridges(_architectures(config))
                validate(cls, config, *args, **kwargs)

            @functools.wraps(listed)
            def list_supported_models(cls: type) -> list[str]:
                complete_bridge_registry()
                return listed(cls)

            AutoBridge.__init__ = __init__  # type: ignore[method-assign]
            AutoBridge._validate_config = classmethod(_validate_config)  # type: ignore[assignment]
            AutoBridge.list_supported_models = classmethod(list_supported_models)  # type: ignore[assignment]
            AutoBridge._mgspo_lazy = True  # type: ignore[attr-defined]
    return AutoBridge


def _package_getattr(package: str) -> Callable[[str], Any]:
    def getattr_(name: str) -> Any:
        if name.startswith("__"):  # dunder probes (copy, pickle, inspect): as a plain module
            raise AttributeError(name)
        if package == "megatron.bridge" and name == "AutoBridge":
            return _auto_bridge()
        if importlib.util.find_spec(f"{package}.{name}") is not None:  # a subpackage: as is
            return importlib.import_module(f"{package}.{name}")
        complete_bridge_registry()
        return getattr(sys.modules[package], name)

    return getattr_


def _apply_lazy_registry() -> None:
    if "megatron.bridge" in sys.modules:  # imported already (in full): nothing to defer
        return
    import megatron  # namespace package: holds megatron.core too

    for name in reversed(_PACKAGES):  # the parent first
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            raise PatchError(f"{name} is not installed")
        module = importlib.util.module_from_spec(spec)
        module.__getattr__ = _package_getattr(name)  # type: ignore[method-assign]
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent] if parent != "megatron" else megatron, child, module)


def load_model_bridges(architectures: Sequence[str] | None) -> None:
    """Register the bridge of each HF architecture before a model is loaded: the Qwen bridges
    (`DEFAULT_ARCHITECTURES`) by their own module, any other by every bridge's (called by
    `AutoBridge` itself once this patch is applied)."""
    _default_bridges()
    if not architectures or not set(architectures) <= DEFAULT_ARCHITECTURES:
        complete_bridge_registry()


LAZY_REGISTRY_PATCH = Patch(
    name="bridge-lazy-model-registry",
    package="megatron-bridge",
    versions=BRIDGE_VERSIONS,
    why="`import megatron.bridge` imports and registers all ~60 model bridges and the "
    "diffusion ones, with their HF modelling code (seconds of every rank's start-up on 2 CPU "
    "cores); a run needs one. AutoBridge and the Qwen bridges load on first use; "
    "load_model_bridges() registers every bridge for any other architecture, and any other "
    "name of megatron.bridge(.models) runs their __init__ in full.",
    remove_when="megatron-bridge registers its model bridges lazily.",
    apply_fn=_apply_lazy_registry,
    check_fn=_check_lazy_registry,
)

STARTUP_PATCHES: tuple[Patch, ...] = (LAZY_REGISTRY_PATCH,)
