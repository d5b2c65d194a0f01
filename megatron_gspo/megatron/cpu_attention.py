"""Core attention for CPU runs: packed (THD) sequences and context parallelism without TE.

megatron-core's local `DotProductAttention` refuses packed sequences and context parallelism;
both are Transformer Engine features. This module is the CPU stand-in, swapped in through the
layer spec (`core_attention` submodule), so the rest of megatron-core (RoPE on THD, CP slicing,
grad reductions over the dp x cp group) runs unchanged. It is written for clarity, not speed:
K/V are all-gathered over the CP group and a dense mask is built from global positions.

Shape legend: `t` local tokens (sequence dim of this CP shard), `b` batch, `np`/`ng` attention
heads / query groups on this TP rank, `hn` head dim, `cp` context-parallel size.

Layouts (the ones megatron-core uses, so RoPE and the data split agree):
- unpacked [s, b, ...]: the sequence is cut into 2*cp chunks, rank r holds chunks r and 2cp-1-r.
- packed THD [t, np, hn] with `cu_seqlens(_padded)` over the full padded sequences: each
  sequence is cut into 2*cp chunks the same way; the shard concatenates its chunks sequence by
  sequence.
"""

from __future__ import annotations

import math

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor


def zigzag_indices(length: int, cp_size: int, cp_rank: int) -> Tensor:
    """Positions (0..length-1) of one sequence held by `cp_rank`: chunks r and 2cp-1-r."""
    if cp_size == 1:
        return torch.arange(length)
    if length % (2 * cp_size):
        raise ValueError(f"sequence length {length} is not divisible by 2*cp={2 * cp_size}")
    c = length // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)
    return torch.cat([first, second])


def shard_token_layout(seq_lengths: list[int], cp_size: int, cp_rank: int) -> tuple[Tensor, Tensor]:
    """(sequence id, position) of every token of a packed shard, in shard order. [t], [t]."""
    seq_ids, positions = [], []
    for i, length in enumerate(seq_lengths):
        pos = zigzag_indices(length, cp_size, cp_rank)
        positions.append(pos)
        seq_ids.append(torch.full_like(pos, i))
    return torch.cat(seq_ids), torch.cat(positions)


class CPUCoreAttention(MegatronModule):
    """Causal softmax attention over packed or unpacked tokens, with K/V gathered over CP."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise NotImplementedError(
                f"CPUCoreAttention supports causal masks, got {attn_mask_type}"
            )
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.tp_size = pg_collection.tp.size()
        self.cp_group = pg_collection.cp
        self.heads = config.num_attention_heads // self.tp_size
        self.groups = config.num_query_groups // self.tp_size
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(head_dim)
        p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.dropout = torch.nn.Dropout(p)

    def _layout(self, s: int, packed: PackedSeqParams | None) -> tuple[list[int], bool]:
        if packed is None or packed.qkv_format != "thd":
            return [s * self.cp_group.size()], False
        cu = packed.cu_seqlens_q_padded
        if cu is None:
            cu = packed.cu_seqlens_q
        return (cu[1:] - cu[:-1]).tolist(), True

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported on the CPU path")
        lengths, thd = self._layout(query.size(0), packed_seq_params)
        if thd:  # [t, np, hn] -> [t, 1, np, hn]
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        q_seq, q_pos = shard_token_layout(lengths, cp, rank)
        if cp > 1:
            # all-gather forward, reduce-scatter backward: every shard's K/V grads come home.
            key = gather_from_sequence_parallel_region(key, group=self.cp_group)
            value = gather_from_sequence_parallel_region(value, group=self.cp_group)
            layouts = [shard_token_layout(lengths, cp, r) for r in range(cp)]
            k_seq = torch.cat([sid for sid, _ in layouts])
            k_pos = torch.cat([pos for _, pos in layouts])
        else:
            k_seq, k_pos = q_seq, q_pos
        rep = self.heads // self.groups
        key = key.repeat_interleave(rep, dim=2)
        value = value.repeat_interleave(rep, dim=2)
        # [t, b, np, hn] x [tk, b, np, hn] -> [b, np, t, tk]
        scores = torch.einsum("qbnh,kbnh->bnqk", query.float(), key.float()) * self.softmax_scale
        allowed = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
        # The layout is host bookkeeping; the mask goes where the scores are.
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        probs = self.dropout(torch.softmax(scores, dim=-1).to(value.dtype))
        context = torch.einsum("bnqk,kbnh->qbnh", probs, value)
        t, b = context.shape[:2]
        if thd:
            return context.reshape(t, -1)
        return context.reshape(t, b, -1)
