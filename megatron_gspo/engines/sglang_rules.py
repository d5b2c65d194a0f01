"""What SGLang (0.5.23, `constraints-engine.txt`) allows and implies, as functions of the
`rollout.launch` section: the config's cross-checks and derived values, the planner's defaults,
the preflight's interpreter check and the engines' context length. An SGLang upgrade revisits
this file; the callers (`config.py`, `plan/planner.py`, `plan/memory.py`, `run/preflight.py`,
`data/prompts.py`) name no SGLang rule themselves (`tests/test_architecture.py`).

No torch: the config and the planner load without it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from megatron_gspo.config_io import FLOAT_DTYPES, require
from megatron_gspo.engines.launch import LaunchConfig
from megatron_gspo.layout import HFConfig, num_experts

__all__ = [
    "BACKEND",
    "DEFAULT_MEM_FRACTION",
    "check_engine_interpreter",
    "check_engine_layout",
    "check_memory_release",
    "check_routed_experts",
    "check_weight_updates",
    "checksum_device",
    "default_launch",
    "engine_context_length",
    "received_dtype",
    "serves_sglang",
]

BACKEND: Final = "sglang"
"""`rollout.launch.backend` of a real SGLang server (the other one is "embedded")."""

DEFAULT_MEM_FRACTION = 0.85
"""SGLang's own share of GPU memory when rollout.launch.mem_fraction_static is null (0.5.x picks
0.79-0.88 by GPU size and TP; the planner takes the middle so a missing setting is not
optimistic)."""


def serves_sglang(launch: LaunchConfig | None) -> bool:
    """Whether the job launches real SGLang servers."""
    return launch is not None and launch.backend == BACKEND


def default_launch() -> LaunchConfig:
    """The planner's engines when the config launches none (`rollout.launch: null`)."""
    return LaunchConfig(backend=BACKEND)


def check_weight_updates(launch: LaunchConfig | None, transport: str) -> None:
    """SGLang 0.5.23 applies tensor and distributed weight updates with dp_size 1 only."""
    require(
        launch is None or launch.dp_size == 1 or transport == "disk",
        f"rollout.launch.dp_size={launch.dp_size if launch else 1}: SGLang 0.5.23 applies "
        "tensor and distributed weight updates only with dp_size 1; launch more engines "
        "(rollout.launch.num_engines) or set weights.transport=disk",
    )


def check_memory_release(launch: LaunchConfig | None) -> None:
    """Colocated engines release and resume memory, which kills SGLang 0.5.23 on CPU."""
    require(
        launch is None
        or not (serves_sglang(launch) and launch.device == "cpu" and launch.colocated),
        "rollout.launch.colocated=true cannot run a real SGLang server on CPU "
        "(rollout.launch.device=cpu): SGLang 0.5.23's memory release/resume ends in "
        "torch.cuda.synchronize() and kills the CPU server; set rollout.launch.colocated=false",
    )


def check_routed_experts(launch: LaunchConfig | None) -> None:
    """rl.routing_replay needs the engines' routed experts, which SGLang 0.5.23 cannot capture
    on CPU."""
    require(
        launch is None or not (serves_sglang(launch) and launch.device == "cpu"),
        "rl.routing_replay=true needs routed experts from the engines, and SGLang 0.5.23 "
        "cannot capture them on CPU (its --enable-return-routed-experts buffer is pinned with "
        "cudaHostRegister); set rollout.launch.backend=embedded, run SGLang on GPUs, or set "
        "rl.routing_replay=false",
    )


def checksum_device(launch: LaunchConfig) -> str | None:
    """Where the engines hash their weights (`weights.engine_device=auto`): SGLang hashes CUDA
    tensors with its Triton kernel, every other device with sha256 (`engines.wire`); None:
    SGLang's default device, a GPU's there, decided where the check runs."""
    if launch.backend != BACKEND or launch.device not in (None, "cuda"):
        return "cpu"
    return "cuda" if launch.device == "cuda" else None


def received_dtype(launch: LaunchConfig | None) -> str | None:
    """The dtype a real server casts what it receives to (its own `rollout.launch.dtype`), so
    the trainer sends that (its checksums match only then); None: no such rule."""
    if launch is not None and serves_sglang(launch) and launch.dtype in FLOAT_DTYPES:
        return FLOAT_DTYPES[launch.dtype]
    return None


def check_engine_layout(launch: LaunchConfig, hf: HFConfig, gpus_per_node: int) -> None:
    """SGLang's own layout rules for one engine (the planner's: `hf` is the model's HF
    config), named by config key."""
    tp = launch.tp_size
    require(tp >= 1, f"rollout.launch.tp_size={tp} must be >= 1")
    require(
        gpus_per_node % tp == 0,
        f"rollout.launch.tp_size={tp} does not divide --gpus-per-node={gpus_per_node} (an engine "
        "stays on one node); change rollout.launch.tp_size",
    )
    require(
        hf.num_attention_heads % tp == 0,
        f"rollout.launch.tp_size={tp} does not divide the model's num_attention_heads="
        f"{hf.num_attention_heads}; change rollout.launch.tp_size",
    )
    experts = num_experts(hf)
    ep = launch.ep_size
    require(
        ep == 1 or (tp % ep == 0 and experts is not None and experts % ep == 0),
        f"rollout.launch.ep_size={ep} must divide rollout.launch.tp_size={tp} and the model's "
        f"num_experts={experts}; change rollout.launch.ep_size",
    )


def check_engine_interpreter(launch: LaunchConfig | None) -> None:
    """A real server without rollout.launch.python needs an interpreter that holds SGLang
    (`engines.interpreter`); an explicit one is taken as given (a path on the engine host)."""
    if launch is not None and serves_sglang(launch) and launch.python is None:
        from megatron_gspo.engines.interpreter import sglang_python

        sglang_python()


# config.json keys SGLang reads the context length from, in its order: the first present one
# (times the rope scaling factor where SGLang applies it) is the engine's context.
_CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                 "max_position_embeddings")  # fmt: skip


def engine_context_length(hf_path: str | Path, extra_args: Sequence[str] = ()) -> int | None:
    """The context length of an SGLang (or embedded) engine serving `hf_path`:
    `--context-length` among its launch flags, else the rule of SGLang's `get_context_length`
    on the model's config.json; None when the config names none (no filter then)."""
    args = list(extra_args)
    for i, arg in enumerate(args):
        if arg == "--context-length" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--context-length="):
            return int(arg.partition("=")[2])
    try:
        config = json.loads((Path(hf_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    rope = config.get("rope_scaling") or {}
    factor = rope.get("factor", 1) if isinstance(rope, dict) else 1
    if not isinstance(rope, dict) or "original_max_position_embeddings" in rope:
        factor = 1
    elif rope.get("rope_type") == "llama3":
        factor = 1
    for key in _CONTEXT_KEYS:
        if isinstance(config.get(key), int | float):
            return int(factor * config[key])
    return None
