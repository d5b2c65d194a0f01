"""The run configuration: one YAML file -> nested typed dataclasses, with `--set a.b=c` overrides.

No Megatron import: the one adapter in `megatron_gspo/megatron/` translates these sections into
megatron-core objects. Sections owned by a component are that component's own dataclass
(`loss` is `algo.PolicyLossConfig`, `parallel` is `layout.Layout`, `model` / `optim` are in
`megatron/config.py`, `data` in `data/config.py`, `weights` is `weights.config.WeightSyncConfig`,
`rollout.launch` / `rollout.client` are the launcher's and the client's), so every knob has one
name and one check. Every field carries a docstring (the string literal under it; `field_docs()`
reads them back for `--keys`), and every check raises a `ConfigError` whose message names the
key to change.

Loading is three steps: each section checks itself, `Config.__post_init__` checks them against
each other (through the checks next to each section), and `resolve` fills in the values other
keys imply, once, into a new `Config`. The wings never see a `Config`: `policy_spec()` and
`rollout_spec()` are what `megatron/` and `rollout/` read of it.

    cfg = load_config("examples/tiny_moe_cpu.yaml", ["loss.kind=grpo", "parallel.ep=2"])
    dp = cfg.parallel.validate(world_size, hf_config)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_gspo.algo.config import PolicyLossConfig
from megatron_gspo.config_inert import check_inert_keys
from megatron_gspo.config_io import (
    ConfigError,
    apply_override,
    at_least,
    build_dataclass,
    describe_keys,
    field_docs,
    plain,
    positive,
    read_yaml,
    require,
)
from megatron_gspo.data.config import DataConfig
from megatron_gspo.engines import sglang_rules
from megatron_gspo.engines.client_config import ClientConfig
from megatron_gspo.engines.launch import LaunchConfig
from megatron_gspo.layout import Layout
from megatron_gspo.megatron.config import (
    ModelConfig,
    OptimConfig,
    PolicySpec,
    check_routing_replay,
)
from megatron_gspo.rewards.config import RewardConfig, check_overlong_buffer
from megatron_gspo.rollout.config import RolloutConfig
from megatron_gspo.rollout.evaluation import EvalConfig
from megatron_gspo.rollout.spec import RolloutSpec
from megatron_gspo.sandbox.config import SandboxConfig
from megatron_gspo.weights.config import WeightSyncConfig, check_fp8_sync

__all__ = [
    "CheckpointConfig",
    "ClientConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "RLConfig",
    "LaunchConfig",
    "Layout",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "PolicyLossConfig",
    "PolicySpec",
    "RewardConfig",
    "RolloutConfig",
    "RolloutSpec",
    "TrainConfig",
    "WeightSyncConfig",
    "config_from_dict",
    "dump_config",
    "field_docs",
    "load_config",
    "parse_cli",
    "resolve",
]

_require = require
_positive = positive
_CFG = dict(kw_only=True, slots=True)


@dataclass(**_CFG)
class RLConfig:
    """How a rollout becomes updates: groups, mini-batches, advantages and where pi_old comes
    from (the loss itself is the `loss` section)."""

    group_size: int = 8
    """G: responses sampled per prompt (advantages are relative within a group)."""
    prompts_per_rollout: int = 32
    """P: prompts per rollout; a rollout holds P * G responses."""
    mini_batches_per_rollout: int = 4
    """Optimizer steps per rollout; the paper splits each rollout into 4 mini-batches."""
    pi_old: Literal["engine", "recompute"] = "engine"
    """Where pi_old comes from: the engine's sampling log-probs (the paper's claim: no recompute)
    or a trainer forward pass before the first update."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group std (false: A_i = r_i - mean)."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing."""
    routing_replay: bool = False
    """STUDY CONTROL, not a recommended mode: the engines return the experts they routed each
    token to and the policy's forward passes replay them (megatron-core `RouterReplay`,
    `megatron/replay.py`), the R3 baseline the project argues GSPO does not need. Needs engines
    that return routed experts: the embedded engine, or SGLang on GPUs (SGLang 0.5.23 cannot
    capture them on CPU)."""

    def __post_init__(self) -> None:
        _positive("rl", adv_eps=self.adv_eps)
        _require(
            self.group_size >= 2,
            f"rl.group_size={self.group_size} must be >= 2 (a group of one has no relative "
            "advantage); change rl.group_size",
        )
        for name in ("prompts_per_rollout", "mini_batches_per_rollout"):
            v = getattr(self, name)
            _require(v >= 1, f"rl.{name}={v} must be >= 1; change rl.{name}")
        n = self.prompts_per_rollout * self.group_size
        _require(
            n % self.mini_batches_per_rollout == 0,
            f"rl.prompts_per_rollout*group_size = {n} responses do not split into "
            f"rl.mini_batches_per_rollout={self.mini_batches_per_rollout} equal mini-batches; "
            "change rl.mini_batches_per_rollout or rl.prompts_per_rollout",
        )

    @property
    def rollout_size(self) -> int:
        """Responses per rollout (P * G)."""
        return self.prompts_per_rollout * self.group_size


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
    wandb_run_id: str | None = None
    """W&B run id to log to; None: a resumed run (--resume from a checkpoint) continues the
    run whose id is stored in logging.dir/wandb_run_id, a fresh run starts a new one."""
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
    """Rollout steps (each: one rollout, rl.mini_batches_per_rollout optimizer steps)."""
    seed: int = 0
    """Seed of model init and sampling (data order uses data.seed)."""
    micro_batch_tokens: int = 8192
    """Token budget of a packed micro-batch (prompt + response tokens)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda when available, else cpu (gloo)."""
    max_bad_steps: int = 3
    """Stop after this many consecutive rollout steps whose loss or gradient norm was not
    finite (each such optimizer step is skipped): write a checkpoint and exit non-zero."""
    max_failed_reward_steps: int = 3
    """Stop after this many consecutive rollout steps in which every reward call failed
    (raised, timed out, or returned NaN / None / a non-number: each scores 0, so such steps
    train on nothing): write a checkpoint and exit with code 3 naming the first errors.
    0 = never stop for this."""
    routing_flip_every: int = 1
    """Measure `moe/routing_flip_rate` (share of (token, MoE layer) whose top-k experts changed
    between the rollout policy and the updated one) every N steps: two forward passes over each
    rank's first micro-batch(es). 0 = never."""
    routing_flip_per_minibatch: bool = False
    """Also log `moe/routing_flip_rate_mb/<k>` for mini-batches k = 2..rl.mini_batches_per_rollout
    (steps where the flip rate is measured): the same share, between the rollout policy and the
    weights mini-batch k is trained at (after k - 1 optimizer steps). Costs one more forward
    over the probed micro-batch(es) per mini-batch after the first: on the evidence study's
    tiny config (1 CPU rank, 16 sequences, 4 mini-batches) 0.28-0.32 s of CPU per update
    against 0.21-0.26 s without, hence off by default."""
    dist_timeout_s: float = 3600.0
    """Timeout in seconds of every collective of the default process group. While rank 0
    generates a rollout the other ranks wait in one (a broadcast), so it must exceed the
    longest rollout plus reward and weight sync; torch's own default, 600 s, is too short
    for long RL generations."""
    stop_grace_s: float = 600.0
    """After SIGTERM or Ctrl-C the job finishes the current step, writes a checkpoint and
    exits; a rank still running this many seconds after the signal (a step that does not
    finish, a peer that died) exits without one. Under torchrun, raise its --shutdown-timeout
    (default 30 s, after which it SIGKILLs its workers) to at least this."""

    def __post_init__(self) -> None:
        at_least("train", 0, seed=self.seed)  # numpy's generators refuse a negative seed
        _positive(
            "train",
            steps=self.steps,
            micro_batch_tokens=self.micro_batch_tokens,
            max_bad_steps=self.max_bad_steps,
            dist_timeout_s=self.dist_timeout_s,
            stop_grace_s=self.stop_grace_s,
        )
        _require(
            self.max_failed_reward_steps >= 0,
            f"train.max_failed_reward_steps={self.max_failed_reward_steps} must be >= 0 "
            "(0 = off); change train.max_failed_reward_steps",
        )
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
    parallel: Layout = field(default_factory=Layout)
    """Parallel layout."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy loss: GSPO, GSPO-token or GRPO, clip ranges, mismatch correction."""
    rl: RLConfig = field(default_factory=RLConfig)
    """Groups, mini-batches, advantages, pi_old source."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout engines and sampling."""
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Weight sync from the trainer to the engines after every step."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward kind, workers and timeout."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits of the worker processes that run user reward and environment code."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation between steps (rollout/evaluation.py); off by default."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Outer loop."""

    def __post_init__(self) -> None:
        # Checks only; derived values are `resolve`'s (load_config applies it).
        self._check_token_budgets()
        self._check_pi_old()
        self._check_engines()
        self._check_routing_replay()
        self._check_schedule()
        check_inert_keys(self)  # a key another key switches off: refused, not ignored

    def _check_token_budgets(self) -> None:
        """A micro-batch holds one whole response (and episode); the overlong buffer lies
        within the response cap."""
        _require(
            self.train.micro_batch_tokens > self.rollout.max_new_tokens,
            f"train.micro_batch_tokens={self.train.micro_batch_tokens} cannot hold one response "
            f"of rollout.max_new_tokens={self.rollout.max_new_tokens} plus its prompt; raise "
            "train.micro_batch_tokens or lower rollout.max_new_tokens",
        )
        _require(
            self.train.micro_batch_tokens > self.rollout.episode_tokens,
            f"train.micro_batch_tokens={self.train.micro_batch_tokens} cannot hold one episode "
            f"of {self.rollout.episode_tokens} response tokens (rollout.max_total_tokens, or "
            "rollout.max_turns * rollout.max_new_tokens) plus its prompt; raise "
            "train.micro_batch_tokens or lower rollout.max_total_tokens",
        )
        check_overlong_buffer(self.reward, self.rollout.episode_tokens)

    def _check_pi_old(self) -> None:
        _require(
            self.loss.tis_mode == "none" or self.rl.pi_old == "recompute",
            f"loss.tis_mode={self.loss.tis_mode} compares a recomputed pi_old with the engine; "
            "set rl.pi_old=recompute or loss.tis_mode=none",
        )

    def _check_engines(self) -> None:
        """What the engines can hold and do: FP8 sync, weight updates, colocation."""
        launch = self.rollout.launch
        check_fp8_sync(self.weights, embedded=self.rollout.embedded, fp8_engine=_embedded_fp8(self))
        sglang_rules.check_weight_updates(launch, self.weights.transport)
        sglang_rules.check_memory_release(launch)
        self.rollout.check_async_colocation()

    def _check_routing_replay(self) -> None:
        """rl.routing_replay (a study control): what replay cannot serve."""
        if not self.rl.routing_replay:
            return
        sglang_rules.check_routed_experts(self.rollout.launch)
        _require(
            self.rollout.env is None,
            "rl.routing_replay=true is not wired for multi-turn episodes (rollout.env); unset "
            "rollout.env or set rl.routing_replay=false",
        )
        check_routing_replay(self.model)

    def _check_schedule(self) -> None:
        optimizer_steps = self.train.steps * self.rl.mini_batches_per_rollout
        _require(
            self.optim.warmup_steps < optimizer_steps,
            f"optim.warmup_steps={self.optim.warmup_steps} must be below the run's "
            f"{optimizer_steps} optimizer steps (train.steps * rl.mini_batches_per_rollout); "
            "change optim.warmup_steps",
        )

    def policy_spec(self) -> PolicySpec:
        """What the policy (`megatron/policy.py`) reads of this run."""
        launch = self.rollout.launch
        return PolicySpec(
            **self._sections_of(PolicySpec),
            seed=self.train.seed,
            optimizer_steps=self.train.steps * self.rl.mini_batches_per_rollout,
            mini_batches=self.rl.mini_batches_per_rollout,
            pi_old=self.rl.pi_old,
            adv_eps=self.rl.adv_eps,
            normalize_std=self.rl.normalize_std,
            routing_replay=self.rl.routing_replay,
            micro_batch_tokens=self.train.micro_batch_tokens,
            routing_flip_every=self.train.routing_flip_every,
            routing_flip_per_minibatch=self.train.routing_flip_per_minibatch,
            temperature=self.rollout.temperature,
            offload_trainer=bool(launch and launch.colocated and launch.offload_trainer),
        )

    def rollout_spec(self) -> RolloutSpec:
        """What rank 0's rollout (`rollout/experience.py`) reads of this run."""
        return RolloutSpec(
            **self._sections_of(RolloutSpec),
            hf_path=self.model.hf_path,
            tokenizer_path=self.model.tokenizer_path,
            group_size=self.rl.group_size,
            prompts_per_rollout=self.rl.prompts_per_rollout,
            adv_eps=self.rl.adv_eps,
            normalize_std=self.rl.normalize_std,
            mask_truncated=self.loss.mask_truncated,
            seed=self.train.seed,
            steps=self.train.steps,
            micro_batch_tokens=self.train.micro_batch_tokens,
            log_dir=self.logging.dir,
        )

    def _sections_of(self, spec: type) -> dict[str, Any]:
        """The whole sections a wing's spec takes: its fields named as a section of this
        config (the spec's field list is the one list)."""
        names = {f.name for f in dataclasses.fields(self)}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(spec) if f.name in names}

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-serialisable); `config_from_dict` inverts it."""
        return plain(dataclasses.asdict(self))


def _embedded_fp8(cfg: Config) -> bool:
    """The embedded engine emulates FP8 inference (it holds block-FP8 weights)."""
    launch = cfg.rollout.launch
    return bool(cfg.rollout.embedded and launch is not None and launch.quantization)


def resolve(cfg: Config) -> Config:
    """The values other keys imply, decided once before anything starts (`load_config` applies
    it): a new `Config`, `cfg` unchanged. Keys set in the config are kept.

    - weights.engine_ep_size: rollout.launch.ep_size (what each engine TP rank holds of the
      experts, for verification)
    - weights.engine_device=auto: where the engines hash their weights, when the launch says
    - rollout.launch.model_path empty: model.hf_path (the engines start from the same model)
    - weights.dtype null: what the engines hold (`_send_dtype`)
    - weights.disk_dir null with weights.transport=disk: <logging.dir>/weights
    - weights.layout=auto: hf for embedded engines of rollout.launch.tp_size > 1 (they hold
      whole HF tensors and read rank 0's payload, not SGLang's per-rank cut)
    """
    launch = cfg.rollout.launch
    weights: dict[str, Any] = {"dtype": _send_dtype(cfg)}
    if launch is not None:
        weights["engine_ep_size"] = launch.ep_size
        if cfg.rollout.embedded and launch.tp_size > 1 and cfg.weights.layout == "auto":
            weights["layout"] = "hf"
        device = sglang_rules.checksum_device(launch)
        if cfg.weights.engine_device == "auto" and device is not None:
            weights["engine_device"] = device
        if not launch.model_path:
            launch = dataclasses.replace(launch, model_path=cfg.model.hf_path)
    if cfg.weights.transport == "disk" and cfg.weights.disk_dir is None:
        weights["disk_dir"] = f"{cfg.logging.dir}/weights"
    return dataclasses.replace(
        cfg,
        weights=dataclasses.replace(cfg.weights, **weights),
        rollout=dataclasses.replace(cfg.rollout, launch=launch),
    )


def _send_dtype(cfg: Config) -> str | None:
    """weights.dtype, or the dtype the engines hold when it is null: the embedded engine holds
    fp32 and checks what it holds (FP8 sync sends its unquantised tensors in it; a bf16
    trainer's weights go as an exact upcast); a real server casts what it receives to its own
    dtype (`sglang_rules.received_dtype`), so that one; else null (the trainer's)."""
    w = cfg.weights
    if w.dtype is not None:
        return w.dtype
    if _embedded_fp8(cfg) or (cfg.rollout.embedded and cfg.model.dtype != "fp32"):
        return "float32"
    return None if w.fp8 else sglang_rules.received_dtype(cfg.rollout.launch)


# ---------------------------------------------------------------------------------------------
# loading, overrides, dumping


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a `Config` from a nested dict (e.g. parsed YAML)."""
    _require(isinstance(data, dict), f"the config must be a mapping, got {type(data).__name__}")
    reward = data.get("reward") or {}
    moved = [k for k in ("max_memory_mb", "max_cpu_s", "pass_env") if k in reward]
    key = moved[0] if moved else ""
    _require(
        not moved,
        f"reward.{key} is now sandbox.{key} (the limits hold for reward and environment "
        "workers alike); move it under `sandbox:`",
    )
    _require(
        "gspo" not in data,
        "the config section `gspo:` is now `rl:` (it drives GRPO too); rename it (and any "
        "--set gspo.KEY=... to --set rl.KEY=...)",
    )
    return resolve(build_dataclass(Config, data))


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config file (None: start from an empty mapping), apply `section.key=value`
    overrides (values parsed as YAML scalars / flow lists), and validate."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = read_yaml(Path(path))
        _require(
            loaded is None or isinstance(loaded, dict),
            f"{path}: the top level must be a mapping of sections (model:, data:, ...), "
            f"got {type(loaded).__name__}",
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
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a logging.dir / checkpoint.dir that holds a previous run (its "
        "metrics and checkpoints are deleted); without it, or --resume, such a run is refused",
    )
    p.add_argument("--dump", action="store_true", help="print the resolved config and exit")
    args = p.parse_args(argv)
    if args.resume and args.overwrite:
        p.error("--resume and --overwrite contradict each other; pass one")
    overrides = list(args.overrides) + (["checkpoint.resume=true"] if args.resume else [])
    return load_config(args.config, overrides), args


def _main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    keys = "--keys" in argv
    if keys:
        argv.remove("--keys")
        if "--config" not in argv:  # the two required keys, so the defaults can be shown
            argv += ["--set", "model.hf_path=MODEL", "--set", "data.train_path=DATA.jsonl"]
    try:
        cfg, _ = parse_cli(argv)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    print(describe_keys(cfg) if keys else dump_config(cfg), end="")


if __name__ == "__main__":
    _main()
