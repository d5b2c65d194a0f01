"""The Megatron adapter's config: the `model:` and `optim:` sections, and `PolicySpec`, all that
`megatron/` reads of a run. No torch: `megatron_gspo.config` (and the planner) load without it.

`megatron_gspo.config.Config.policy_spec()` builds the spec; the adapter never sees the whole
`Config` (`tests/test_architecture.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_gspo.algo.config import PolicyLossConfig
from megatron_gspo.config_io import positive, require
from megatron_gspo.layout import Layout

__all__ = ["ModelConfig", "OptimConfig", "PolicySpec", "check_routing_replay"]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which model to train (a Hugging Face directory, converted by megatron-bridge)."""

    hf_path: str
    """Local Hugging Face model directory (config.json, and weights unless load_weights=false)."""
    tokenizer_path: str | None = None
    """Tokenizer directory; None uses model.hf_path."""
    load_weights: bool = True
    """false: build the model from config.json with random weights (toy and test runs)."""
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Parameter / compute dtype of the trainer (bf16: fp32 main params in the optimizer; CPU
    runs take fp32 or bf16)."""
    activation_recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation granularity (megatron-core recompute_granularity)."""
    moe_token_dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"
    """megatron-core MoE token dispatcher type."""
    moe_grouped_gemm: bool = False
    """Use grouped GEMM for the experts (GPU only)."""
    moe_aux_loss_coef: float = 0.0
    """Load-balancing auxiliary loss coefficient (0 disables it; RL usually keeps it off)."""
    fused_lm_head: bool = True
    """Compute log-probs and entropy with the fused output layer (never materialises the
    [tokens, vocab] logits; same numbers); false: output-layer logits, then chunked log-softmax."""

    def __post_init__(self) -> None:
        require(bool(self.hf_path), "model.hf_path is empty; set model.hf_path")
        require(
            self.moe_aux_loss_coef >= 0,
            f"model.moe_aux_loss_coef={self.moe_aux_loss_coef} must be >= 0; "
            "change model.moe_aux_loss_coef",
        )


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """Optimizer and learning-rate schedule (one optimizer step per mini-batch)."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer type (megatron-core: Adam is AdamW-style decoupled weight decay)."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of a decaying schedule."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: constant at optim.lr, or decay to optim.min_lr by the last optimizer step
    (train.steps * rl.mini_batches_per_rollout). megatron-core's OptimizerParamScheduler."""
    warmup_steps: int = 0
    """Linear warmup from 0 to optim.lr over this many optimizer steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    sgd_momentum: float = 0.9
    """SGD momentum (optim.optimizer=sgd)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (megatron-core distributed optimizer)."""

    def __post_init__(self) -> None:
        positive("optim", lr=self.lr, adam_eps=self.adam_eps)
        for name in ("adam_beta1", "adam_beta2", "sgd_momentum"):
            v = getattr(self, name)
            require(0 <= v < 1, f"optim.{name}={v} must be in [0, 1); change optim.{name}")
        for name in ("min_lr", "warmup_steps", "weight_decay", "clip_grad"):
            v = getattr(self, name)
            require(v >= 0, f"optim.{name}={v} must be >= 0; change optim.{name}")
        require(
            self.min_lr <= self.lr,
            f"optim.min_lr={self.min_lr} exceeds optim.lr={self.lr}; change optim.min_lr",
        )


@dataclass(frozen=True, kw_only=True)
class PolicySpec:
    """What the policy (`megatron/policy.py`) reads of a run: its sections and a few values of
    others, resolved once by `Config.policy_spec()` before anything starts."""

    model: ModelConfig
    """The `model:` section."""
    optim: OptimConfig
    """The `optim:` section."""
    parallel: Layout
    """The `parallel:` section (the layout every rank builds)."""
    loss: PolicyLossConfig
    """The `loss:` section."""
    seed: int = 0
    """train.seed: model init."""
    optimizer_steps: int = 1
    """The run's optimizer steps (train.steps * rl.mini_batches_per_rollout): the learning-rate
    schedule's length."""
    mini_batches: int = 1
    """rl.mini_batches_per_rollout: optimizer steps per rollout step."""
    pi_old: Literal["engine", "recompute"] = "engine"
    """rl.pi_old: the engine's sampling log-probs, or a trainer forward before the update."""
    adv_eps: float = 1e-6
    """rl.adv_eps: added to the group std (advantages recomputed with loss.kl_in_reward)."""
    normalize_std: bool = True
    """rl.normalize_std: divide group-centred rewards by the group std."""
    routing_replay: bool = False
    """rl.routing_replay: the study control that replays the engines' routes."""
    micro_batch_tokens: int = 8192
    """train.micro_batch_tokens: the token budget of a packed micro-batch."""
    routing_flip_every: int = 1
    """train.routing_flip_every: measure the routing flip rate every N steps (0 = never)."""
    routing_flip_per_minibatch: bool = False
    """train.routing_flip_per_minibatch: also per mini-batch after the first."""
    temperature: float = 1.0
    """rollout.temperature: the engines sample at it, so the trainer's log-probs use it too."""
    offload_trainer: bool = False
    """rollout.launch.colocated and rollout.launch.offload_trainer: this rank's trainer state
    leaves its device while the engines generate (`megatron/offload.py`)."""


def check_routing_replay(model: ModelConfig) -> None:
    """rl.routing_replay replays routes in forward passes only (`megatron/replay.py`)."""
    require(
        model.activation_recompute != "full",
        "rl.routing_replay=true replays routes in forward passes only, but "
        "model.activation_recompute=full routes again in backward; set "
        "model.activation_recompute=none or selective, or rl.routing_replay=false",
    )
