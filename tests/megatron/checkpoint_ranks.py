"""Rank program for test_checkpoint.py: train, save, train on; then a fresh model and optimizer
load the checkpoint and train on the same batches. Returns both runs' weights, the optimizer
state right after the save and right after the load, and both runs' final optimizer state (in
bf16 cases the optimizer's params are the fp32 main params, not the model's bf16 ones)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.algo import PolicyLossConfig
from megatron_gspo.checkpoint.files import OPTIMIZER_FILE
from megatron_gspo.config import OptimConfig
from megatron_gspo.megatron import step as mstep
from megatron_gspo.megatron.checkpoint import load_model_and_optimizer, save_model_and_optimizer
from megatron_gspo.megatron.model import (
    DTYPES,
    Layout,
    build_model,
    build_optimizer,
    ddp_config,
    init_megatron,
    load_bridge,
    make_provider,
    quiet_megatron,
)
from megatron_gspo.megatron.packing import TrainSequence
from megatron_gspo.patches.optimizer import optimizer_classes
from megatron_gspo.testing.weights import hf_state
from tests.megatron.policy_ranks import make_sequences

STEPS, SAVE_AFTER = 4, 2


def _optimizer_state(optimizer: Any) -> list[dict[str, torch.Tensor]]:
    """Per inner optimizer: every state tensor (and the group hyper-parameters), flattened."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        flat: dict[str, torch.Tensor] = {}
        for gi, group in enumerate(opt.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                for k, v in opt.optimizer.state.get(p, {}).items():
                    flat[f"g{gi}.p{pi}.{k}"] = torch.as_tensor(v).detach().clone().double()
                flat[f"g{gi}.p{pi}.param"] = p.detach().clone().double()
            for k in ("lr", "weight_decay", "betas", "eps"):
                if k in group:
                    flat[f"g{gi}.{k}"] = torch.as_tensor(group[k], dtype=torch.float64)
        out.append(flat)
    return out


def _build(bridge: Any, layout: Layout, distopt: bool, dtype: str) -> tuple[list, Any]:
    init_megatron(layout)
    provider = make_provider(bridge, layout, dtype=DTYPES[dtype])
    model = build_model(provider, ddp_config=ddp_config(distopt), load_from=bridge)
    opt = build_optimizer(
        model,
        OptimConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0, use_distributed_optimizer=distopt),
    )
    return model, opt


def _step(bridge: Any, model: list, opt: Any, layout: Layout, seed: int) -> dict[str, float]:
    raw = make_sequences(bridge.hf_pretrained.config.vocab_size, seed=seed)

    def plan(seqs: list[TrainSequence]) -> list:
        return mstep.plan_for_this_rank(seqs, layout, max_tokens=24)

    def seqs(old: dict[int, torch.Tensor]) -> list[TrainSequence]:
        return [
            TrainSequence(
                seq_id=s["seq_id"],
                prompt_ids=s["prompt_ids"],
                response_ids=s["response_ids"],
                old_logp=(old[s["seq_id"]] - 0.05 * s["offset"] / 9e-4).tolist(),
                advantage=s["advantage"],
            )
            for s in raw
        ]

    zeros = {s["seq_id"]: torch.zeros(len(s["response_ids"])) for s in raw}
    current = mstep.compute_logprobs(model, plan(seqs(zeros)))
    cfg = mstep.StepConfig(loss=PolicyLossConfig(kind="grpo"))  # GRPO: every token has a gradient
    return mstep.train_step(model, opt, plan(seqs(current)), cfg)


def main(rank: int, world: int, hf_dir: str, root: str, cases: dict[str, dict]) -> dict[str, Any]:
    import psutil

    quiet_megatron()
    bridge = load_bridge(hf_dir)
    out = {name: run_case(bridge, rank, f"{root}/{name}", case) for name, case in cases.items()}
    # what the saves left running (megatron-core's results queue was a spawned Manager server)
    out["_children"] = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
    return out


def run_case(bridge: Any, rank: int, ckpt: str, case: dict[str, Any]) -> dict[str, Any]:
    layout = Layout(**case["layout"])
    distopt, dtype = case["distopt"], case.get("dtype", "fp32")
    model, opt = _build(bridge, layout, distopt, dtype)
    metrics, saved_state = [], None
    for s in range(STEPS):
        metrics.append(_step(bridge, model, opt, layout, seed=s))
        if s + 1 == SAVE_AFTER:
            if rank == 0:
                Path(ckpt).mkdir(parents=True, exist_ok=True)
            torch.distributed.barrier()
            save_model_and_optimizer(model, opt, Path(ckpt))
            saved_state = _optimizer_state(opt)
    straight = hf_state(bridge, model)
    straight_state = _optimizer_state(opt)
    precision = _precision(model, opt)
    # which optimizer's state it is (a resume compares it before building one)
    written = json.loads((Path(ckpt) / OPTIMIZER_FILE).read_text())["classes"]

    model, opt = _build(bridge, layout, distopt, dtype)
    load_model_and_optimizer(model, opt, Path(ckpt))
    loaded_state = _optimizer_state(opt)
    resumed_metrics = [_step(bridge, model, opt, layout, seed=s) for s in range(SAVE_AFTER, STEPS)]
    return {
        "straight": straight,
        "resumed": hf_state(bridge, model),
        "metrics": metrics[SAVE_AFTER:],
        "resumed_metrics": resumed_metrics,
        "saved_state": saved_state,
        "loaded_state": loaded_state,
        "straight_state": straight_state,
        "resumed_state": _optimizer_state(opt),
        "precision": precision,
        "optimizer_file": written,
        "optimizer_classes": optimizer_classes(opt),
    }


def _precision(model: list, optimizer: Any) -> dict[str, Any]:
    """The dtypes of model and optimizer params, and how many fp32 main-param elements a bf16
    copy would round (0 would make a bf16 resume test blind to main params lost on load)."""
    main = [
        p for opt in getattr(optimizer, "chained_optimizers", [optimizer])
        for g in opt.optimizer.param_groups for p in g["params"]
    ]  # fmt: skip
    return {
        "model": sorted({str(p.dtype) for m in model for p in m.parameters()}),
        "main": sorted({str(p.dtype) for p in main}),
        "off_bf16_grid": sum(int((p != p.bfloat16().float()).sum()) for p in main),
    }
