"""The experts an engine routed each token to (SGLang's `return_routed_experts`), for Routing
Replay as a study control (`rl.routing_replay`; the project's default trains WITHOUT replay).

SGLang 0.5.23 wire format (server flag `--enable-return-routed-experts`, request field
`return_routed_experts: true`, optional `routed_experts_start_len`): `meta_info.routed_experts`
is base64 of a C-order int32 array `[N, L, K]`, `L` = the model's `num_hidden_layers`, `K` =
`num_experts_per_tok`, one row per token position in `[start_len, P + R - 1)` of the prompt
(`P` tokens) plus response (`R` tokens): every token the engine fed through the model, prompt
tokens (prefill) included; the last response token is never fed, so it has no row
(`sglang/srt/state_capturer/base.py` `get_topk`, decoded as in
`state_capturer/routed_experts.py` `extract_routed_experts_from_meta_info`). A layer without a
router (a dense layer) has zeros. Without the server flag SGLang omits the field.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from megatron_gspo.engines.protocols import EngineError

if TYPE_CHECKING:
    from megatron_gspo.engines.client_config import ClientConfig
    from megatron_gspo.engines.launch import LaunchConfig
    from megatron_gspo.engines.types import Sample

META_KEY = "routed_experts"
"""`meta_info` key of a `/generate` answer holding the base64 array."""
SERVER_FLAG = "--enable-return-routed-experts"
"""`sglang.launch_server` flag that makes the server capture routed experts."""


class RoutedExpertsMissing(EngineError):
    """The engine was asked for routed experts and returned none (a set-up error: never
    retried, unlike an unusable answer)."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class RoutedExperts:
    """Top-k expert ids per token position and layer, as the engine routed them."""

    indices: torch.Tensor
    """`[N, L, K]` int32: row `i` is position `start + i` of prompt + response."""
    start: int = 0
    """First position covered (SGLang's `routed_experts_start_len`; 0: from the first prompt
    token)."""

    @property
    def num_layers(self) -> int:
        return int(self.indices.shape[1])

    @property
    def topk(self) -> int:
        return int(self.indices.shape[2])

    def encode(self) -> str:
        """The base64 string SGLang puts in `meta_info.routed_experts`."""
        arr = self.indices.to(torch.int32).contiguous().numpy()
        return base64.b64encode(arr.tobytes()).decode("ascii")


def decode(
    value: str, *, topk: int, prompt_len: int, response_len: int, start: int = 0
) -> RoutedExperts:
    """Decode `meta_info.routed_experts`: `[N, L, K]` for positions
    `[start, prompt_len + response_len - 1)`, `L` inferred from the size (the client does not
    know the model; the trainer checks `L` against its own layer count)."""
    import numpy as np

    flat = np.frombuffer(base64.b64decode(value), dtype=np.int32)
    rows = max(prompt_len + response_len - 1 - start, 0)
    per_row = flat.size // rows if rows else 0
    if (
        topk < 1
        or (rows and (flat.size != rows * per_row or per_row % topk))
        or (not rows and flat.size)
    ):
        raise ValueError(
            f"routed_experts holds {flat.size} ids: not {rows} positions x layers x top-{topk} "
            f"(prompt {prompt_len}, response {response_len}, start {start})"
        )
    indices = torch.from_numpy(flat.copy()).view(rows, per_row // topk if rows else 0, topk)
    return RoutedExperts(indices=indices, start=start)


def missing_message(engine: str) -> str:
    """The one-line error when replay is on and an engine returned no routed experts."""
    return (
        f"rl.routing_replay=true but engine {engine} returned no routed experts: launch SGLang "
        f"with {SERVER_FLAG} (rollout.launch adds it when rl.routing_replay is on), or set "
        "rl.routing_replay=false"
    )


def attach_routed_experts(sample: Sample, meta: dict[str, Any], topk: int, engine: str) -> None:
    """`sample.routed_experts` from a `/generate` answer's `meta_info` (the client asked for
    them). An aborted sample may carry none (SGLang drops it with the request); any other
    sample without them is a set-up error, raised as `RoutedExpertsMissing`."""
    value = meta.get(META_KEY)
    if value is None:
        if sample.finish_reason == "abort":
            return
        raise RoutedExpertsMissing(missing_message(engine), url=engine)
    sample.routed_experts = decode(
        value, topk=topk, prompt_len=len(sample.prompt_ids), response_len=len(sample.response_ids)
    )


def ask_for_routes(
    launch: LaunchConfig | None, client: ClientConfig, topk: int
) -> tuple[LaunchConfig | None, ClientConfig]:
    """`rl.routing_replay`: the launch config with the server flag (launched engines) and the
    client config that asks every `/generate` for the routes of a top-`topk` model."""
    if launch is not None and SERVER_FLAG not in launch.extra_args:
        launch = dataclasses.replace(launch, extra_args=[*launch.extra_args, SERVER_FLAG])
    client = dataclasses.replace(client, return_routed_experts=True, num_experts_per_tok=topk)
    return launch, client


def model_topk(hf_path: str) -> int:
    """`num_experts_per_tok` of the HF model at `hf_path` (what the engines serve)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_path)
    cfg = getattr(cfg, "text_config", None) or cfg
    topk = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
    if topk < 1:
        from megatron_gspo.config_io import ConfigError

        raise ConfigError(
            f"rl.routing_replay=true needs a MoE model; {hf_path} has no num_experts_per_tok: "
            "set rl.routing_replay=false"
        )
    return topk
