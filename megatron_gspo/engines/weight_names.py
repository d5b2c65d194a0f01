"""Checksums of HF-named tensors under SGLang's own parameter names (fused q/k/v, gate/up,
stacked experts), so a weight sync is verified against a real SGLang server by default.

SGLang's `/weights_checker` `{"action": "checksum"}` hashes every parameter it holds with its
own `tensor_hash` (`sglang/srt/utils/weight_checker.py` `_hash_tensor` -> `mm_utils.tensor_hash`:
sha256 of the raw bytes on CPU, the Triton `gpu_tensor_hash` on CUDA), under its module names.
The trainer calls that same function on the device the engine uses (`engines.wire`), over the
tensor the engine holds. With one TP rank the fused parameters are plain concatenations along
dim 0 of what the trainer sends (checked against sglang 0.5.23 serving Qwen3-MoE on CPU):

    <attn>.qkv_proj.{weight,bias}   = cat(q_proj, k_proj, v_proj)
    <mlp>.gate_up_proj.{weight,bias}= cat(gate_proj, up_proj)                 (dense MLPs)
    <mlp>.experts.w13_weight        = stack_e(cat(experts.e.gate_proj, experts.e.up_proj))
    <mlp>.experts.w2_weight         = stack_e(experts.e.down_proj)

Concatenating or stacking contiguous tensors along dim 0 concatenates their bytes, so a fused
parameter is its members' bytes back to back: the members are held (copies, on the engine's
device) until the last one arrives, then assembled and hashed as one tensor
(`wire.fused_checksum`). The GPU hash is not a stream, so the members of one fused parameter
are held at once: at most one layer's experts per engine TP rank (w13 of one Qwen3-235B layer
at one rank: 3 GiB) when the expert count is given, else everything until `result()`.

FP8-quantised weights (a `<w>_scale_inv` was sent) are left out: SGLang hashes their
dequantised bf16, not the bytes sent. Not covered (a mismatch then names the tensor, it never
passes silently): TP-sharded engines (shards), MLA's fused projections.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from megatron_gspo.engines.wire import fused_checksum, on_engine_device, tensor_checksum

_ATTN = re.compile(r"^(?P<p>.*\.self_attn)\.(?P<m>q|k|v)_proj\.(?P<leaf>weight|bias)$")
_EXPERT = re.compile(r"^(?P<p>.*\.experts)\.(?P<e>\d+)\.(?P<m>gate|up|down)_proj\.weight$")
_DENSE = re.compile(r"^(?P<p>.*\.mlp)\.(?P<m>gate|up)_proj\.(?P<leaf>weight|bias)$")


def sglang_slot(name: str) -> tuple[str, tuple[int, int]] | None:
    """`(sglang_name, order_key)` of a tensor SGLang fuses, None if it keeps the HF name.

    Members of one fused parameter are laid out in increasing `order_key`.
    """
    if m := _ATTN.match(name):
        return f"{m['p']}.qkv_proj.{m['leaf']}", (0, "qkv".index(m["m"]))
    if m := _EXPERT.match(name):
        e = int(m["e"])
        if m["m"] == "down":
            return f"{m['p']}.w2_weight", (e, 0)
        return f"{m['p']}.w13_weight", (e, 0 if m["m"] == "gate" else 1)
    if m := _DENSE.match(name):
        return f"{m['p']}.gate_up_proj.{m['leaf']}", (0, 0 if m["m"] == "gate" else 1)
    return None


def _members(group: str, num_experts: int) -> list[tuple[int, int]] | None:
    """The order keys a fused parameter is made of; None while its size is unknown (experts
    without `num_experts`)."""
    if group.endswith((".qkv_proj.weight", ".qkv_proj.bias")):
        return [(0, 0), (0, 1), (0, 2)]
    if group.endswith(".w13_weight"):
        return [(e, i) for e in range(num_experts) for i in (0, 1)] if num_experts else None
    if group.endswith(".w2_weight"):
        return [(e, 0) for e in range(num_experts)] if num_experts else None
    return [(0, 0), (0, 1)]  # gate_up_proj


@dataclass
class _Group:
    parts: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    digest: str | None = None


class SGLangChecksums:
    """Feed tensors as sent (`add`), read per-parameter checksums in SGLang's naming (`result`).

    Also keeps the plain HF-named checksums (`hf`), for engines that report HF names. Every
    checksum is SGLang's own function on `device`, the device the engines hold weights on.
    """

    def __init__(
        self, *, hf: bool = True, fused: bool = True, device: str = "cpu", num_experts: int = 0
    ) -> None:
        """hf: hash fused members under their HF names too (`hf`); fused: build SGLang's
        fused checksums (`result`). device: "cpu" or "cuda" (`wire.ENGINE_DEVICES`).
        num_experts: experts stacked in one w13_weight / w2_weight (0: unknown, so their
        members are held until `result`)."""
        self.hf: dict[str, str] = {}
        self.track_hf, self.track_fused = hf, fused
        self.device, self.num_experts = device, num_experts
        self._plain: dict[str, str] = {}
        self._groups: dict[str, _Group] = {}

    def add(self, name: str, tensor: torch.Tensor, hf_digest: str | None = None) -> None:
        """Account one tensor under its HF name (any order across and within groups).
        hf_digest: its HF checksum when already known (not hashed again)."""
        slot = sglang_slot(name)
        if slot is None or self.track_hf:
            if hf_digest is None:
                hf_digest = tensor_checksum(tensor, self.device)
            self.hf[name] = hf_digest
        if slot is None:
            self._plain[name] = self.hf[name]
            return
        if not self.track_fused:
            return
        group_name, key = slot
        g = self._groups.setdefault(group_name, _Group())
        if g.digest is not None or key in g.parts:
            raise ValueError(f"{name}: sent twice into {group_name}")
        part = on_engine_device(tensor, self.device)
        if part.data_ptr() == tensor.data_ptr():  # the sender reuses its buckets once sent
            part = part.clone()
        g.parts[key] = part
        keys = _members(group_name, self.num_experts)
        if keys is not None and len(g.parts) == len(keys):
            self._close(group_name, g, keys)

    def _close(self, group_name: str, g: _Group, keys: list[tuple[int, int]]) -> None:
        missing = [k for k in keys if k not in g.parts]
        extra = sorted(set(g.parts) - set(keys))
        if missing or extra:
            raise ValueError(
                f"{group_name}: members {sorted(g.parts)} arrived, expected {keys}"
                f" (missing {missing}, unexpected {extra})"
            )
        g.digest = fused_checksum([g.parts[k] for k in keys], self.device)
        g.parts.clear()

    def result(self) -> dict[str, str]:
        """`{sglang_name: checksum}` of everything added (FP8 weights and their scales left
        out); raises if a fused parameter has a gap (e.g. q and v sent but not k), since its
        checksum would be meaningless."""
        scales = [n for n in self.hf if n.endswith("_scale_inv")]
        skip = set(scales)
        for scale in scales:
            weight = scale[: -len("_scale_inv")]
            slot = sglang_slot(weight)
            skip.add(slot[0] if slot else weight)
        out = {n: c for n, c in self._plain.items() if n not in skip}
        for group_name, g in self._groups.items():
            if g.digest is None:
                keys = _members(group_name, self.num_experts)
                if keys is None:  # experts of unknown count: as many as arrived, no gaps
                    n = 1 + max(e for e, _ in g.parts)
                    per = 1 if group_name.endswith(".w2_weight") else 2
                    keys = [(e, i) for e in range(n) for i in range(per)]
                self._close(group_name, g, keys)
            if group_name not in skip:
                out[group_name] = str(g.digest)
        return out


def sglang_checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """`{sglang_name: checksum}` of HF-named tensors, as SGLang's `/weights_checker` reports
    them for an engine holding exactly these tensors (one TP rank)."""
    acc = SGLangChecksums()
    for name, t in named:
        acc.add(name, t)
    return acc.result()


def reported_in_sglang_naming(held: Iterable[str]) -> bool:
    """Whether an engine's checksum names are SGLang's fused ones (not HF checkpoint names)."""
    return any(
        n.endswith((".qkv_proj.weight", ".gate_up_proj.weight", ".w13_weight", ".w2_weight"))
        for n in held
    )


__all__ = [
    "SGLangChecksums",
    "reported_in_sglang_naming",
    "sglang_checksums",
    "sglang_slot",
]
