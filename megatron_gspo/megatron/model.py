"""megatron-core models from Hugging Face configs through megatron-bridge, on CPU or GPU.

The one place that builds Megatron models: `AutoBridge` reads the HF config and owns the
HF <-> Megatron weight mapping (Qwen3-MoE, Qwen3, Llama-style, ...); we choose the layer spec,
precision and parallel layout. On CPU: local spec with our `CPUCoreAttention`, fp32, fusions off.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.patches import P2P_ORDER_PATCH, apply_bridge_imports, apply_cpu_runtime


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A Megatron parallel layout. DP is what is left of the world size."""

    tp: int = 1
    """Tensor parallel size."""
    pp: int = 1
    """Pipeline parallel size."""
    vpp: int | None = None
    """Virtual pipeline chunks per pipeline rank (interleaved 1F1B); None = no interleaving."""
    cp: int = 1
    """Context parallel size."""
    ep: int = 1
    """Expert parallel size."""
    etp: int | None = None
    """Expert tensor parallel size (None: megatron-core's default, equal to tp)."""
    sequence_parallel: bool | None = None
    """Sequence parallelism; None turns it on whenever tp > 1 (MoE training requires it)."""

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    @classmethod
    def from_config(cls, parallel: Any) -> Layout:
        """The layout of a validated `megatron_gspo.config.ParallelConfig` (its `dp` is only a
        check of the world size, done by `ParallelConfig.validate_world`)."""
        return cls(
            tp=parallel.tp,
            pp=parallel.pp,
            vpp=parallel.vpp,
            cp=parallel.cp,
            ep=parallel.ep,
            etp=parallel.etp,
            sequence_parallel=parallel.sequence_parallel,
        )

    def name(self) -> str:
        parts = [
            f"{k}{v}"
            for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep))
            if v > 1
        ]
        if self.vpp:
            parts.append(f"vpp{self.vpp}")
        if self.etp is not None:
            parts.append(f"etp{self.etp}")
        return "-".join(parts) or "single"


def quiet_megatron(level: int = logging.WARNING) -> None:
    """Silence megatron-core / bridge INFO chatter (per-parameter listings at model build)."""
    for name in ("megatron", "megatron.core", "megatron.bridge", "transformers"):
        logging.getLogger(name).setLevel(level)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def on_cpu() -> bool:
    return not torch.cuda.is_available()


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
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    model_parallel_cuda_manual_seed(seed)


def cpu_layer_spec(config: Any) -> Any:
    """megatron-bridge's local (non-TE) spec with our CPU core attention (THD + CP)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    from megatron_gspo.megatron.cpu_attention import CPUCoreAttention

    spec = local_layer_spec(config)
    spec.submodules.self_attention.submodules.core_attention = CPUCoreAttention
    return spec


def load_bridge(hf_path: str | Path) -> Any:
    """An `AutoBridge` for a local HF checkpoint or config directory."""
    apply_bridge_imports()
    from megatron.bridge import AutoBridge

    return AutoBridge.from_hf_pretrained(str(hf_path))


def make_provider(
    bridge: Any,
    layout: Layout,
    *,
    dtype: torch.dtype | None = None,
    loss_is_share: bool = True,
    moe_aux_loss_coeff: float = 0.0,
) -> Any:
    """A finalised `GPTModelProvider` for `layout`.

    dtype: parameter dtype; default fp32 on CPU and bf16 on GPU.
    loss_is_share: each micro-batch's loss is already its share of the global mean (our policy
        losses): Megatron must SUM over micro-batches and data-parallel ranks rather than
        average (`calculate_per_token_loss=True`). False keeps Megatron's averaging.
    moe_aux_loss_coeff: MoE load-balancing loss weight during RL. Default 0: the aux loss is a
        statistic of each micro-batch's token mix (padding included), so with it on the policy
        gradient depends on how the batch was split over micro-batches and ranks.
    """
    cpu = on_cpu()
    dtype = dtype or (torch.float32 if cpu else torch.bfloat16)
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
    provider.moe_aux_loss_coeff = moe_aux_loss_coeff
    if moe_aux_loss_coeff == 0.0:
        provider.moe_router_load_balancing_type = "none"
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


def build_model(
    provider: Any,
    *,
    ddp_config: Any | None = None,
    load_from: Any | None = None,
) -> list[torch.nn.Module]:
    """Model chunks for this rank (one per virtual pipeline stage).

    ddp_config: a `DistributedDataParallelConfig` to wrap with megatron-core DDP, or None.
    load_from: an `AutoBridge` whose HF weights are loaded (before any optimizer is built).
    """
    model = provider.provide_distributed_model(
        ddp_config=ddp_config,
        wrap_with_ddp=ddp_config is not None,
        use_cpu_initialization=on_cpu(),
        mixed_precision_wrapper=None if on_cpu() else _float16_module(),
    )
    if load_from is not None:
        load_from.load_hf_weights(model)
    return model


def _float16_module() -> Any:
    from megatron.core.transformer.module import Float16Module

    return Float16Module


def export_hf_state(bridge: Any, model: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The full HF-named state dict, gathered from every shard (each rank gets all of it)."""
    return {
        name: t.detach().cpu().clone()
        for name, t in bridge.export_hf_weights(model, cpu=True, show_progress=False)
    }


def build_optimizer(
    model: list[torch.nn.Module],
    *,
    lr: float,
    weight_decay: float = 0.0,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_eps: float = 1e-8,
    clip_grad: float = 1.0,
    use_distributed_optimizer: bool = False,
) -> Any:
    """megatron-core's optimizer (Adam; dense and expert parameters in separate instances)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    for chunk in model:
        chunk.config.finalize_model_grads_func = finalize_model_grads
    dtype = next(model[0].parameters()).dtype
    return get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=weight_decay,
            adam_beta1=adam_beta1,
            adam_beta2=adam_beta2,
            adam_eps=adam_eps,
            clip_grad=clip_grad,
            use_distributed_optimizer=use_distributed_optimizer,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
        ),
        model,
    )


def ddp_config(use_distributed_optimizer: bool = False) -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
