"""Recipe rehearsal on CPU: a shipped recipe and its Slurm mode, changed only in model size and
device, so that what it would do on the GPU cluster runs here for a couple of steps.

`shrink(recipe)` derives the rehearsal from the recipe itself:

* the cluster: at most 2 trainer nodes (a multi-node trainer) and 1 rollout node; `gpus_per_node`
  G -> g = G / s, the smallest trainer world (<= `max_ranks` CPU ranks) that holds the
  model-parallel block and 2 ranks; engine TP divided by s but kept >= 2 when the recipe's is
  (sharded engines), engine EP keeping the recipe's TP:EP ratio;
* the trainer layout: tp, pp, cp, vpp kept; ep the largest divisor of the recipe's ep that fits
  `world / (pp * etp)`;
* the model: the recipe's config.json with the same model_type, head_dim when the recipe sends
  FP8 (128x128 blocks need it), kv heads kept when they are few (<= 8) and, when the recipe's kv
  heads are fewer than its engine TP (replicated kv heads), still fewer than the shrunk engine
  TP; q heads the least multiple of kv heads that every TP divides; experts the least count
  every EP divides (x2), top-k <= experts / 2; moe_intermediate_size splits over the engine's
  moe-TP ranks (in 128-row blocks for FP8); 2 layers per pipeline stage; vocab 128.

Everything else (transport, FP8, verification, colocation, recompute, dispatcher, loss, GSPO
settings) stays the recipe's, precision included (bf16 parameters with fp32 main params, bf16
engines with fp32 logits); the device-only changes (`device_sets`) are CPU ranks, no grouped
GEMM (Transformer Engine) and a small batch / response length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megatron_gspo.config import Config


@dataclass
class Rehearsal:
    """What `shrink` derived: the cluster, the trainer's `--set`s and the model's config."""

    nodes: int
    rollout_nodes: int
    gpus_per_node: int
    trainer_world: int
    sets: list[str] = field(default_factory=list)
    hf_overrides: dict[str, Any] = field(default_factory=dict)


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, max(1, min(n, cap)) + 1) if n % d == 0)


def shrink(
    cfg: Config,
    hf: dict[str, Any],
    *,
    nodes: int,
    rollout_nodes: int,
    gpus_per_node: int,
    max_ranks: int = 4,
) -> Rehearsal:
    """The CPU-sized rehearsal of `cfg` on `nodes` x `gpus_per_node` (see the module doc)."""
    lay = cfg.parallel
    etp = lay.etp or lay.tp
    block = lay.tp * lay.pp * lay.cp
    # two trainer nodes stand for many (a multi-node trainer), one rollout node for many
    trainer_nodes = min(nodes - rollout_nodes, 2)
    rollout_nodes = min(rollout_nodes, 1)
    # GPUs per node shrink by s: the smallest trainer world that holds the model-parallel
    # block and two ranks (EP / DP > 1 stay possible)
    s = 1
    for cand in sorted((d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0),
                       reverse=True):  # fmt: skip
        if trainer_nodes * (gpus_per_node // cand) >= max(block, 2):
            s = cand
            break
    g = gpus_per_node // s
    world = trainer_nodes * g
    if world % block or world > max_ranks:
        raise ValueError(f"cannot fit tp*pp*cp={block} on at most {max_ranks} CPU ranks")
    ep = _divisor_at_most(lay.ep, world // (lay.pp * etp))
    launch = cfg.rollout.launch
    # engines keep TP > 1 when the recipe's have it (what sharded verification is about), and
    # their TP:EP ratio
    tp0, ep0 = (launch.tp_size, launch.ep_size) if launch else (1, 1)
    etp_engine = min(g, max(2, tp0 // s)) if tp0 > 1 else 1
    eep_engine = max(1, ep0 * etp_engine // tp0)
    moe_tp = etp_engine // eep_engine
    use_fp8 = cfg.weights.fp8
    kv0 = int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    kv = kv0 if kv0 <= 8 else 8
    if launch and kv0 < launch.tp_size:  # the recipe replicates kv heads over engine ranks
        while kv >= etp_engine and kv > 1:
            kv //= 2
    # megatron-core needs the trainer's TP to divide the kv heads: where that conflicts with
    # replication on the shrunk engine, replication is left to tests/engines/test_weight_shards.py
    kv = max(kv, lay.tp)
    heads = kv * 2
    while heads % math.lcm(etp_engine, lay.tp):
        heads += kv
    head_dim = int(hf.get("head_dim") or 128) if use_fp8 else 16
    experts = 2 * math.lcm(ep, eep_engine) if hf.get("num_experts") else 0
    unit = 128 if use_fp8 else 16
    over = dict(
        model_type=hf["model_type"],
        architectures=hf.get("architectures"),
        num_hidden_layers=2 * lay.pp * (lay.vpp or 1),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        hidden_size=256 if use_fp8 else 64,
        intermediate_size=2 * unit * max(moe_tp, lay.tp),
        vocab_size=128,
        max_position_embeddings=512,
    )
    if experts:
        over.update(
            num_experts=experts,
            num_experts_per_tok=min(int(hf.get("num_experts_per_tok", 2)), experts // 2),
            moe_intermediate_size=unit * max(moe_tp, etp),
        )
    # verification stays the recipe's (changed only in size and device): its first push is
    # always verified, on every TP rank of every engine, or the trainer stops
    sets = [f"parallel.ep={ep}"]
    if launch:
        sets += [f"rollout.launch.tp_size={etp_engine}", f"rollout.launch.ep_size={eep_engine}"]
        if etp_engine > 1:
            # The stand-in holds whole HF tensors and reads rank 0's payload only, so it takes
            # HF names; SGLang's own per-rank layout is checked against SGLang's loaders in
            # tests/engines/test_weight_layout.py and the real server.
            sets.append("weights.layout=hf")
    return Rehearsal(
        nodes=trainer_nodes + rollout_nodes,
        rollout_nodes=rollout_nodes,
        gpus_per_node=g,
        trainer_world=world,
        sets=sets,
        hf_overrides=over,
    )


def device_sets(cfg: Config) -> list[str]:
    """The device changes: CPU ranks over gloo, no Transformer Engine grouped GEMM, and a
    CPU-sized batch (token budget, responses, prompts per rollout). The precision stays the
    recipe's (`model.dtype`: bf16 parameters, fp32 main params in its distributed optimizer;
    its engines' dtype and fp32 LM head): megatron-core's CPU path runs bf16, and fp32 would
    hide what only bf16 shows (main params that are not the model's, issue 35)."""
    return [
        "train.device=cpu",
        "model.moe_grouped_gemm=false",
        "rl.group_size=2" if hasattr(cfg, "rl") else "gspo.group_size=2",
        "rl.prompts_per_rollout=2" if hasattr(cfg, "rl") else "gspo.prompts_per_rollout=2",
        "rollout.max_new_tokens=4",
        "train.micro_batch_tokens=256",
        "data.max_prompt_tokens=64",
        "data.chat_template=false",
        "reward.kind=toy",
        "reward.num_workers=1",
        "logging.tensorboard=false",
        "logging.progress=false",
        "checkpoint.save_every=0",
        "optim.warmup_steps=0",
    ]


__all__ = ["Rehearsal", "device_sets", "shrink"]
