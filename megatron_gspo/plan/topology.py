"""Topology check of a launch plan: what a GPU cluster refuses that a CPU run never shows.

`topology_problems(cfg, placement)` returns one line per refusal, each naming the config key
(or planner flag) and the fix; the planner (`python -m megatron_gspo.plan`) prints them as the
topology verdict and exits 2, the trainer's preflight runs the checks it can from inside the
job. The rules:

* NCCL refuses a communicator in which two ranks use one GPU: colocated engines (sharing the
  trainer's GPUs) cannot join the `distributed` transport's group with trainer rank 0.
* CUDA IPC handles (the `tensor` transport) open only on the node that made them: every engine
  must be on a sender's node: one node with `weights.senders=one`; any number of colocated
  nodes with `weights.senders=owners` (each node's ranks feed its engines) when every
  expert-parallel group lies within a node.
* torchrun's c10d rendezvous gives global rank 0 (which hosts the weight-update rendezvous) to
  any node: `weights.master_address` must be resolved at run time on rank 0, not pinned.
* A block-FP8 push (`weights.fp8`) loads only into an engine started from a block-FP8
  checkpoint whose `quantization_config` matches what is sent (SGLang's online `--quantization
  fp8` of a BF16 checkpoint has no `weight_scale_inv` parameters); a BF16 push into a block-FP8
  engine is refused the same way.
* Verification (`weights.verify_every`) needs per-rank shards the sender can reproduce: head,
  kv-head and expert counts divisible as SGLang shards them, FP8 shards aligned to the
  128x128 blocks (SGLang itself refuses unaligned ones at start-up).
* Ports of one job are distinct, and free where the planner runs.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_gspo.config import Config
from megatron_gspo.engines import fp8_blocks as fp8_lib
from megatron_gspo.layout import HFConfigLike, hf_value

VERIFIABLE_MODEL_TYPES = ("qwen3_moe", "qwen3", "qwen2", "qwen2_moe", "llama", "mistral")
"""Families whose SGLang parameters `engines/weight_shards.py` reproduces (q/k/v, gate/up,
experts)."""


@dataclass(frozen=True)
class Placement:
    """Where a job's processes run, as the planner lays it out."""

    nodes: int
    """Nodes of the job."""
    gpus_per_node: int
    rollout_nodes: int = 0
    """Nodes given to engines only; 0: engines share the trainer's nodes and GPUs."""
    ports: tuple[tuple[str, int], ...] = ()
    """(key, port) of every listening port the job opens on its first node."""
    check_free: bool = False
    """Also check that those ports can be bound here (the planner runs on the first node)."""

    @property
    def trainer_nodes(self) -> int:
        return self.nodes - self.rollout_nodes

    @property
    def engine_nodes(self) -> int:
        return self.rollout_nodes or self.nodes


def read_json_config(path: str | Path) -> dict[str, Any] | None:
    """config.json of a checkpoint directory, None when unreadable."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def transport_problems(cfg: Config, p: Placement) -> list[str]:
    """NCCL one rank per GPU, CUDA IPC within a node, rank 0's rendezvous address."""
    w = cfg.weights
    out = []
    colocated = p.rollout_nodes == 0
    if w.transport == "distributed" and colocated and (w.backend or "nccl") == "nccl":
        out.append(
            "weights.transport=distributed with engines on the trainer's GPUs (--rollout-nodes 0)"
            " puts trainer rank 0 and engine 0's TP rank 0 on one GPU in one NCCL communicator,"
            " which NCCL refuses; set weights.transport=tensor (one node) or give the engines"
            " nodes of their own (--rollout-nodes)"
        )
    # With weights.senders=owners each node's ranks push the whole model to that node's
    # engines (weights/owners.py): colocated runs on any number of nodes, provided every
    # expert-parallel group lies within a node (each node then holds every expert).
    owners = w.senders == "owners"
    if w.transport == "tensor" and p.rollout_nodes > 0:
        out.append(
            f"weights.transport=tensor (CUDA IPC) reaches only engines on the sender's node, but "
            f"the plan puts engines on {p.engine_nodes} engine nodes of their own; use "
            "weights.transport=distributed with --rollout-nodes"
        )
    elif w.transport == "tensor" and p.nodes > 1 and not owners:
        out.append(
            f"weights.transport=tensor (CUDA IPC) reaches only engines on the sender's node, but "
            f"the plan puts engines on all {p.nodes} nodes; set weights.senders=owners (each "
            "node's ranks feed its own engines), run on one node, or use --rollout-nodes with "
            "weights.transport=distributed"
        )
    elif w.transport == "tensor" and p.nodes > 1:
        group = cfg.parallel.ep * cfg.parallel.expert_tp
        if p.gpus_per_node % group:
            out.append(
                f"weights.senders=owners with weights.transport=tensor on {p.nodes} nodes needs "
                f"every expert-parallel group within a node, but parallel.ep x expert TP = "
                f"{group} does not divide {p.gpus_per_node} GPUs per node; lower parallel.ep, or "
                "use --rollout-nodes with weights.transport=distributed"
            )
    if w.master_address and p.trainer_nodes > 1:
        out.append(
            f"weights.master_address={w.master_address} is pinned, but torchrun's c10d "
            "rendezvous may put global rank 0 (the weight-update master) on any of the "
            f"{p.trainer_nodes} trainer nodes; leave weights.master_address unset (rank 0 "
            "resolves its own address at run time)"
        )
    return out


def fp8_problems(cfg: Config, engine_model_path: str | None) -> list[str]:
    """An FP8 push only to a block-FP8 engine with the matching quantization_config, and a BF16
    push never to one."""
    launch = cfg.rollout.launch
    if engine_model_path is None or cfg.rollout.embedded:
        return []  # the embedded engine's FP8 emulation quantises a BF16 checkpoint on load
    engine_cfg = read_json_config(engine_model_path)
    if engine_cfg is None:
        return [
            f"cannot read config.json of the engines' checkpoint {engine_model_path}; set "
            "rollout.launch.model_path to a HF checkpoint directory"
        ]
    held: dict[str, Any] = engine_cfg.get("quantization_config") or {}
    block_fp8 = held.get("quant_method") == "fp8" and bool(held.get("weight_block_size"))
    if cfg.weights.fp8:
        want = fp8_lib.quantization_config_for(engine_cfg)
        if not block_fp8:
            online = " (launch.quantization=fp8 quantises online, without weight_scale_inv)"
            return [
                f"weights.fp8=true pushes block-FP8 weights with weight_scale_inv, but the "
                f"engines start from {engine_model_path}, which is not a block-FP8 checkpoint"
                f"{online if launch and launch.quantization == 'fp8' else ''}; write one with "
                f"`python tools/fp8_checkpoint.py --src {cfg.model.hf_path} --out DIR` and set "
                "rollout.launch.model_path=DIR"
            ]
        keys = ("quant_method", "fmt", "activation_scheme", "weight_block_size")
        diff = [k for k in keys if held.get(k) != want[k]]
        if diff:
            return [
                f"the quantization_config of {engine_model_path} differs from what weights.fp8 "
                f"sends in {diff} (sent: {[want[k] for k in diff]}); rewrite it with "
                "tools/fp8_checkpoint.py"
            ]
    elif block_fp8:
        return [
            f"the engines start from the block-FP8 checkpoint {engine_model_path} but "
            "weights.fp8=false pushes BF16 weights it has no parameters for; set weights.fp8=true"
        ]
    return []


def verify_problems(cfg: Config, hf: HFConfigLike, tp: int, ep: int) -> list[str]:
    """Whether the sender can reproduce what each engine TP rank reports (verify_every > 0)."""
    if cfg.weights.verify_every == 0 or tp == 1:
        return []
    key = "rollout.launch.tp_size"
    fix = "; change it or set weights.verify_every=0"
    mtype = hf_value(hf, "model_type", "")
    if mtype not in VERIFIABLE_MODEL_TYPES:
        return [
            f"weights.verify_every={cfg.weights.verify_every} with {key}={tp}: per-rank checksums "
            f"are reproduced for {', '.join(VERIFIABLE_MODEL_TYPES)}, not model_type={mtype!r}"
            f"{fix}"
        ]
    heads = int(hf_value(hf, "num_attention_heads"))
    kv = int(hf_value(hf, "num_key_value_heads") or heads)
    d = int(hf_value(hf, "head_dim") or int(hf_value(hf, "hidden_size")) // heads)
    out = []
    if kv % tp and tp % kv:
        out.append(f"{key}={tp} neither divides nor is a multiple of num_key_value_heads={kv}{fix}")
    experts = int(hf_value(hf, "num_experts") or 0)
    moe_tp = tp // ep
    inter = int(hf_value(hf, "moe_intermediate_size") or 0)
    if experts and (experts % ep or inter % moe_tp):
        out.append(
            f"rollout.launch.ep_size={ep}: num_experts={experts} and moe_intermediate_size="
            f"{inter} must split into {ep} expert groups of {moe_tp} TP ranks{fix}"
        )
    if cfg.weights.fp8:
        b = fp8_lib.BLOCK
        widths = {
            "q_proj rows": heads * d // tp,
            "o_proj columns": heads * d // tp,
            "k/v_proj rows": max(kv // tp, 1) * d,
        }
        if experts:
            widths["expert gate/up rows, down columns"] = inter // moe_tp
        dense = int(hf_value(hf, "intermediate_size") or 0)
        if dense and not experts:
            widths["dense gate/up rows"] = dense // tp
        bad = {k: v for k, v in widths.items() if v % b}
        if bad:
            out.append(
                f"{key}={tp}, rollout.launch.ep_size={ep} with weights.fp8: per-rank shards "
                f"{bad} are not multiples of the {b}x{b} FP8 block (SGLang refuses to start); "
                "raise rollout.launch.ep_size or lower rollout.launch.tp_size"
            )
    return out


def port_problems(p: Placement) -> list[str]:
    """Distinct ports within the job; free here when `check_free`."""
    seen: dict[int, str] = {}
    out = []
    for key, port in p.ports:
        if port == 0:
            continue
        if port in seen:
            out.append(f"{key}={port} is also {seen[port]}; give each port of the job its own")
        seen.setdefault(port, key)
        if p.check_free and not _bindable(port):
            out.append(f"{key}={port} is in use on this node (another job?); pick a free port")
    return out


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def topology_problems(
    cfg: Config,
    p: Placement,
    *,
    hf: HFConfigLike,
    engine_model_path: str | None,
    engine_tp: int,
    engine_ep: int,
) -> list[str]:
    """Every refusal of `cfg` placed as `p` (empty: the topology is sound)."""
    return (
        transport_problems(cfg, p)
        + fp8_problems(cfg, engine_model_path)
        + verify_problems(cfg, hf, engine_tp, engine_ep)
        + port_problems(p)
    )


__all__ = ["Placement", "topology_problems"]
