"""Version-pinned runtime fixes to upstream libraries.

Each fix is a `Patch`: why it exists, which upstream versions it was written and tested against,
when to delete it, an `apply()` and a `check()` that fails loudly if an upgrade breaks the
assumption the fix rests on. Nothing here runs on import; callers apply fixes explicitly:

    from megatron_gspo.patches import apply_cpu_runtime
    apply_cpu_runtime()          # before building megatron-core models on a machine with no GPU
    P2P_ORDER_PATCH.apply()      # any device, pipeline parallel (init_megatron does both)

Fixes used only inside one of our functions are applied by that function through the registry:
`OPTIMIZER_STATE_PATCH` by the checkpoint code (`resume_hooks()`), the bridge's EP-gather
override by `apply_bridge_imports()` (scoped by `weights.stream.experts_to_ep_rank0`).

`python -m megatron_gspo.patches` prints the manifest (also kept in `patches/README.md`).
"""

from __future__ import annotations

from megatron_gspo.patches.base import Patch, PatchError
from megatron_gspo.patches.bridge import BRIDGE_PATCHES, apply_bridge_imports
from megatron_gspo.patches.cpu_runtime import CPU_PATCHES, apply_cpu_runtime, cpu_runtime_active
from megatron_gspo.patches.optimizer import OPTIMIZER_PATCHES, OPTIMIZER_STATE_PATCH
from megatron_gspo.patches.pipeline import P2P_ORDER_PATCH, PIPELINE_PATCHES
from megatron_gspo.patches.startup import STARTUP_PATCHES, load_model_bridges

ALL_PATCHES: tuple[Patch, ...] = (
    *STARTUP_PATCHES,
    *CPU_PATCHES,
    *BRIDGE_PATCHES,
    *PIPELINE_PATCHES,
    *OPTIMIZER_PATCHES,
)

__all__ = [
    "ALL_PATCHES",
    "BRIDGE_PATCHES",
    "CPU_PATCHES",
    "OPTIMIZER_PATCHES",
    "OPTIMIZER_STATE_PATCH",
    "P2P_ORDER_PATCH",
    "PIPELINE_PATCHES",
    "Patch",
    "PatchError",
    "STARTUP_PATCHES",
    "apply_bridge_imports",
    "apply_cpu_runtime",
    "cpu_runtime_active",
    "load_model_bridges",
]
