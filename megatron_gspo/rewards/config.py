"""`reward:` config section: how responses are scored (the kind, its workers and timeout, the
HTTP judge, DAPO overlong shaping). Worker limits are the `sandbox:` section."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gspo.config_io import positive, require

__all__ = ["RewardConfig", "check_overlong_buffer"]

_BUILTIN_KINDS = ("math", "toy", "pattern", "http")


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """How responses are scored."""

    kind: str = "math"
    """math (math-verify on boxed / final answers), toy (the built-in digit task), pattern
    (the long-response repeat task, `rewards/pattern.py`), http (a
    judge model served at reward.url, `rewards/http.py`), or a user function as
    "package.module:function" with signature (prompt, response, answer) -> float."""
    num_workers: int = 2
    """Worker processes for reward calls; 0 runs in-process (no timeout enforcement). With
    reward.kind=http: requests in flight at once (0: one)."""
    timeout_s: float = 10.0
    """Per-call timeout; a call past it scores 0 and counts in reward/timeouts (http: per
    attempt; the last attempt's timeout counts)."""
    url: str | None = None
    """reward.kind=http: the judge's endpoint, POST {"prompt", "response", "answer"} ->
    {"reward": number}."""
    retries: int = 2
    """reward.kind=http: retries of a request that failed to connect, timed out or got HTTP
    429 / 5xx (exponential backoff); counted in reward/retries."""
    api_key_env: str | None = None
    """reward.kind=http: environment variable whose value is sent as a Bearer token."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment (https://arxiv.org/abs/2503.14476, eq. 13): responses
    longer than L - overlong_buffer tokens (L = rollout.max_new_tokens; the episode cap with
    rollout.env) get reward.overlong_penalty * (L - overlong_buffer - |y|) / overlong_buffer
    added to their reward (-overlong_penalty at L). 0: off."""
    overlong_penalty: float = 1.0
    """Scale of the overlong punishment (its value at the length cap is -overlong_penalty)."""

    def __post_init__(self) -> None:
        require(
            (self.kind == "http") == bool(self.url),
            f"reward.url is the judge of reward.kind=http (kind={self.kind!r}, url="
            f"{self.url!r}); set both or neither",
        )
        require(self.retries >= 0, f"reward.retries={self.retries} must be >= 0; change it")
        if self.kind not in _BUILTIN_KINDS:
            mod, sep, fn = self.kind.partition(":")
            require(
                bool(sep and mod and fn),
                f'reward.kind={self.kind!r} is not math, toy, pattern, http or "module:function"; '
                "change reward.kind",
            )
        require(
            self.num_workers >= 0,
            f"reward.num_workers={self.num_workers} must be >= 0; change reward.num_workers",
        )
        require(
            self.num_workers > 0 or self.kind in _BUILTIN_KINDS,
            f"reward.num_workers=0 runs the reward in the trainer, which only the built-in kinds "
            f"may do; user code (reward.kind={self.kind!r}) runs in worker processes: set "
            "reward.num_workers >= 1",
        )
        require(
            self.overlong_buffer >= 0 and self.overlong_penalty >= 0,
            f"reward.overlong_buffer={self.overlong_buffer} and reward.overlong_penalty="
            f"{self.overlong_penalty} must be >= 0; change them",
        )
        positive("reward", timeout_s=self.timeout_s)


def check_overlong_buffer(reward: RewardConfig, episode_tokens: int) -> None:
    """The overlong buffer lies within the response cap (`RolloutConfig.episode_tokens`)."""
    require(
        reward.overlong_buffer <= episode_tokens,
        f"reward.overlong_buffer={reward.overlong_buffer} exceeds the response cap of "
        f"{episode_tokens} tokens (rollout.max_new_tokens); lower reward.overlong_buffer",
    )
