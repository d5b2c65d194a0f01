"""The embedded engine's routed experts, in SGLang's `return_routed_experts` layout.

Forward hooks on the HF model's MoE routers (`model.layers.{i}.mlp.gate`, e.g. transformers'
`Qwen3MoeTopKRouter`, whose output is `(router_logits, top-k weights, top-k indices)`) write
the top-k expert ids of every token each forward pass feeds, at that token's position. As
SGLang's capturer: one row per fed position (prompt tokens in the prefill, then each sampled
token when it is fed back; the last response token is never fed), `[P + R - 1, L, K]` int32
over all `L = num_hidden_layers` layers (zeros for a layer without a router). A KV-cache
rebuild (retraction) re-feeds the tokens and overwrites their rows, as SGLang's re-prefill does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from megatron_gspo.layout import HFConfig

# A router's output: (router_logits, top-k weights, top-k indices); the hook reads the last.
type _RouterOut = tuple[torch.Tensor, ...]
type _Hook = Callable[[torch.nn.Module, tuple[torch.Tensor, ...], _RouterOut], None]

_GATE_RE = re.compile(r"(?:.*\.)?layers\.(\d+)\.mlp\.gate")


class RouteCapture:
    """Hooks on every MoE router of `model`; `record(buffer, start)` arms them for one forward
    (the caller holds the model's lock, so one forward at a time writes)."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = cast("HFConfig", model.config)  # (Module attributes type as Tensor | Module)
        self.num_layers = int(cfg.num_hidden_layers)
        self.topk = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        self._target: tuple[torch.Tensor, int] | None = None
        self.layers: list[int] = []
        for name, mod in model.named_modules():
            m = _GATE_RE.fullmatch(name)
            if m is not None and hasattr(mod, "top_k"):
                layer = int(m.group(1))
                self.layers.append(layer)
                mod.register_forward_hook(self._hook(layer))

    @property
    def supported(self) -> bool:
        """Whether the model has MoE routers to report."""
        return bool(self.layers) and self.topk > 0

    def buffer(self, positions: int) -> torch.Tensor:
        """An empty `[positions, L, K]` int32 buffer (zeros: layers without a router)."""
        return torch.zeros(positions, self.num_layers, self.topk, dtype=torch.int32)

    def _hook(self, layer: int) -> _Hook:
        def hook(_mod: torch.nn.Module, _inp: tuple[torch.Tensor, ...], out: _RouterOut) -> None:
            if self._target is None:
                return
            buf, start = self._target
            idx = out[2]  # [T, K] top-k expert ids of the T tokens this forward feeds
            buf[start : start + idx.shape[0], layer] = idx.to(torch.int32)

        return hook

    def record(self, buf: torch.Tensor | None, start: int) -> _Armed:
        """Context manager: the next forward's routes go to `buf[start:]` (None: not kept)."""
        return _Armed(self, buf, start)


class _Armed:
    def __init__(self, cap: RouteCapture, buf: torch.Tensor | None, start: int) -> None:
        self.cap, self.target = cap, (buf, start) if buf is not None else None

    def __enter__(self) -> None:
        self.cap._target = self.target

    def __exit__(self, *_exc: object) -> None:
        self.cap._target = None
