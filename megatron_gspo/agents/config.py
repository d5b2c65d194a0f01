"""`AgentEndpointConfig`: the OpenAI-compatible endpoint agents talk to (`agents/server.py`)."""

from __future__ import annotations

import dataclasses

from megatron_gspo.config_io import ConfigError

ON_EDIT = ("branch", "refuse")


@dataclasses.dataclass(kw_only=True, slots=True)
class AgentEndpointConfig:
    """How the endpoint serves agents and what it does with a conversation the agent changed."""

    host: str = "127.0.0.1"
    """Interface the endpoint listens on (loopback: agents run on this machine's workers)."""
    port: int = 0
    """Port (0: a free one; the endpoint's `url` says which)."""
    model_name: str = "policy"
    """The model id `/v1/models` lists; requests may name any model (there is one policy)."""
    tool_call_parser: str | None = "qwen25"
    """SGLang's `--tool-call-parser` for the model's tool-call format (None: tool calls are
    not parsed, the text comes back as content)."""
    on_edit: str = "branch"
    """A call whose messages do not extend a recorded turn (the agent edited, truncated or
    re-sent an assistant message, or rewrote the history): `branch` serves it as a new branch
    (the replaced turn is not trained on; counted), `refuse` answers HTTP 409 (counted)."""
    max_new_tokens: int = 512
    """Cap on a call's `max_tokens` / `max_completion_tokens` (and the default without one)."""
    max_n: int = 16
    """Most choices (`n`) in one call."""
    temperature: float | None = None
    """Every call samples at this temperature whatever the agent asks (in training: the
    rollout's, since the trainer's log-probs are at `rollout.temperature`). None: the agent's."""
    top_p: float | None = None
    """As `temperature`, for nucleus sampling (None: the agent's)."""

    def __post_init__(self) -> None:
        if self.on_edit not in ON_EDIT:
            raise ConfigError(
                f"agent endpoint on_edit must be one of {ON_EDIT}, got {self.on_edit!r}"
            )
        if self.max_new_tokens < 1:
            raise ConfigError("agent endpoint max_new_tokens must be >= 1")
        if self.max_n < 1:
            raise ConfigError("agent endpoint max_n must be >= 1")
        if self.temperature is not None and self.temperature < 0:
            raise ConfigError("agent endpoint temperature must be >= 0 (or null)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError("agent endpoint top_p must be in (0, 1] (or null)")
        if not 0 <= self.port < 65536:
            raise ConfigError("agent endpoint port must be in [0, 65535]")
