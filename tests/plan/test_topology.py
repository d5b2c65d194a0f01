"""The planner's topology check (`megatron_gspo/plan/topology.py`): every shipped recipe passes as
shipped, and each GPU rule refuses the configuration that breaks it with one line naming the
key. Also the FP8 checkpoint tool against a float64 reading of the e4m3 bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_gspo.config import load_config
from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.engines.launch import LaunchConfig
from megatron_gspo.plan.planner import _hf_config, plan_topology
from megatron_gspo.weights import fp8
from megatron_gspo.weights.fp8_checkpoint import write_fp8_checkpoint

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "examples/recipes"
# recipe -> (nodes, rollout nodes) as its header runs it
SHIPPED = {
    "qwen3_30b_a3b_bf16": (1, 0),
    "qwen3_30b_a3b_fp8": (1, 0),
    "qwen3_235b_a22b_bf16": (12, 4),
    "qwen3_235b_a22b_fp8": (12, 4),
}


def _refusals(recipe: str, nodes: int, rollout_nodes: int, *sets: str) -> list[str]:
    cfg = load_config(str(RECIPES / f"{recipe}.yaml"), list(sets))
    if rollout_nodes:  # what the launch files switch the trainer to
        cfg.weights.transport = "distributed"
    launch = cfg.rollout.launch or LaunchConfig(backend="sglang")
    return plan_topology(cfg, launch, _hf_config(cfg.model.hf_path), nodes, 8, rollout_nodes)


@pytest.mark.parametrize("recipe", SHIPPED)
def test_shipped_recipes_pass(recipe: str) -> None:
    assert _refusals(recipe, *SHIPPED[recipe]) == []


def _one(refusals: list[str], *words: str) -> None:
    assert len(refusals) == 1, refusals
    assert all(w in refusals[0] for w in words), refusals[0]
    assert "\n" not in refusals[0]


def test_nccl_one_rank_per_gpu() -> None:
    got = _refusals("qwen3_30b_a3b_bf16", 1, 0, "weights.transport=distributed")
    _one(got, "weights.transport=distributed", "NCCL", "--rollout-nodes")
    # gloo has no such rule (the CPU rehearsals); separate rollout nodes neither
    assert _refusals("qwen3_30b_a3b_bf16", 1, 0, "weights.transport=distributed",
                     "weights.backend=gloo") == []  # fmt: skip
    assert _refusals("qwen3_30b_a3b_bf16", 2, 1) == []


def test_cuda_ipc_within_a_node() -> None:
    """One sender reaches only its own node's engines; every rank sending its shard
    (weights.senders=owners, the recipe's) feeds each node's engines from that node's ranks,
    provided each node holds every expert-parallel rank."""
    one = _refusals("qwen3_30b_a3b_bf16", 2, 0, "weights.senders=one")
    _one(one, "weights.transport=tensor", "CUDA IPC", "weights.senders=owners")
    assert _refusals("qwen3_30b_a3b_bf16", 2, 0) == []  # the colocated recipe on 2 nodes
    assert _refusals("qwen3_30b_a3b_fp8", 4, 0) == []
    _one(_refusals("qwen3_30b_a3b_bf16", 2, 0, "parallel.ep=16"), "parallel.ep", "divide")


def test_rendezvous_address_not_pinned_on_several_trainer_nodes() -> None:
    got = _refusals("qwen3_235b_a22b_bf16", 12, 4, "weights.master_address=node1")
    _one(got, "weights.master_address=node1", "rank 0", "unset")
    assert _refusals("qwen3_235b_a22b_bf16", 2, 1, "weights.master_address=node1") == []


def test_fp8_push_only_to_a_matching_block_fp8_engine(tmp_path: Path) -> None:
    bf16 = str(RECIPES / "qwen3-30b-a3b")
    got = _refusals("qwen3_30b_a3b_fp8", 1, 0, f"rollout.launch.model_path={bf16}")
    _one(got, "weights.fp8=true", "not a block-FP8", "rollout.launch.model_path", "fp8_checkpoint")
    other = json.loads((RECIPES / "qwen3-30b-a3b-fp8/config.json").read_text())
    other["quantization_config"]["weight_block_size"] = [64, 64]
    (tmp_path / "config.json").write_text(json.dumps(other))
    got = _refusals("qwen3_30b_a3b_fp8", 1, 0, f"rollout.launch.model_path={tmp_path}")
    _one(got, "weight_block_size", "tools/fp8_checkpoint.py")
    fp8_dir = str(RECIPES / "qwen3-30b-a3b-fp8")
    got = _refusals("qwen3_30b_a3b_bf16", 1, 0, f"rollout.launch.model_path={fp8_dir}")
    _one(got, "block-FP8", "weights.fp8=false")


def test_verification_needs_shardable_engine_layouts() -> None:
    # 235B: moe_intermediate_size 1536 / 8 TP ranks = 192 rows, not a multiple of 128
    got = _refusals("qwen3_235b_a22b_fp8", 12, 4, "rollout.launch.tp_size=8",
                    "rollout.launch.ep_size=1")  # fmt: skip
    _one(got, "rollout.launch.tp_size=8", "128x128")
    assert _refusals("qwen3_235b_a22b_fp8", 12, 4, "rollout.launch.tp_size=8",
                     "rollout.launch.ep_size=8") == []  # fmt: skip
    bf16 = "rollout.launch.model_path=" + str(RECIPES / "qwen3-235b-a22b")
    assert _refusals("qwen3_235b_a22b_fp8", 12, 4, "rollout.launch.tp_size=8",
                     "rollout.launch.ep_size=1", "weights.fp8=false", bf16) == []  # fmt: skip


def test_ports_distinct() -> None:
    got = _refusals("qwen3_235b_a22b_bf16", 12, 4, "rollout.launch.router_port=30000")
    _one(got, "rollout.launch.router_port=30000", "rollout.launch.base_port+0")
    got = _refusals("qwen3_235b_a22b_bf16", 12, 4, "rollout.launch.router_metrics_port=29999")
    _one(got, "rollout.launch.router_metrics_port=29999", "rollout.launch.router_port")


@pytest.mark.slow
def test_fp8_checkpoint_tool(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src = save_tiny_hf_checkpoint(tmp_path / "bf16", seed=0, hidden_size=160, head_dim=64)
    out = write_fp8_checkpoint(src, tmp_path / "fp8")
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["fmt"], q["activation_scheme"]) == ("fp8", "e4m3", "dynamic")
    assert q["weight_block_size"] == [128, 128]
    assert "model.layers.0.mlp.gate" in q["modules_to_not_convert"]
    before = {k: v for f in src.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    after = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    quantised = [n for n in before if fp8.is_quantised_name(n, before[n])]
    assert quantised and set(after) == set(before) | {fp8.scale_name(n) for n in quantised}
    for name, x in before.items():
        if name not in quantised:
            assert torch.equal(after[name], x), name
            continue
        w, s = after[name], after[fp8.scale_name(name)]
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        n, k = x.shape
        assert tuple(s.shape) == (-(-n // 128), -(-k // 128))  # 160 wide: a partial block
        rep = s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        err = (w.double() * rep - x.double()).abs()
        assert bool((err <= 2.0**-4 * x.double().abs() + 2.0**-10 * rep + 1e-12).all()), name
