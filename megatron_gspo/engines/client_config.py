"""`ClientConfig`: how `SGLangClient` reaches its engines (`rollout.client` in a run config)."""

from __future__ import annotations

import dataclasses

from megatron_gspo.config_io import ConfigError, at_least, positive


@dataclasses.dataclass(kw_only=True, slots=True)
class ClientConfig:
    """How the client reaches its engines."""

    engine_urls: list[str] = dataclasses.field(default_factory=list)
    """Base URL of every engine (`http://host:port`); control calls go to each of them. In a run
    config: only for engines already running (`rollout.launch: null`); launched engines fill
    it in."""
    router_url: str | None = None
    """If set, `/generate` goes through this `sglang-router` instead of client-side balancing."""
    engine_tp_sizes: list[int] | None = None
    """TP size of each engine (ranks in the weight-update group); default 1 each."""
    engine_gpu_ids: list[list[int]] | None = None
    """For engines already running on the trainer's GPUs: per engine, the GPU index of each TP
    rank on its node (`[[0, 1], [2, 3]]` for two TP-2 engines from GPU 0). With it, colocated
    `weights.senders=owners` pushes feed each engine rank from the trainer rank on that GPU
    (`weights.owners_home`: no CUDA-IPC handle crosses GPUs); None: unknown, each parameter's
    sender writes every engine rank's part. The planner's Slurm launch files set it; launched
    engines fill it in."""
    max_batch_per_request: int = 64
    """Most (prompt, sample) entries in one `/generate` request."""
    max_inflight_per_engine: int = 4
    """Most concurrent `/generate` requests per engine."""
    request_timeout_s: float = 1800.0
    """Total timeout of one `/generate` request."""
    control_timeout_s: float = 600.0
    """Total timeout of one control call (weight updates can be slow)."""
    connect_timeout_s: float = 10.0
    """Timeout of opening one TCP connection to an engine."""
    max_retries: int = 6
    """Re-sends of one `/generate` request before giving up."""
    backoff_s: float = 0.2
    """First retry delay; doubles per retry, capped at `backoff_max_s`."""
    backoff_max_s: float = 10.0
    """Longest retry delay."""
    engine_cooldown_s: float = 5.0
    """How long an engine that failed is skipped."""
    dead_after_failures: int = 3
    """Failed `/generate` requests in a row (connection error, timeout, 5xx, garbage or
    inconsistent samples) after which an engine is dropped: no more generation, control calls
    or weight syncs until it answers its health probe again and has received the full weights
    (`engines/pool.py`). A failed control call (e.g. part of a weight sync) drops it at
    once."""
    resubmit_aborted: int = 0
    """Times a sample that finished with `abort` (e.g. `pause_generation("abort")` during a
    weight sync) is generated again from scratch, same seed; 0 returns it flagged `abort`."""
    use_native_n: bool = False
    """Use SGLang's `n` instead of client-side expansion (unseeded sampling only)."""
    validate_requests: bool = False
    """Check every body with SGLang's own request classes before sending (tests, debugging)."""
    api_key: str | None = None
    """Bearer token if the servers run with `--api-key` / `--admin-api-key`."""
    return_routed_experts: bool = False
    """Ask every `/generate` for the experts each token was routed to (SGLang's
    `return_routed_experts`; the server needs `--enable-return-routed-experts`) and put them in
    `Sample.routed_experts`. Set by the job when `rl.routing_replay` is on (a study control)."""
    num_experts_per_tok: int = 0
    """Top-k of the served MoE model, to decode the routed experts (with
    `return_routed_experts`); the job fills it from the model's config."""

    def __post_init__(self) -> None:
        c = "rollout.client"  # a zero timeout or batch would fail every request; < 0: nonsense
        positive(c, max_batch_per_request=self.max_batch_per_request,
                 max_inflight_per_engine=self.max_inflight_per_engine,
                 request_timeout_s=self.request_timeout_s,
                 control_timeout_s=self.control_timeout_s,
                 connect_timeout_s=self.connect_timeout_s)  # fmt: skip
        at_least(c, 0, max_retries=self.max_retries, backoff_s=self.backoff_s,
                 backoff_max_s=self.backoff_max_s, engine_cooldown_s=self.engine_cooldown_s,
                 resubmit_aborted=self.resubmit_aborted,
                 num_experts_per_tok=self.num_experts_per_tok)  # fmt: skip
        if self.dead_after_failures < 1:
            raise ConfigError(
                f"rollout.client.dead_after_failures={self.dead_after_failures} must be >= 1"
            )
        for url in self.engine_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"rollout.client.engine_urls entry {url!r} is not an http(s) URL; fix it"
                )
        if self.return_routed_experts and self.num_experts_per_tok < 1:
            raise ConfigError(
                "rollout.client.return_routed_experts needs rollout.client.num_experts_per_tok "
                "(the model's top-k) >= 1; set it"
            )
        self.engine_urls = [u.rstrip("/") for u in self.engine_urls]
        if self.engine_tp_sizes is None:
            self.engine_tp_sizes = [1] * len(self.engine_urls)
        if len(self.engine_tp_sizes) != len(self.engine_urls):
            raise ConfigError(
                "rollout.client.engine_tp_sizes needs one entry per rollout.client.engine_urls"
            )
        gpus = self.engine_gpu_ids
        if gpus is not None and [len(g) for g in gpus] != list(self.engine_tp_sizes):
            raise ConfigError(
                f"rollout.client.engine_gpu_ids={gpus} needs one list per engine_urls entry, "
                f"as long as its TP size ({self.engine_tp_sizes}); fix it or set it to null"
            )
        if gpus is not None and any(g < 0 for one in gpus for g in one):
            raise ConfigError(f"rollout.client.engine_gpu_ids={gpus}: GPU indices are >= 0")
