"""What each TP rank of a SGLang engine holds of a HF tensor, and its `/weights_checker` sums.

SGLang's `/weights_checker` `{"action": "checksum"}` answers one entry per TP rank, each over
the parameters that rank holds (sglang 0.5.23 `srt/utils/weight_checker.py`). Each rank's weight
loaders narrow the HF tensors (`srt/layers/linear.py`, `srt/layers/vocab_parallel_embedding.py`,
`moe/fused_moe_triton/layer.py`); with `T` = engine TP size, `E` = its `--ep-size`,
`moe_tp = T / E`, rank `r`:

    q_proj            rows [r*Hq/T*d, (r+1)*Hq/T*d)                       (QKVParallelLinear)
    k_proj, v_proj    rows of kv heads r*Hkv/T.. when Hkv >= T; else the one head r // (T/Hkv)
    o_proj            columns split in T                                  (RowParallelLinear)
    gate/up_proj      rows split in T (dense MLP)        down_proj: columns split in T
    experts.e.*       only experts [ep*n/E, (ep+1)*n/E) with ep = r // moe_tp, renumbered from 0;
                      gate/up rows, down columns split in moe_tp (moe_tp rank = r % moe_tp)
    embed_tokens,     vocab padded with zero rows to a multiple of 64, rows split in T
    lm_head
    everything else   whole (norms, q/k norms, the MoE router `mlp.gate`)

The narrowed HF-named shards then fuse exactly as with one rank (`engines/weight_names.py`).

Block-FP8 weights: SGLang's checksum of a quantised parameter is the hash of its bf16
dequantisation `(q.float() * repeat(weight_scale_inv)).to(bf16)` (`Fp8BlockComparable`), so a
wrong FP8 byte or a wrong scale changes it. The sender dequantises what it sent with that same
SGLang function on the engines' device (`wire.fp8_checksummed_weight`) and shards that; SGLang
requires every shard to be block aligned (128 rows / columns), so sharding before or after
dequantising is the same tensor (`topology` refuses layouts where it is not).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatron_gspo.engines import fp8_blocks as fp8_lib
from megatron_gspo.engines.weight_group import host_views
from megatron_gspo.engines.weight_names import SGLangChecksums
from megatron_gspo.engines.wire import fp8_checksummed_weight

if TYPE_CHECKING:
    from megatron_gspo.engines.weight_layout import Sendable

VOCAB_PADDING = 64
"""SGLang's DEFAULT_VOCAB_PADDING_SIZE (srt/layers/vocab_parallel_embedding.py)."""

_Q = re.compile(r"\.self_attn\.q_proj\.(weight|bias)$")
_KV = re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$")
_O = re.compile(r"\.self_attn\.o_proj\.weight$")
_EXPERT = re.compile(r"^(?P<p>.*\.experts)\.(?P<e>\d+)\.(?P<m>gate|up|down)_proj\.(?P<leaf>\w+)$")
_DENSE_COL = re.compile(r"\.mlp\.(gate|up)_proj\.(weight|bias)$")
_DENSE_ROW = re.compile(r"\.mlp\.down_proj\.weight$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


@dataclass(frozen=True)
class EngineLayout:
    """One engine's parallel layout and the model shape its loaders shard by."""

    tp_size: int
    """SGLang --tp-size."""
    ep_size: int
    """SGLang --ep-size (experts split over ep_size groups of tp_size/ep_size ranks)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int = 0

    @classmethod
    def of(cls, hf_config: Any, tp_size: int, ep_size: int = 1) -> EngineLayout:
        """From a HF config (attributes or a dict)."""

        def get(k: str, default: Any = None) -> Any:
            if isinstance(hf_config, dict):
                return hf_config.get(k, default)
            return getattr(hf_config, k, default)

        heads = int(get("num_attention_heads"))
        d = get("head_dim") or int(get("hidden_size")) // heads
        experts = get("num_experts") or get("num_local_experts") or get("n_routed_experts") or 0
        return cls(
            tp_size=tp_size,
            ep_size=ep_size,
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(d),
            num_experts=int(experts),
        )

    @property
    def moe_tp(self) -> int:
        return self.tp_size // self.ep_size


def _split(t: torch.Tensor, dim: int, parts: int, i: int) -> torch.Tensor:
    if t.shape[dim] % parts:
        raise ValueError(f"dim {dim} of shape {tuple(t.shape)} does not split in {parts}")
    n = t.shape[dim] // parts
    return t.narrow(dim, i * n, n)


def engine_shard(
    name: str, t: torch.Tensor, rank: int, lay: EngineLayout
) -> tuple[str, torch.Tensor] | None:
    """`(name, part)` that TP rank `rank` holds of HF tensor `name` (None: nothing of it).

    Expert names come back renumbered to the rank's local expert index (SGLang stacks only its
    own experts into w13_weight / w2_weight).
    """
    tp = lay.tp_size
    if m := _EXPERT.match(name):
        ep_rank, moe_rank = divmod(rank, lay.moe_tp)
        local = name
        if lay.ep_size > 1:
            e, n_local = int(m["e"]), lay.num_experts // lay.ep_size
            if not ep_rank * n_local <= e < (ep_rank + 1) * n_local:
                return None
            local = f"{m['p']}.{e - ep_rank * n_local}.{m['m']}_proj.{m['leaf']}"
        dim = 1 if m["m"] == "down" else 0
        return local, _split(t, dim, lay.moe_tp, moe_rank)
    if tp == 1:
        return name, _pad_vocab(t) if _VOCAB.search(name) else t
    if _Q.search(name) or _DENSE_COL.search(name):
        return name, _split(t, 0, tp, rank)
    if _KV.search(name):
        kv, d = lay.num_kv_heads, lay.head_dim
        if kv >= tp:
            return name, _split(t, 0, tp, rank)
        head = rank // (tp // kv)
        return name, t.narrow(0, head * d, d)
    if _O.search(name) or _DENSE_ROW.search(name):
        return name, _split(t, 1, tp, rank)
    if _VOCAB.search(name):
        return name, _split(_pad_vocab(t), 0, tp, rank)
    return name, t


def _pad_vocab(t: torch.Tensor) -> torch.Tensor:
    rows = -(-t.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
    if rows == t.shape[0]:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


class EngineChecksums:
    """Feed tensors as sent (`add`); read what each TP rank of each engine layout reports.

    `hf`: per-tensor checksums under HF names of the raw bytes sent (engines that report HF
    names: the embedded engine). `ranks(tp_size)`: one `{sglang_name: checksum}` per TP rank,
    FP8 weights as their bf16 dequantisation (scales consumed), as SGLang reports them.
    """

    def __init__(
        self,
        layouts: list[EngineLayout],
        *,
        namings: frozenset[str] = frozenset({"hf", "sglang"}),
        device: str = "cpu",
    ) -> None:
        """namings: what the engines report, "hf" (HF names of the bytes sent) and / or "sglang"
        (fused, per rank); only those are hashed (`WeightSync` learns it at the first verified
        push), so the sender hashes each byte about once instead of up to four times.
        device: where the engines that report SGLang's names hold their weights ("cpu",
        "cuda"), which decides SGLang's hash function; their checksums are computed with it, on
        that device. HF-named checksums (`hf`) are always the CPU branch: only the embedded
        engine reports them, and it holds its weights on the CPU."""
        if not namings <= {"hf", "sglang"} or not namings:
            raise ValueError(f"namings {sorted(namings)}: a non-empty subset of hf, sglang")
        self.namings, self.device = namings, device
        # HF names are what the embedded engine reports, and it holds its weights on the CPU.
        self.plain = SGLangChecksums(fused=False, device="cpu")
        self.layouts = {lay.tp_size: lay for lay in layouts}
        ranks = self.layouts if "sglang" in namings else {}
        self._ranks = {
            tp: [
                SGLangChecksums(
                    hf=False,
                    device=device,
                    num_experts=self.layouts[tp].num_experts // self.layouts[tp].ep_size,
                )
                for _ in range(tp)
            ]
            for tp in ranks
        }
        self._fp8: dict[str, torch.Tensor] = {}

    @property
    def hf(self) -> dict[str, str]:
        return self.plain.hf

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Account one tensor as sent: an HF-named one, or one of SGLang's whole fused tensors
        (`engines.weight_layout`), accounted as its HF-named members (views)."""
        from megatron_gspo.engines.weight_fused import is_fused_name, unfuse

        if hasattr(tensor, "members"):  # weight_layout.FusedParts: its members as sent
            for member, part in tensor.members():
                self.add(member, part)
            return
        if is_fused_name(name):
            model = next(iter(self.layouts.values()))  # every layout has the model's heads
            for member, part in unfuse(name, tensor, model):
                self.add(member, part)
            return
        if "hf" in self.namings:
            self.plain.add(name, tensor)
        if not self._ranks:
            return
        # of the bytes sent, when hashed above by the same function (both on CPU)
        digest = self.plain.hf.get(name) if self.device == "cpu" else None
        if tensor.dtype == torch.float8_e4m3fn:
            self._fp8[name] = tensor.detach().cpu().clone()  # until its scale arrives
            return
        if name.endswith(fp8_lib.SCALE_SUFFIX):
            weight = name[: -len(fp8_lib.SCALE_SUFFIX)]
            q = self._fp8.pop(weight, None)
            if q is None:
                raise ValueError(f"{name} sent before (or without) its FP8 weight {weight}")
            name, tensor = weight, fp8_checksummed_weight(
                q, tensor.float(), self.device, fp8_lib.BLOCK
            )
            digest = None  # SGLang hashes the dequantised weight, not the bytes sent
        for tp, accs in self._ranks.items():
            for r, acc in enumerate(accs):
                shard = engine_shard(name, tensor, r, self.layouts[tp])
                if shard is not None:
                    # The whole tensor under its own name: its HF checksum is already known.
                    same = shard[0] == name and shard[1] is tensor
                    acc.add(shard[0], shard[1], hf_digest=digest if same else None)

    def add_bucket(self, named: Sequence[tuple[str, Sendable]]) -> None:
        """`add` every tensor of a bucket, in order: from one host copy of it (`host_views`)
        unless only engines on CUDA are checked (then where it is, hashed on the GPU)."""
        on_gpu = self.device == "cuda" and "hf" not in self.namings
        from megatron_gspo.engines.weight_fused import tensors_only

        # SGLang's layout sent as members (weight_layout.FusedParts): hashed as its members.
        flat = tensors_only(
            [m for n, t in named for m in (t.members() if hasattr(t, "members") else [(n, t)])]
        )
        for name, tensor in flat if on_gpu else host_views(flat):
            self.add(name, tensor)

    @property
    def per_rank(self) -> bool:
        """Whether the engines report SGLang's fused per-rank checksums (not only HF-named
        ones): then `ranks` holds what each engine rank should report."""
        return "sglang" in self.namings

    def ranks(self, tp_size: int) -> list[dict[str, str]]:
        """Per TP rank, `{sglang_name: checksum}` as a TP `tp_size` engine reports it."""
        if self._fp8:
            raise ValueError(f"FP8 weights sent without their scales: {sorted(self._fp8)[:3]}")
        if tp_size not in self._ranks:
            raise KeyError(
                f"no checksums computed for engines of TP size {tp_size} "
                f"(computed for {sorted(self._ranks)})"
            )
        return [acc.result() for acc in self._ranks[tp_size]]


__all__ = ["EngineChecksums", "EngineLayout", "engine_shard"]
