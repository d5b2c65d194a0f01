"""Checksums of HF-named tensors under SGLang's own parameter names (fused q/k/v, gate/up,
stacked experts), so a weight sync is verified against a real SGLang server by default.

SGLang's `/weights_checker` `{"action": "checksum"}` hashes every parameter it holds: the first
8 bytes of sha256 over the contiguous raw bytes (`sglang/srt/utils/weight_checker.py`,
`_hash_tensor` -> `mm_utils.tensor_hash`), under its module names. With one TP rank the fused
parameters are plain concatenations along dim 0 of what the trainer sends (checked against
sglang 0.5.23 serving Qwen3-MoE on CPU):

    <attn>.qkv_proj.{weight,bias}   = cat(q_proj, k_proj, v_proj)
    <mlp>.gate_up_proj.{weight,bias}= cat(gate_proj, up_proj)                 (dense MLPs)
    <mlp>.experts.w13_weight        = stack_e(cat(experts.e.gate_proj, experts.e.up_proj))
    <mlp>.experts.w2_weight         = stack_e(experts.e.down_proj)

Concatenating or stacking contiguous tensors along dim 0 concatenates their bytes, so the
fused checksum is one sha256 fed member by member in that order: nothing is concatenated and
only members that arrive ahead of their turn are held.

FP8-quantised weights (a `<w>_scale_inv` was sent) are left out: SGLang hashes their
dequantised bf16, not the bytes sent. Not covered (a mismatch then names the tensor, it never
passes silently): TP-sharded engines (shards), MLA's fused projections.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

_ATTN = re.compile(r"^(?P<p>.*\.self_attn)\.(?P<m>q|k|v)_proj\.(?P<leaf>weight|bias)$")
_EXPERT = re.compile(r"^(?P<p>.*\.experts)\.(?P<e>\d+)\.(?P<m>gate|up|down)_proj\.weight$")
_DENSE = re.compile(r"^(?P<p>.*\.mlp)\.(?P<m>gate|up)_proj\.(?P<leaf>weight|bias)$")


def sglang_slot(name: str) -> tuple[str, tuple[int, int]] | None:
    """`(sglang_name, order_key)` of a tensor SGLang fuses, None if it keeps the HF name.

    Members of one fused parameter are hashed in increasing `order_key`.
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


def _raw_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _digest_hex(h: hashlib._Hash) -> str:
    # Same formatting as SGLang's `f"{tensor_hash(t):016x}"` (big-endian first 8 bytes).
    return f"{int.from_bytes(h.digest()[:8], byteorder='big', signed=False):016x}"


def _expected_next(key: tuple[int, int], group: str) -> tuple[int, int]:
    e, i = key
    if group.endswith(".qkv_proj.weight") or group.endswith(".qkv_proj.bias"):
        return (0, i + 1)
    if group.endswith(".w13_weight"):
        return (e, 1) if i == 0 else (e + 1, 0)
    if group.endswith(".w2_weight"):
        return (e + 1, 0)
    return (0, i + 1)  # gate_up_proj


@dataclass
class _Group:
    hasher: hashlib._Hash = field(default_factory=hashlib.sha256)
    next_key: tuple[int, int] = (0, 0)
    pending: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    members: int = 0


class SGLangChecksums:
    """Feed tensors as sent (`add`), read per-parameter checksums in SGLang's naming (`result`).

    Also keeps the plain HF-named checksums (`hf`), for engines that report HF names.
    """

    def __init__(self, *, hf: bool = True, fused: bool = True) -> None:
        """hf: hash fused members under their HF names too (`hf`); fused: build SGLang's
        fused checksums (`result`). Each costs one sha256 pass over the fused members' bytes;
        unfused tensors are hashed once either way."""
        self.hf: dict[str, str] = {}
        self.track_hf, self.track_fused = hf, fused
        self._plain: dict[str, str] = {}
        self._groups: dict[str, _Group] = {}

    def add(self, name: str, tensor: torch.Tensor, hf_digest: str | None = None) -> None:
        """Account one tensor under its HF name (any order across and within groups).
        hf_digest: its HF checksum when already known (not hashed again)."""
        slot = sglang_slot(name)
        data = None
        if slot is None or self.track_hf:
            if hf_digest is None:
                data = _raw_bytes(tensor)
                hf_digest = _digest_hex(hashlib.sha256(data))
            self.hf[name] = hf_digest
        if slot is None:
            self._plain[name] = hf_digest
            return
        if not self.track_fused:
            return
        group_name, key = slot
        g = self._groups.setdefault(group_name, _Group())
        if key != g.next_key:
            # Ahead of its turn: hold a copy until the members before it arrive.
            g.pending[key] = tensor.detach().cpu().clone()
            return
        self._feed(group_name, g, data if data is not None else _raw_bytes(tensor))
        while g.next_key in g.pending:
            self._feed(group_name, g, _raw_bytes(g.pending.pop(g.next_key)))

    def _feed(self, group_name: str, g: _Group, data: memoryview) -> None:
        g.hasher.update(data)
        g.members += 1
        g.next_key = _expected_next(g.next_key, group_name)

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
            if g.pending:
                raise ValueError(
                    f"{group_name}: members {sorted(g.pending)} arrived but the one at "
                    f"{g.next_key} did not"
                )
            if group_name not in skip:
                out[group_name] = _digest_hex(g.hasher.copy())
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
