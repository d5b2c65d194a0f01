"""The fast path of the embedded engine's block-FP8 emulation: the same numbers, fewer ops.

`fp8_emulation.py` defines the arithmetic (its module docstring) and keeps the reference
implementation (`quantise_activation`, `block_fp8_matmul`, `fp8_linear`, the per-expert loop
`BlockFp8Experts.reference_forward`). This path computes bit for bit the same tensors (tests:
`tests/engines/test_fp8_fast.py`, whole generations through the engine, `torch.equal`):

- a weight's GEMM operands (its e4m3 values as fp32, and per K block the transposed view
  `w[:, Kj].T` and the rows' scales) are built once per weight version, not per forward;
- an activation is quantised once and reused by every linear that reads the same input tensor
  (attention q/k/v; expert gate and up; all experts of a token, since quantisation is per token
  and per group, so the rows of a quantised batch are the quantised rows), and is dequantised
  straight to fp32 (`e4m3 -> fp32` is exact) instead of going through a separate e4m3 tensor;
- elementwise steps run in place (each IEEE op rounds the same whatever tensor holds it).

What is NOT changed, because it would change the numbers: every GEMM is the same BLAS call
as the reference (same operands, shapes and strides: `a[:, Kj] @ w[:, Kj].T` per K block, one
call per linear and expert), so its fp32 summation order is the reference's; the scale
products keep their order (`(dot * s_x) * s_w`) and the block accumulator starts from zero
(`0 + t`, as `acc = zeros; acc += t`); experts are added into the output in increasing expert
id, each token's rows gathered in the reference's order.

Shape legend: M tokens, N output features, K input features, Kb = ceil(K / G), G = 128.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from megatron_gspo.engines import fp8_blocks as fp8_lib

E4M3_MAX = fp8_lib.E4M3_MAX


@dataclasses.dataclass(frozen=True, slots=True)
class Gemm:
    """One block-FP8 weight's GEMM operands, built once per weight version.

    blocks: per K block j, `(cols, w[:, cols].T, s_w_rows[:, j])` with `w [N, K]` the weight's
    e4m3 values as fp32 (exact) and `s_w_rows [N, Kb]` each row's block scales.
    """

    n: int
    k: int
    blocks: tuple[tuple[slice, torch.Tensor, torch.Tensor], ...]


def prepare(q_w: torch.Tensor, s_w: torch.Tensor, block: int = fp8_lib.BLOCK) -> Gemm:
    """The `Gemm` of a block-FP8 weight `(q_w [N, K] e4m3, s_w [Nb, Kb] fp32)`."""
    if tuple(s_w.shape) != fp8_lib.scale_shape(q_w.shape, block):
        raise ValueError(
            f"block FP8 GEMM: scale {tuple(s_w.shape)} does not fit weight {tuple(q_w.shape)} "
            f"with block {block}"
        )
    n, k = q_w.shape
    w = q_w.float()
    s_rows = s_w.repeat_interleave(block, dim=0)[:n]
    blocks = []
    for j in range(math.ceil(k / block)):
        cols = slice(j * block, min(k, (j + 1) * block))
        blocks.append((cols, w[:, cols].T, s_rows[:, j].contiguous()))
    return Gemm(n=n, k=k, blocks=tuple(blocks))


def quantise(x: torch.Tensor, group: int = fp8_lib.BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group quantisation of `x [M, K]`, dequantised: `(a [M, K] fp32, s [M, Kb])`.

    `a` holds exactly the e4m3 values of `fp8_emulation.quantise_activation(x)[0]` (as fp32),
    `s` exactly its scales; same formula: `s = max(amax|x_g|, 1e-10) / 448`,
    `a = e4m3(clamp(x * (1 / s), -448, 448))`.
    """
    m, k = x.shape
    kb = math.ceil(k / group)
    width = k if kb == 1 else kb * group  # one group: the row itself (padding adds only zeros)
    if k == width:
        xg = x.float().reshape(m, kb, width // kb)
    else:  # zero padding leaves a group's amax unchanged
        xg = x.new_zeros((m, width), dtype=torch.float32)
        xg[:, :k] = x
        xg = xg.view(m, kb, group)
    scale = xg.abs().amax(dim=-1).clamp_(min=1e-10).div_(E4M3_MAX)  # [M, Kb]
    inv = scale.reciprocal()  # = 1.0 / scale (Tensor.__rdiv__ is reciprocal() * 1)
    q = torch.mul(xg, inv[:, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    a = q.to(torch.float8_e4m3fn).to(torch.float32).view(m, width)
    return (a if k == width else a[:, :k].contiguous()), scale


def gemm(a: torch.Tensor, s_x: torch.Tensor, g: Gemm) -> torch.Tensor:
    """`y [M, N] fp32 = sum_j (a[:, Kj] @ w[:, Kj].T) * s_x[:, j] * s_w[:, j]`, K blocks added
    to a zero accumulator in increasing j: `fp8_emulation.block_fp8_matmul`'s numbers."""
    if len(g.blocks) == 1:  # K <= G: acc = 0 + t, t = (dot * s_x) * s_w
        cols, w_t, s_col = g.blocks[0]
        return (a[:, cols] @ w_t).mul_(s_x[:, 0:1]).mul_(s_col).add_(0.0)
    acc = torch.zeros(a.shape[0], g.n, dtype=torch.float32)
    for j, (cols, w_t, s_col) in enumerate(g.blocks):
        acc += (a[:, cols] @ w_t).mul_(s_x[:, j : j + 1]).mul_(s_col)
    return acc


class ActivationCache:
    """The quantised form of the last input tensor a block-FP8 linear read, reused while the
    same tensor object (same storage, shape, and version when it tracks one) comes back: the
    attention's q/k/v projections all read one normed hidden state. Forward passes never
    overlap (the policy's lock), and a tensor is not modified in place between two linears
    that read it (true of transformers' decoders; a changed version or pointer refills)."""

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._x: torch.Tensor | None = None
        self._value: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def _key_of(x: torch.Tensor) -> tuple[object, ...]:
        version = None if x.is_inference() else x._version
        return (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, version)

    def get(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`quantise(x.reshape(-1, K))`, computed once per input tensor."""
        key = self._key_of(x)
        if self._x is x and self._key == key and self._value is not None:
            return self._value
        value = quantise(x.reshape(-1, x.shape[-1]))
        self._x, self._key, self._value = x, key, value
        return value

    def clear(self) -> None:
        self._x = self._key = self._value = None


def linear(x: torch.Tensor, g: Gemm, acts: ActivationCache) -> torch.Tensor:
    """`x [..., K]` through a block-FP8 weight: `[..., N]` in x's dtype (`fp8_linear`'s numbers)."""
    a, s_x = acts.get(x)
    return gemm(a, s_x, g).to(x.dtype).view(*x.shape[:-1], g.n)


def experts_forward(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gemms: list[tuple[Gemm, Gemm, Gemm]],
    act_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Fused MoE experts in block FP8: `BlockFp8Experts.reference_forward`'s numbers.

    hidden [T, H], top_k_index / top_k_weights [T, k], gemms[e] = (gate, up, down). The hidden
    states are quantised once for all experts (per-token rows), gate and up share them.
    """
    a_all, s_all = quantise(hidden)
    if hidden.shape[0] == 1:  # decode: one token, its k distinct experts in increasing id
        return _one_token(hidden, a_all, s_all, top_k_index, top_k_weights, gemms, act_fn)
    out = torch.zeros_like(hidden)
    for e in top_k_index.unique().tolist():
        token_idx, slot = torch.where(top_k_index == e)
        a, s = a_all[token_idx], s_all[token_idx]
        y = _expert(hidden, a, s, gemms[e], act_fn)
        out.index_add_(0, token_idx, (y * top_k_weights[token_idx, slot, None]).to(out.dtype))
    return out


def _expert(
    hidden: torch.Tensor,
    a: torch.Tensor,
    s: torch.Tensor,
    gemm3: tuple[Gemm, Gemm, Gemm],
    act_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """One expert on its tokens' quantised hidden states `(a, s)`: `down(act(gate) * up)`."""
    gate, up, down = gemm3
    h = act_fn(gemm(a, s, gate).to(hidden.dtype)) * gemm(a, s, up).to(hidden.dtype)
    a_h, s_h = quantise(h)
    return gemm(a_h, s_h, down).to(h.dtype)


def _one_token(
    hidden: torch.Tensor,
    a: torch.Tensor,
    s: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gemms: list[tuple[Gemm, Gemm, Gemm]],
    act_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`experts_forward` of a single token without the gather/scatter: the reference's
    `zeros.index_add_(row)` per expert is `out = 0 + v_first`, then `out + v` in increasing
    expert id (the same fp32 additions)."""
    ids = top_k_index[0].tolist()
    out = torch.zeros_like(hidden)
    for e in sorted(set(ids)):
        slot = ids.index(e)  # top-k ids are distinct
        y = _expert(hidden, a, s, gemms[e], act_fn)
        out += (y * top_k_weights[:, slot : slot + 1]).to(out.dtype)
    return out
