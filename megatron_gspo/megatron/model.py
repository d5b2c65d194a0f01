"""megatron-core models from Hugging Face configs through megatron-bridge, on CPU or GPU.

The one place that builds Megatron models: `AutoBridge` reads the HF config and owns the
HF <-> Megatron weight mapping (Qwen3-MoE, Qwen3, Llama-style, ...); we choose the layer spec,
precision and parallel layout. On CPU: local spec with our `CPUCoreAttention`, fusions off, fp32
or bf16 (wrapped in `Float16Module` as on GPU: fp32 main params in the optimizer).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_gspo.dist import on_cpu
from megatron_gspo.layout import Layout
from megatron_gspo.patches import P2P_ORDER_PATCH, apply_bridge_imports, apply_cpu_runtime

if TYPE_CHECKING:
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_gspo.megatron.config import ModelConfig, OptimConfig

__all__ = [
    "DTYPES",
    "Layout",
    "build_model",
    "build_optimizer",
    "build_scheduler",
    "ddp_config",
    "init_megatron",
    "initialize_parallel_state",
    "load_bridge",
    "make_provider",
    "quiet_megatron",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def quiet_megatron(level: int = logging.WARNING) -> None:
    """Silence megatron-core / bridge INFO chatter (per-parameter listings at model build)."""
    for name in ("megatron", "megatron.core", "megatron.bridge", "transformers"):
        logging.getLogger(name).setLevel(level)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def init_megatron(layout: Layout, seed: int = 1234) -> None:
    """Initialise megatron-core's parallel state for `layout` on the current default group.

    `torch.distributed` must already be initialised (gloo on CPU, nccl on GPU).
    """
    if on_cpu():
        apply_cpu_runtime()
    if layout.pp > 1:
        P2P_ORDER_PATCH.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    initialize_parallel_state(layout)
    model_parallel_cuda_manual_seed(seed)


def release_parallel_state() -> None:
    """Drop megatron-core's references to its process groups, so that each group's gloo
    threads end with it (call after `torch.distributed.destroy_process_group`, which shuts
    the groups down but cannot free one a global still names). megatron-core 0.19.2's
    `destroy_model_parallel` leaves `_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP` and its gloo
    twin set: every group-valued global is cleared here."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    group = torch.distributed.ProcessGroup
    for name, value in list(vars(parallel_state).items()):
        held = value if isinstance(value, list) else [value]
        if held and all(isinstance(v, group) for v in held):
            setattr(parallel_state, name, None)


def initialize_parallel_state(layout: Layout, *, create_gloo_process_groups: bool = True) -> None:
    """megatron-core's parallel state for `layout` on the current default group (the one place
    that maps a `Layout` to `initialize_model_parallel`; the planner calls it in a fake group)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        create_gloo_process_groups=create_gloo_process_groups,
    )


def cpu_layer_spec(config: TransformerConfig) -> ModuleSpec:
    """megatron-bridge's local (non-TE) spec with our CPU core attention (THD + CP)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    from megatron_gspo.megatron.cpu_attention import CPUCoreAttention

    spec = local_layer_spec(config)
    spec.submodules.self_attention.submodules.core_attention = CPUCoreAttention
    return spec


def load_bridge(hf_path: str | Path) -> AutoBridge:
    """An `AutoBridge` for a local HF checkpoint or config directory."""
    apply_bridge_imports()
    from megatron.bridge import AutoBridge

    return AutoBridge.from_hf_pretrained(str(hf_path))


def make_provider(
    bridge: AutoBridge,
    layout: Layout,
    model: ModelConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    loss_is_share: bool = True,
) -> GPTModelProvider:
    """A finalised `GPTModelProvider` for `layout` and the `model` config section.

    model: dtype, activation recompute, MoE token dispatcher, grouped GEMM and aux-loss weight;
        None keeps the defaults (fp32 on CPU, bf16 on GPU; no recompute; no aux loss).
    dtype: overrides model.dtype (the conversion tools pass their own).
    loss_is_share: each micro-batch's loss is already its share of the global mean (our policy
        losses): Megatron must SUM over micro-batches and data-parallel ranks rather than
        average (`calculate_per_token_loss=True`). False keeps Megatron's averaging.

    The MoE aux loss defaults to 0 during RL: it is a statistic of each micro-batch's token mix
    (padding included), so with it on the policy gradient depends on how the batch was split.
    """
    cpu = on_cpu()
    if dtype is None and model is not None:
        dtype = DTYPES[model.dtype]
    dtype = dtype or (torch.float32 if cpu else torch.bfloat16)
    if cpu and dtype == torch.float16:
        raise ValueError(
            "model.dtype=fp16 on CPU: fp16 needs a loss scaler and CPU kernels megatron-core "
            "lacks; set model.dtype=bf16 or fp32"
        )
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = layout.tp
    provider.pipeline_model_parallel_size = layout.pp
    provider.virtual_pipeline_model_parallel_size = layout.vpp
    provider.context_parallel_size = layout.cp
    provider.expert_model_parallel_size = layout.ep
    provider.expert_tensor_parallel_size = layout.etp
    provider.sequence_parallel = layout.sp
    provider.params_dtype = dtype
    provider.pipeline_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = dtype == torch.float16
    # RL needs exact, reproducible log-probs; dropout off (Qwen3 trains without it).
    provider.calculate_per_token_loss = loss_is_share
    aux = model.moe_aux_loss_coef if model is not None else 0.0
    provider.moe_aux_loss_coeff = aux
    if aux == 0.0:
        provider.moe_router_load_balancing_type = "none"
    if model is not None:
        _apply_model_options(provider, model, cpu)
    # Packed micro-batches differ in length: pipeline stages exchange shapes first.
    provider.variable_seq_lengths = layout.pp > 1
    provider.attention_dropout = 0.0
    provider.hidden_dropout = 0.0
    if cpu:
        provider.transformer_layer_spec = cpu_layer_spec
        provider.use_cpu_initialization = True
        provider.moe_grouped_gemm = False  # TE-only; the local spec builds SequentialMLP
        provider.moe_permute_fusion = False
        provider.gradient_accumulation_fusion = False
        provider.bias_activation_fusion = False
        provider.bias_dropout_fusion = False
        provider.masked_softmax_fusion = False
        provider.persist_layer_norm = False
        provider.apply_rope_fusion = False
        provider.cross_entropy_loss_fusion = False
        provider.moe_router_fusion = False
    provider.finalize()
    return provider


def _apply_model_options(provider: GPTModelProvider, model: ModelConfig, cpu: bool) -> None:
    """Recompute, dispatcher and grouped GEMM, refused clearly where the device lacks them."""
    if model.activation_recompute == "full":
        # Recompute every layer's forward in backward: activations of one layer boundary kept.
        provider.recompute_granularity = "full"
        provider.recompute_method = "uniform"
        provider.recompute_num_layers = 1
    elif model.activation_recompute == "selective":
        provider.recompute_granularity = "selective"  # core attention only (megatron default)
    if model.moe_token_dispatcher == "flex" and cpu:
        raise ValueError(
            "model.moe_token_dispatcher=flex needs DeepEP on GPUs; on CPU use alltoall or allgather"
        )
    if model.moe_token_dispatcher == "allgather" and provider.expert_model_parallel_size > 1:
        # Its all-gather assumes the same token count on every EP rank; our packed
        # variable-length micro-batches differ per rank (gloo aborts, NCCL would misread).
        raise ValueError(
            "model.moe_token_dispatcher=allgather needs equal token counts on every expert-"
            "parallel rank, which packed micro-batches do not have; use alltoall (or "
            "parallel.ep=1)"
        )
    provider.moe_token_dispatcher_type = model.moe_token_dispatcher
    if model.moe_grouped_gemm:
        if cpu or not _has_transformer_engine():
            raise ValueError(
                "model.moe_grouped_gemm=true needs Transformer Engine on a GPU (its grouped "
                "linear); set model.moe_grouped_gemm=false or install transformer-engine"
            )
        provider.moe_grouped_gemm = True


def _has_transformer_engine() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def build_model(
    provider: GPTModelProvider,
    *,
    ddp_config: DistributedDataParallelConfig | None = None,
    load_from: AutoBridge | None = None,
) -> list[torch.nn.Module]:
    """Model chunks for this rank (one per virtual pipeline stage).

    ddp_config: a `DistributedDataParallelConfig` to wrap with megatron-core DDP, or None.
    load_from: an `AutoBridge` whose HF weights are loaded (before any optimizer is built).
    """
    model = provider.provide_distributed_model(
        ddp_config=ddp_config,
        wrap_with_ddp=ddp_config is not None,
        use_cpu_initialization=on_cpu(),
        mixed_precision_wrapper=_float16_module(),
    )
    if load_from is not None:
        load_from.load_hf_weights(model)
    return model


def _float16_module() -> type[Float16Module]:
    from megatron.core.transformer.module import Float16Module

    return Float16Module


def build_optimizer(model: list[torch.nn.Module], optim: OptimConfig) -> MegatronOptimizer:
    """megatron-core's optimizer for the `optim` config section (Adam or SGD; dense and expert
    parameters in separate instances, chained)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    for chunk in model:
        chunk.config.finalize_model_grads_func = finalize_model_grads  # type: ignore[union-attr]
    dtype = next(model[0].parameters()).dtype
    return get_megatron_optimizer(
        OptimizerConfig(
            optimizer=optim.optimizer,
            lr=optim.lr,
            min_lr=optim.min_lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            adam_eps=optim.adam_eps,
            sgd_momentum=optim.sgd_momentum,
            clip_grad=optim.clip_grad,
            use_distributed_optimizer=optim.use_distributed_optimizer,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
        ),
        model,
    )


def build_scheduler(
    optimizer: MegatronOptimizer, optim: OptimConfig, total_steps: int
) -> OptimizerParamScheduler:
    """megatron-core's `OptimizerParamScheduler`: linear warmup from 0 over optim.warmup_steps,
    then optim.lr_schedule from optim.lr to optim.min_lr until `total_steps` optimizer steps.
    Call `.step(1)` after every applied optimizer step; `.state_dict()` goes in checkpoints."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=max(total_steps, optim.warmup_steps + 1),
        lr_decay_style=optim.lr_schedule,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def ddp_config(use_distributed_optimizer: bool = False) -> DistributedDataParallelConfig:
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
