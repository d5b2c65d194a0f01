"""`RolloutSpec`: all that rank 0's rollout (`rollout/experience.py`, evaluation, multi-turn and
agent episodes) reads of a run: its sections and a few values of others, built once by
`megatron_gspo.config.Config.rollout_spec()` before anything starts. The rollout never sees the
whole `Config` (`tests/test_architecture.py`). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gspo.data.config import DataConfig
from megatron_gspo.rewards.config import RewardConfig
from megatron_gspo.rollout.config import RolloutConfig
from megatron_gspo.rollout.evaluation import EvalConfig
from megatron_gspo.sandbox.config import SandboxConfig

__all__ = ["RolloutSpec"]


@dataclass(frozen=True, kw_only=True)
class RolloutSpec:
    """The rollout's view of a run (`Config.rollout_spec()`)."""

    rollout: RolloutConfig
    """The `rollout:` section (sampling, modes, engines)."""
    data: DataConfig
    """The `data:` section (the prompts)."""
    reward: RewardConfig
    """The `reward:` section."""
    sandbox: SandboxConfig
    """The `sandbox:` section (limits of reward, environment and agent workers)."""
    eval: EvalConfig
    """The `eval:` section (held-out evaluation)."""
    hf_path: str
    """model.hf_path: the tokenizer's default, the engines' context length."""
    tokenizer_path: str | None = None
    """model.tokenizer_path: the tokenizer (None: model.hf_path)."""
    group_size: int = 8
    """rl.group_size: responses per prompt."""
    prompts_per_rollout: int = 32
    """rl.prompts_per_rollout: groups per rollout."""
    adv_eps: float = 1e-6
    """rl.adv_eps: added to the group std."""
    normalize_std: bool = True
    """rl.normalize_std: divide group-centred rewards by the group std."""
    mask_truncated: bool = False
    """loss.mask_truncated: truncated responses leave the loss after their group's advantages."""
    seed: int = 0
    """train.seed: the sampling seed's base."""
    steps: int = 1
    """train.steps: the run's rollout steps (evaluation's last step)."""
    micro_batch_tokens: int = 8192
    """train.micro_batch_tokens: a prompt must fit one micro-batch with a whole response."""
    log_dir: str = "runs/default"
    """logging.dir: the engines' logs go under it."""
