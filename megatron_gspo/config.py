"""The run configuration: one YAML file -> nested typed dataclasses, with `--set a.b=c` overrides.

Plain Python only (no Megatron import): the one adapter in `megatron_gspo/megatron/` translates
these sections into megatron-core objects. Every field carries a docstring (the string literal
under it; `field_docs()` reads them back for `--help`-style listings), and every check raises a
`ConfigError` whose message names the key to change.

    cfg = load_config("examples/tiny_moe_cpu.yaml", ["gspo.algorithm=grpo", "parallel.ep=2"])
    dp = cfg.parallel.validate_world(world_size, num_experts=8, num_layers=2, num_heads=4)
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_gspo.config_io import (
    ConfigError,
    apply_override,
    build_dataclass,
    field_docs,
    require,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "GspoConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainConfig",
    "config_from_dict",
    "dump_config",
    "field_docs",
    "load_config",
    "parse_cli",
]

Algorithm = Literal["gspo", "gspo_token", "grpo"]

# The GSPO paper's settings (Zheng et al. 2025, arXiv 2507.18071): sequence-level ratios live in
# a band two orders of magnitude narrower than GRPO's token-level ones.
DEFAULT_EPS: dict[str, tuple[float, float]] = {
    "gspo": (3e-4, 4e-4),
    "gspo_token": (3e-4, 4e-4),
    "grpo": (0.2, 0.27),
}


_require = require


def _positive(section: str, **values: float | int | None) -> None:
    for name, v in values.items():
        _require(v is None or v > 0, f"{section}.{name}={v} must be > 0; change {section}.{name}")


_CFG = dict(kw_only=True, slots=True)


@dataclass(**_CFG)
class ModelConfig:
    """Which model to train (a Hugging Face directory, converted by megatron-bridge)."""

    hf_path: str
    """Local Hugging Face model directory (config.json, and weights unless load_weights=false)."""
    tokenizer_path: str | None = None
    """Tokenizer directory; None uses model.hf_path."""
    load_weights: bool = True
    """false: build the model from config.json with random weights (toy and test runs)."""
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Parameter / compute dtype of the trainer (CPU runs need fp32)."""
    activation_recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation granularity (megatron-core recompute_granularity)."""
    moe_token_dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"
    """megatron-core MoE token dispatcher type."""
    moe_grouped_gemm: bool = False
    """Use grouped GEMM for the experts (GPU only)."""
    moe_aux_loss_coef: float = 0.0
    """Load-balancing auxiliary loss coefficient (0 disables it; RL usually keeps it off)."""

    def __post_init__(self) -> None:
        _require(bool(self.hf_path), "model.hf_path is empty; set model.hf_path")
        _require(
            self.moe_aux_loss_coef >= 0,
            f"model.moe_aux_loss_coef={self.moe_aux_loss_coef} must be >= 0; "
            "change model.moe_aux_loss_coef",
        )


@dataclass(**_CFG)
class ParallelConfig:
    """The parallel layout (megatron-core semantics; DP is what is left of the world)."""

    tp: int = 1
    """Tensor parallel size."""
    pp: int = 1
    """Pipeline parallel size."""
    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (interleaved schedule); None disables it."""
    cp: int = 1
    """Context parallel size."""
    ep: int = 1
    """Expert parallel size."""
    etp: int | None = None
    """Expert tensor parallel size; None means the same as parallel.tp (megatron-core default)."""
    dp: int | None = None
    """Data parallel size; None infers world_size / (tp * pp * cp). Set it to assert a layout."""
    sequence_parallel: bool = False
    """Sequence parallelism (needs tp > 1; required by megatron-core when tp > 1 and ep > 1)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "etp", "dp", "vpp"):
            v = getattr(self, name)
            _require(
                v is None or v >= 1, f"parallel.{name}={v} must be >= 1; change parallel.{name}"
            )
        _require(
            self.vpp is None or self.pp > 1,
            f"parallel.vpp={self.vpp} needs pipeline parallelism; set parallel.pp > 1 or "
            "parallel.vpp to null",
        )
        _require(
            not self.sequence_parallel or self.tp > 1,
            "parallel.sequence_parallel=true needs parallel.tp > 1; change parallel.tp or set "
            "parallel.sequence_parallel=false",
        )
        _require(
            not (self.ep > 1 and self.tp > 1 and not self.sequence_parallel),
            f"parallel.ep={self.ep} with parallel.tp={self.tp} needs sequence parallelism "
            "(megatron-core); set parallel.sequence_parallel=true",
        )

    @property
    def expert_tp(self) -> int:
        """The effective expert tensor parallel size (etp, defaulting to tp)."""
        return self.tp if self.etp is None else self.etp

    def validate_world(
        self,
        world_size: int,
        *,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        num_experts: int | None = None,
    ) -> int:
        """Check the layout against the world size and the model; return the DP size.

        The rules are megatron-core's: TP x PP x CP x DP == world size; the expert grid
        ETP x EP x PP must divide the world (expert DP = world / (ETP x EP x PP)), i.e. ETP x EP
        divides DP x CP x TP; EP divides the number of experts; TP divides the attention (and
        key-value) heads; PP (x VPP) divides the layers (uneven splits are not exposed here).
        """
        _require(world_size >= 1, f"world size {world_size} must be >= 1")
        model_grid = self.tp * self.pp * self.cp
        _require(
            world_size % model_grid == 0,
            f"world size {world_size} is not divisible by parallel.tp*pp*cp = "
            f"{self.tp}*{self.pp}*{self.cp} = {model_grid}; change parallel.tp, parallel.pp or "
            "parallel.cp (or the number of ranks)",
        )
        dp = world_size // model_grid
        if self.dp is not None and self.dp != dp:
            raise ConfigError(
                f"parallel.tp*pp*cp*dp = {model_grid}*{self.dp} = {model_grid * self.dp} != world "
                f"size {world_size}; change parallel.dp (to {dp} or null)"
            )
        if num_experts is None:
            _require(
                self.ep == 1 and self.etp in (None, 1, self.tp),
                f"parallel.ep={self.ep} / parallel.etp={self.etp} need an MoE model; the model has "
                "no experts: set parallel.ep=1 and parallel.etp to null",
            )
        else:
            _require(
                num_experts % self.ep == 0,
                f"parallel.ep={self.ep} does not divide model num_experts={num_experts}; change "
                "parallel.ep",
            )
            expert_grid = self.expert_tp * self.ep
            _require(
                (dp * self.cp * self.tp) % expert_grid == 0,
                f"parallel.etp*ep = {self.expert_tp}*{self.ep} = {expert_grid} does not divide "
                f"dp*cp*tp = {dp}*{self.cp}*{self.tp} = {dp * self.cp * self.tp} (megatron-core "
                "expert data parallel = world / (etp*ep*pp)); change parallel.ep or parallel.etp",
            )
        _require(
            num_heads % self.tp == 0,
            f"parallel.tp={self.tp} does not divide model num_attention_heads={num_heads}; "
            "change parallel.tp",
        )
        _require(
            num_kv_heads is None or num_kv_heads % self.tp == 0,
            f"parallel.tp={self.tp} does not divide model num_key_value_heads={num_kv_heads}; "
            "change parallel.tp",
        )
        stages = self.pp * (self.vpp or 1)
        _require(
            num_layers % stages == 0,
            f"parallel.pp*vpp = {self.pp}*{self.vpp or 1} = {stages} does not divide model "
            f"num_layers={num_layers}; change parallel.pp or parallel.vpp",
        )
        return dp


@dataclass(**_CFG)
class OptimConfig:
    """Optimizer and learning-rate schedule (one optimizer step per mini-batch)."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer type (megatron-core: Adam is AdamW-style decoupled weight decay)."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of a decaying schedule."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warmup, from optim.lr to optim.min_lr over train.steps rollouts."""
    warmup_steps: int = 0
    """Linear warmup length in optimizer steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (megatron-core distributed optimizer)."""

    def __post_init__(self) -> None:
        _positive("optim", lr=self.lr, adam_eps=self.adam_eps)
        for name in ("adam_beta1", "adam_beta2"):
            v = getattr(self, name)
            _require(0 <= v < 1, f"optim.{name}={v} must be in [0, 1); change optim.{name}")
        for name in ("min_lr", "warmup_steps", "weight_decay", "clip_grad"):
            v = getattr(self, name)
            _require(v >= 0, f"optim.{name}={v} must be >= 0; change optim.{name}")
        _require(
            self.min_lr <= self.lr,
            f"optim.min_lr={self.min_lr} exceeds optim.lr={self.lr}; change optim.min_lr",
        )


@dataclass(**_CFG)
class GspoConfig:
    """The policy-gradient algorithm (GSPO: arXiv 2507.18071; GRPO: arXiv 2402.03300)."""

    algorithm: Algorithm = "gspo"
    """gspo (sequence-level ratio), gspo_token (per-token advantages, GSPO paper) or
    grpo (token-level ratio baseline)."""
    eps_low: float | None = None
    """Lower clip range: ratios below 1 - eps_low are clipped. None: 3e-4 for gspo/gspo_token,
    0.2 for grpo (the GSPO paper's settings). Resolved at load time, so a dumped config
    carries the number."""
    eps_high: float | None = None
    """Upper clip range: ratios above 1 + eps_high are clipped. None: 4e-4 for gspo/gspo_token,
    0.27 for grpo (the GSPO paper's settings)."""
    group_size: int = 8
    """G: responses sampled per prompt (advantages are relative within a group)."""
    prompts_per_rollout: int = 32
    """P: prompts per rollout; a rollout holds P * G responses."""
    mini_batches_per_rollout: int = 4
    """Optimizer steps per rollout; the paper splits each rollout into 4 mini-batches."""
    pi_old: Literal["engine", "recompute"] = "engine"
    """Where pi_old comes from: the engine's sampling log-probs (the paper's claim: no recompute)
    or a trainer forward pass before the first update."""
    mismatch_correction: Literal["none", "token", "sequence"] = "none"
    """Truncated importance correction of trainer pi_old vs engine (needs gspo.pi_old=recompute
    to have two distributions to compare)."""
    mismatch_cap: float = 2.0
    """Truncation cap of the mismatch-correction weight."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group std (false: A_i = r_i - mean)."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing."""
    log_ratio_clamp: float = 10.0
    """|mean log-ratio| bound applied before exp, so one garbage sequence cannot give inf/NaN."""

    def __post_init__(self) -> None:
        lo, hi = DEFAULT_EPS[self.algorithm]
        if self.eps_low is None:
            self.eps_low = lo
        if self.eps_high is None:
            self.eps_high = hi
        _require(
            0 <= self.eps_low < 1,
            f"gspo.eps_low={self.eps_low} must be in [0, 1); change gspo.eps_low",
        )
        _require(
            self.eps_high >= 0, f"gspo.eps_high={self.eps_high} must be >= 0; change gspo.eps_high"
        )
        _positive("gspo", mismatch_cap=self.mismatch_cap)
        _positive("gspo", log_ratio_clamp=self.log_ratio_clamp, adv_eps=self.adv_eps)
        _require(
            self.group_size >= 2,
            f"gspo.group_size={self.group_size} must be >= 2 (a group of one has no relative "
            "advantage); change gspo.group_size",
        )
        for name in ("prompts_per_rollout", "mini_batches_per_rollout"):
            v = getattr(self, name)
            _require(v >= 1, f"gspo.{name}={v} must be >= 1; change gspo.{name}")
        n = self.prompts_per_rollout * self.group_size
        _require(
            n % self.mini_batches_per_rollout == 0,
            f"gspo.prompts_per_rollout*group_size = {n} responses do not split into "
            f"gspo.mini_batches_per_rollout={self.mini_batches_per_rollout} equal mini-batches; "
            "change gspo.mini_batches_per_rollout or gspo.prompts_per_rollout",
        )
        _require(
            self.mismatch_correction == "none" or self.pi_old == "recompute",
            f"gspo.mismatch_correction={self.mismatch_correction} compares a recomputed pi_old "
            "with the engine; set gspo.pi_old=recompute or gspo.mismatch_correction=none",
        )
        _require(
            not (self.mismatch_correction == "token" and self.algorithm == "gspo"),
            "gspo.mismatch_correction=token needs per-token loss terms, which "
            "gspo.algorithm=gspo does not have; use gspo.mismatch_correction=sequence or "
            "gspo.algorithm=gspo_token",
        )

    @property
    def rollout_size(self) -> int:
        """Responses per rollout (P * G)."""
        return self.prompts_per_rollout * self.group_size


@dataclass(**_CFG)
class RolloutConfig:
    """Rollout engines (embedded CPU engine or SGLang servers) and sampling parameters."""

    engines: Literal["embedded"] | list[str] = "embedded"
    """"embedded" (in-process engine, CPU demo and tests) or a list of SGLang server URLs."""
    router_url: str | None = None
    """SGLang router URL in front of rollout.engines (requests go there; weights go to each)."""
    num_embedded_engines: int = 1
    """How many embedded engines to run (rollout.engines=embedded only)."""
    temperature: float = 1.0
    """Sampling temperature (> 0: RL needs sampled, not greedy, responses)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Top-k sampling; -1 disables it (SGLang convention)."""
    max_new_tokens: int = 1024
    """Maximum response length in tokens."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """Engine weight precision; fp8 quantises blockwise on send (SGLang engines only)."""
    colocated: bool = False
    """Engines share the trainer's devices: release engine memory while training."""
    weight_sync: Literal["tensor", "distributed", "disk"] = "tensor"
    """Weight transport to the engines: in-memory tensors, a NCCL/gloo group, or files."""
    bucket_mb: int = 512
    """Size of a weight-sync bucket in MiB."""
    verify_weights_every: int = 1
    """Compare per-tensor checksums of sent and engine-held weights every N syncs (0 = never;
    use 0 with real SGLang engines, which fuse q/k/v and gate/up internally)."""
    request_timeout_s: float = 600.0
    """HTTP timeout of one generate request."""

    def __post_init__(self) -> None:
        if isinstance(self.engines, list):
            _require(
                len(self.engines) > 0,
                'rollout.engines is an empty list; give SGLang URLs or "embedded"',
            )
            for url in self.engines:
                _require(
                    url.startswith(("http://", "https://")),
                    f"rollout.engines entry {url!r} is not an http(s) URL; fix rollout.engines",
                )
        _require(
            self.router_url is None or self.router_url.startswith(("http://", "https://")),
            f"rollout.router_url={self.router_url!r} is not an http(s) URL; fix rollout.router_url",
        )
        _require(
            self.router_url is None or self.engines != "embedded",
            "rollout.router_url needs SGLang engines; set rollout.engines to their URLs or "
            "rollout.router_url to null",
        )
        _require(
            self.precision == "bf16" or self.engines != "embedded",
            f"rollout.precision={self.precision} needs SGLang engines (the embedded engine runs "
            "the trainer dtype); set rollout.precision=bf16",
        )
        _positive("rollout", temperature=self.temperature, top_p=self.top_p)
        _require(self.top_p <= 1, f"rollout.top_p={self.top_p} must be <= 1; change rollout.top_p")
        _require(
            self.top_k == -1 or self.top_k >= 1,
            f"rollout.top_k={self.top_k} must be -1 (off) or >= 1; change rollout.top_k",
        )
        _positive(
            "rollout",
            max_new_tokens=self.max_new_tokens,
            bucket_mb=self.bucket_mb,
            num_embedded_engines=self.num_embedded_engines,
            request_timeout_s=self.request_timeout_s,
        )

    @property
    def embedded(self) -> bool:
        """True when rollouts run on the in-process engine."""
        return self.engines == "embedded"


@dataclass(**_CFG)
class DataConfig:
    """The prompt dataset (JSONL: a prompt string or chat messages, plus an answer)."""

    train_path: str
    """JSONL file of training prompts."""
    prompt_key: str = "prompt"
    """Field holding the prompt text."""
    messages_key: str = "messages"
    """Field holding a chat message list (used when the prompt field is absent)."""
    answer_key: str = "answer"
    """Field holding the ground-truth answer passed to the reward."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template when it has one (else plain text)."""
    system_prompt: str | None = None
    """System message prepended to every chat (chat template only)."""
    seed: int = 0
    """Shuffling seed; the order of epoch e is a function of (seed, e) only."""
    shuffle: bool = True
    """Shuffle prompts every epoch (false: file order)."""
    max_prompt_tokens: int | None = None
    """Reject prompts longer than this many tokens at load time; None: no limit."""

    def __post_init__(self) -> None:
        _require(bool(self.train_path), "data.train_path is empty; set data.train_path")
        _positive("data", max_prompt_tokens=self.max_prompt_tokens)


@dataclass(**_CFG)
class RewardConfig:
    """How responses are scored."""

    kind: str = "math"
    """math (math-verify on boxed / final answers), toy (the built-in digit task), or a user
    function as "package.module:function" with signature (prompt, response, answer) -> float."""
    num_workers: int = 2
    """Worker processes for reward calls; 0 runs in-process (no timeout enforcement)."""
    timeout_s: float = 10.0
    """Per-call timeout; a call past it scores 0 and counts in reward/timeouts."""

    def __post_init__(self) -> None:
        if self.kind not in ("math", "toy"):
            mod, sep, fn = self.kind.partition(":")
            _require(
                bool(sep and mod and fn),
                f'reward.kind={self.kind!r} is not math, toy or "module:function"; '
                "change reward.kind",
            )
        _require(
            self.num_workers >= 0,
            f"reward.num_workers={self.num_workers} must be >= 0; change reward.num_workers",
        )
        _positive("reward", timeout_s=self.timeout_s)


@dataclass(**_CFG)
class CheckpointConfig:
    """Distributed checkpoints of model + optimizer + trainer state."""

    dir: str | None = None
    """Checkpoint directory; None disables checkpointing."""
    save_every: int = 0
    """Save every N rollout steps (0: only at the end and on SIGTERM)."""
    resume: bool = False
    """Continue from the latest checkpoint in checkpoint.dir (a fresh start if there is none)."""
    keep_last: int | None = None
    """Keep only the newest N checkpoints; None keeps all."""
    export_hf_at_end: bool = False
    """Convert the final model to a Hugging Face directory under checkpoint.dir."""

    def __post_init__(self) -> None:
        _require(
            self.save_every >= 0,
            f"checkpoint.save_every={self.save_every} must be >= 0; change checkpoint.save_every",
        )
        _positive("checkpoint", keep_last=self.keep_last)
        for name in ("resume", "export_hf_at_end"):
            _require(
                not getattr(self, name) or self.dir is not None,
                f"checkpoint.{name}=true needs a directory; set checkpoint.dir",
            )
        _require(
            self.save_every == 0 or self.dir is not None,
            "checkpoint.save_every > 0 needs a directory; set checkpoint.dir",
        )


@dataclass(**_CFG)
class LoggingConfig:
    """Metrics sinks (rank 0 only)."""

    dir: str = "runs/default"
    """Directory of metrics.jsonl and the TensorBoard events."""
    jsonl: bool = True
    """Write one JSON line of metrics per step to logging.dir/metrics.jsonl."""
    tensorboard: bool = True
    """Write TensorBoard scalars to logging.dir/tb."""
    wandb_project: str | None = None
    """Weights & Biases project; None disables W&B (skipped if wandb is not installed)."""
    log_every: int = 1
    """Write metrics every N steps."""
    progress: bool = True
    """Show a console progress bar with the key metrics."""

    def __post_init__(self) -> None:
        _positive("logging", log_every=self.log_every)


@dataclass(**_CFG)
class TrainConfig:
    """The outer loop."""

    steps: int = 100
    """Rollout steps (each: one rollout, gspo.mini_batches_per_rollout optimizer steps)."""
    seed: int = 0
    """Seed of model init and sampling (data order uses data.seed)."""
    micro_batch_tokens: int = 8192
    """Token budget of a packed micro-batch (prompt + response tokens)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda when available, else cpu (gloo)."""
    routing_flip_every: int = 1
    """Measure `moe/routing_flip_rate` (share of (token, MoE layer) whose top-k experts changed
    between the rollout policy and the updated one) every N steps: two forward passes over each
    rank's first micro-batch(es). 0 = never."""

    def __post_init__(self) -> None:
        _positive("train", steps=self.steps, micro_batch_tokens=self.micro_batch_tokens)
        _require(
            self.routing_flip_every >= 0,
            f"train.routing_flip_every={self.routing_flip_every} must be >= 0 (0 = off); "
            "change train.routing_flip_every",
        )


@dataclass(**_CFG)
class Config:
    """The whole run."""

    model: ModelConfig
    """The model to train."""
    data: DataConfig
    """The prompt dataset."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    gspo: GspoConfig = field(default_factory=GspoConfig)
    """Algorithm."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout engines and sampling."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Outer loop."""

    def __post_init__(self) -> None:
        _require(
            self.train.micro_batch_tokens > self.rollout.max_new_tokens,
            f"train.micro_batch_tokens={self.train.micro_batch_tokens} cannot hold one response "
            f"of rollout.max_new_tokens={self.rollout.max_new_tokens} plus its prompt; raise "
            "train.micro_batch_tokens or lower rollout.max_new_tokens",
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-serialisable); `config_from_dict` inverts it."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# loading, overrides, dumping


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a `Config` from a nested dict (e.g. parsed YAML)."""
    _require(isinstance(data, dict), f"the config must be a mapping, got {type(data).__name__}")
    return build_dataclass(Config, data)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config file (None: start from an empty mapping), apply `section.key=value`
    overrides (values parsed as YAML scalars / flow lists), and validate."""
    data: dict[str, Any] = {}
    if path is not None:
        with open(path) as f:
            loaded = yaml.safe_load(f)
        _require(
            loaded is None or isinstance(loaded, dict),
            f"{path}: the top level must be a mapping of sections",
        )
        data = loaded or {}
    for ov in overrides:
        apply_override(Config, data, ov)
    return config_from_dict(data)


def dump_config(cfg: Config, path: str | Path | None = None) -> str:
    """The config as YAML text (written to `path` when given); `load_config` reads it back."""
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)
    if path is not None:
        Path(path).write_text(text)
    return text


def parse_cli(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """Parse `--config FILE --set a.b=c ...` into a Config (and the remaining namespace)."""
    p = argparse.ArgumentParser(description="megatron-gspo run configuration")
    p.add_argument("--config", help="YAML config file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable); values are YAML scalars or [lists]",
    )
    p.add_argument("--resume", action="store_true", help="same as --set checkpoint.resume=true")
    p.add_argument("--dump", action="store_true", help="print the resolved config and exit")
    args = p.parse_args(argv)
    overrides = list(args.overrides) + (["checkpoint.resume=true"] if args.resume else [])
    return load_config(args.config, overrides), args


def _main(argv: list[str] | None = None) -> None:
    try:
        cfg, _ = parse_cli(argv)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    print(dump_config(cfg), end="")


if __name__ == "__main__":
    _main()
