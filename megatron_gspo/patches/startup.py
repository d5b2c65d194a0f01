"""Start-up time fixes: what every trainer rank imports and never uses.

Every rank of a launch (and every process that builds a model) imports megatron-core and
megatron-bridge; on a 2-core CPU machine that is most of a launch's start-up. Two parts of it are
pure waste for the models this package trains, and each is cut by a `Patch` here:

* `mcore-deferred-jit-fuser` (CPU only): megatron-core decorates ~15 fused kernels with
  `torch.compile` while it is imported (`megatron.core.jit.jit_fuser`); the first such call
  imports torch._inductor's compiler (`compile_fx`, seconds per process on 2 cores; a rank
  imports torch._dynamo anyway, through transformers). On CPU every fusion is
  off (`megatron.model.make_provider`), so none of those kernels ever runs. During the import of
  megatron-core, `torch.compile` is a deferred version that compiles on the decorated function's
  first call, exactly as `torch.compile` itself does (it compiles lazily too).
* `bridge-lazy-model-registry`: `import megatron.bridge` imports all of its ~60 model bridges
  (and the diffusion ones), each with its Hugging Face modelling code, to register them. Here
  `megatron.bridge` and `megatron.bridge.models` are installed as their packages without running
  their `__init__`: `AutoBridge` and the Qwen bridges are imported on first use, and
  `load_model_bridges(architectures)` (called before a model is loaded) registers the bridge of
  any other architecture by running the two `__init__`s in full, as the plain import would have.
  Any other attribute of either package runs them too: nothing the plain import offered is lost.
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

MCORE_VERSIONS = ("0.19.2",)
BRIDGE_VERSIONS = ("0.6.2",)


def _source(module: str, rel: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(f"{module} is not installed")
    with open(f"{list(spec.submodule_search_locations)[0]}/{rel}", encoding="utf-8") as f:
        return f.read()


# --- mcore-deferred-jit-fuser ----------------------------------------------------------------


def deferred_compile(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compile` (`compile_fn`) that compiles on the first call, not at decoration.

    `deferred_compile(c)(fn, **kw)` (or `@deferred_compile(c)` / `deferred_compile(c)(**kw)(fn)`)
    returns a function that, on its first call, runs `c(fn, **kw)` once and from then on calls
    what that returned; `c` is never called for a function that is never called."""

    def compile_(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # used as `@torch.compile(...)`
            return functools.partial(compile_, **kwargs)
        compiled: list[Any] = []
        lock = threading.Lock()

        @functools.wraps(model)
        def call(*args: Any, **kw: Any) -> Any:
            if not compiled:
                with lock:
                    if not compiled:
                        compiled.append(compile_fn(model, **kwargs))
            return compiled[0](*args, **kw)

        return call

    return compile_


def _check_deferred_jit() -> None:
    if "jit_fuser = torch.compile" not in _source("megatron.core", "jit.py"):
        raise PatchError(
            "megatron.core.jit no longer binds torch.compile as jit_fuser: review "
            "patch mcore-deferred-jit-fuser (megatron_gspo/patches/startup.py)"
        )


def _apply_deferred_jit() -> None:
    if "megatron.core" in sys.modules:  # its kernels are decorated already: nothing to defer
        return
    import torch

    from megatron_gspo.patches.cpu_runtime import CPU_PATCHES

    real = torch.compile
    torch.compile = deferred_compile(real)  # type: ignore[assignment]
    try:  # the paged-stash stub (whose check imports megatron.core) first, as apply_cpu_runtime
        CPU_PATCHES[0].apply()
        import megatron.core.jit  # noqa: F401  (imports megatron.core, decorating every kernel)
    finally:
        torch.compile = real


DEFERRED_JIT_PATCH = Patch(
    name="mcore-deferred-jit-fuser",
    package="megatron-core",
    versions=MCORE_VERSIONS,
    why="`import megatron.core` decorates its fused kernels with torch.compile "
    "(megatron.core.jit.jit_fuser), which imports torch._inductor's compile_fx: seconds of "
    "every process's start-up on 2 CPU cores, for kernels that never run on CPU (every "
    "fusion is off there). CPU only: the decorated kernels compile on their first call.",
    remove_when="megatron-core decorates lazily, or torch.compile stops importing the "
    "inductor at decoration time.",
    apply_fn=_apply_deferred_jit,
    check_fn=_check_deferred_jit,
)


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


def _architectures(config: Any) -> Any:
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
            def __init__(self: Any, hf_pretrained: Any, *args: Any, **kwargs: Any) -> None:
                load_model_bridges(_architectures(hf_pretrained))
                init(self, hf_pretrained, *args, **kwargs)

            @functools.wraps(validate)
            def _validate_config(cls: type, config: Any, *args: Any, **kwargs: Any) -> None:
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

STARTUP_PATCHES: tuple[Patch, ...] = (DEFERRED_JIT_PATCH, LAZY_REGISTRY_PATCH)
