"""The `rollout` section of the run config: sampling, the rollout modes (over-sampling,
dynamic sampling, partial and asynchronous rollouts: `rollout/scheduler.py`), multi-turn
environments (`rollout/multiturn.py`) and the engines (`launch`, `client`). Part of
`megatron_gspo.config.Config`; kept here so each section stays one screen to read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gspo.config_io import positive as _positive
from megatron_gspo.config_io import require as _require
from megatron_gspo.engines.client_config import ClientConfig
from megatron_gspo.engines.launch import LaunchConfig

__all__ = ["RolloutConfig"]


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """Sampling, and the engines: launched by the job (`launch`) or already running
    (`launch: null` and `client.engine_urls`)."""

    temperature: float = 1.0
    """Sampling temperature (> 0: RL needs sampled, not greedy, responses)."""
    top_p: float = 1.0
    """Nucleus sampling mass; must stay 1.0: the engines sample from the renormalised nucleus
    but report (and the trainer computes) log-probs of the full softmax, so pi_old would not
    be the behaviour policy."""
    top_k: int = -1
    """Top-k sampling; must stay -1 (off), for the reason given under top_p."""
    max_new_tokens: int = 1024
    """Maximum response length in tokens."""
    oversample: float = 1.0
    """Over-sampling: generate ceil(rl.prompts_per_rollout * oversample) groups at once and
    keep the first rl.prompts_per_rollout that finish; the rest are aborted (their prompts
    return to the front of the queue) or, with rollout.partial_tokens, continued next step.
    1.0 = off."""
    drop_equal_reward_groups: bool = False
    """Dynamic sampling: drop a finished group whose rewards are all equal (no signal) and
    start another prompt instead (counted in rollout/groups_dropped)."""
    partial_tokens: int | None = None
    """Partial rollouts: each engine request generates at most this many new tokens; an
    unfinished response continues with another request, and responses still unfinished when
    the batch is full (or aborted by a weight update) continue in a later step under the new
    weights, each token keeping its engine log-prob (pi_old) and weight version. null = off."""
    async_rollout: bool = False
    """Asynchronous mode: generate the next rollout.max_staleness batches while the trainer
    trains (engines must not share the trainer's devices); weight pushes abort in-flight
    requests, which continue on the new weights, each token keeping the version that sampled
    it (its engine log-prob is its pi_old). rollout/engine_busy_frac logs how much of the
    trainer's time the engines generated."""
    max_staleness: int = 1
    """Most weight versions a trained token may lag the weights it is trained under (async
    mode and partial rollouts); an older carried partial response restarts from its prompt
    (rollout/groups_restarted). With rollout.async_rollout also how many batches are generated
    ahead of the trainer (1: one step ahead; k: the engines run k steps ahead)."""
    max_continuation_retries: int = 3
    """Partial rollouts: a sample whose continuation the client rejects (ids and log-probs
    disagree after every re-send) is retried with the next chunk at most this many times in a
    row; one more rejection stops the run with an error naming the engine problem."""
    fill_attempts: int = 4
    """A step may launch fill_attempts * ceil(prompts_per_rollout * oversample) new groups;
    if that does not fill its batch (all dropped) the run stops with an error."""
    launch: LaunchConfig | None = field(default_factory=LaunchConfig)
    """Engines this job starts on rank 0's node (null: use rollout.client.engine_urls)."""
    client: ClientConfig = field(default_factory=ClientConfig)
    """How rank 0 reaches the engines (timeouts, retries, router, API key)."""
    env: str | None = None
    """Multi-turn rollouts with an environment class "package.module:Class" (reset/step, see
    megatron_gspo/envs/__init__.py), run in env worker processes; null: one engine turn."""
    max_turns: int = 4
    """Most model turns of one episode (rollout.env only)."""
    max_total_tokens: int | None = None
    """Most response tokens of one episode, model and environment tokens together (rollout.env
    only); null: rollout.max_turns * rollout.max_new_tokens."""
    turn_stop: list[str] = field(default_factory=list)
    """Texts that end a model turn besides EOS, e.g. a tool call's closing tag (rollout.env
    only); each must be a single token of the tokenizer. The stop token stays in the turn."""
    env_workers: int = 2
    """Environment worker processes (rollout.env only); episodes are spread over them."""
    env_timeout_s: float = 10.0
    """Wall timeout of one environment call (reset or step); past it the worker is killed
    and replaced, and its episodes fail: never trained (env/timeouts)."""
    agent: str | None = None
    """Agent rollouts: an agent "package.module:function" written against the OpenAI API
    (`fn(record, openai_client) -> reward or None`, see docs/agents.md), run in sandbox
    workers with a client on the job's token-exact endpoint (megatron_gspo/agents/)."""
    agent_workers: int = 2
    """Agent worker processes (rollout.agent only): episodes that run at once."""
    agent_timeout_s: float = 600.0
    """Wall timeout of one agent episode (rollout.agent only); past it the worker is killed
    and replaced, and the episode is failed (masked and counted)."""

    def __post_init__(self) -> None:
        _positive("rollout", temperature=self.temperature, top_p=self.top_p)
        _positive(
            "rollout",
            max_turns=self.max_turns,
            max_total_tokens=self.max_total_tokens,
            env_workers=self.env_workers,
            env_timeout_s=self.env_timeout_s,
        )
        if self.agent is not None:
            mod, sep, fn = self.agent.partition(":")
            _require(
                bool(sep and mod and fn),
                f'rollout.agent={self.agent!r} is not "module:function"; change rollout.agent',
            )
            _require(
                self.env is None and self.partial_tokens is None,
                "rollout.agent runs whole agent episodes; unset rollout.env and "
                "rollout.partial_tokens",
            )
            _positive(
                "rollout", agent_workers=self.agent_workers, agent_timeout_s=self.agent_timeout_s
            )
        if self.env is not None:
            mod, sep, cls = self.env.partition(":")
            _require(
                bool(sep and mod and cls),
                f'rollout.env={self.env!r} is not "module:Class"; change rollout.env',
            )
        _require(
            self.env is not None or not self.turn_stop,
            "rollout.turn_stop ends model turns of multi-turn rollouts only; set rollout.env "
            "or remove rollout.turn_stop",
        )
        _require(self.top_p <= 1, f"rollout.top_p={self.top_p} must be <= 1; change rollout.top_p")
        _require(
            self.top_k == -1 or self.top_k >= 1,
            f"rollout.top_k={self.top_k} must be -1 (off) or >= 1; change rollout.top_k",
        )
        why = (
            "the engine samples from the renormalised truncated distribution but reports (and "
            "the trainer computes) log-probs of the full softmax, so pi_old would not be the "
            "behaviour policy"
        )
        _require(self.top_p == 1, f"rollout.top_p={self.top_p}: {why}; set rollout.top_p=1")
        _require(self.top_k == -1, f"rollout.top_k={self.top_k}: {why}; set rollout.top_k=-1")
        _require(
            self.max_continuation_retries >= 0,
            f"rollout.max_continuation_retries={self.max_continuation_retries} must be >= 0; "
            "change rollout.max_continuation_retries",
        )
        _positive("rollout", max_new_tokens=self.max_new_tokens)
        _require(
            self.oversample >= 1.0,
            f"rollout.oversample={self.oversample} must be >= 1 (1 = off); change "
            "rollout.oversample",
        )
        _positive("rollout", partial_tokens=self.partial_tokens, fill_attempts=self.fill_attempts)
        _require(
            self.max_staleness >= 0,
            f"rollout.max_staleness={self.max_staleness} must be >= 0; change "
            "rollout.max_staleness",
        )
        _require(
            self.max_staleness >= 1 or not (self.async_rollout or self.partial_tokens),
            "rollout.async_rollout and rollout.partial_tokens train on tokens of an older "
            "weight version: rollout.max_staleness must be >= 1; change rollout.max_staleness",
        )
        _require(
            self.env is None or self.partial_tokens is None,
            "rollout.partial_tokens continues single-turn responses only (a multi-turn episode "
            "restarts when cut); unset rollout.partial_tokens or rollout.env",
        )
        launched, listed = self.launch is not None, bool(self.client.engine_urls)
        _require(
            launched != listed,
            "set exactly one of rollout.launch (engines this job starts) and "
            "rollout.client.engine_urls (engines already running; then rollout.launch: null)",
        )

    @property
    def episode_tokens(self) -> int:
        """Most response tokens of one sample (an episode's cap with rollout.env)."""
        if self.env is None:
            return self.max_new_tokens
        return self.max_total_tokens or self.max_turns * self.max_new_tokens

    @property
    def embedded(self) -> bool:
        """True when rollouts run on engines of this package (the CPU engine)."""
        return self.launch is not None and self.launch.backend == "embedded"

    def check_async_colocation(self) -> None:
        """Asynchronous rollouts generate while the trainer trains, on devices of their own."""
        _require(
            not (self.async_rollout and self.launch is not None and self.launch.colocated),
            "rollout.async_rollout=true generates while the trainer trains, which colocated "
            "engines (rollout.launch.colocated=true) cannot; set one of them to false",
        )
