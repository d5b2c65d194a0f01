"""Block-FP8 inference emulated on CPU: what SGLang computes with `--quantization fp8` and a
`weight_block_size: [128, 128]` checkpoint, so that FP8 engine/trainer mismatch is real here.

Weights. Every decoder linear weight our FP8 sync quantises (`fp8_blocks.is_quantised_name`:
attention q/k/v/o, dense and expert gate/up/down; not embeddings, norms, the MoE router, lm_head)
is held as `q [N, K]` float8_e4m3fn plus `weight_scale_inv [ceil(N/128), ceil(K/128)]` fp32,
the exact tensors `fp8_blocks.quantise_blockwise` makes and the sync sends. A pushed e4m3 tensor
or scale is stored as is (bitwise); a pushed BF16/FP32 weight is quantised by
`fp8_blocks.quantise_blockwise`.

Activations (SGLang's `per_token_group_quant_fp8`, group G = 128 along the input dim, per
token): `s = max(amax|x_g|, 1e-10) / 448`, `q = e4m3(clamp(x * (1 / s), -448, 448))` (fp32
reciprocal, then multiply, then round to nearest even, as its kernel does).

GEMM (SGLang's `w8a8_block_fp8_matmul`): for each K block j in increasing order,
`acc += (q_x[:, j] . q_w[:, j]) * s_x[:, j] * s_w[n // 128, j]`, everything fp32. Accumulation
order assumed: the 128-long dot product inside a block is one fp32 GEMM of raw e4m3 values (each
product is exact in fp32; the order of its sum is the CPU BLAS's), then scaled (activation
scale first, then weight scale) and added to the fp32 accumulator block after block. Hardware
differs in two known ways this does not model: Hopper's FP8 tensor cores keep fewer than fp32's
mantissa bits inside a block, and SGLang writes the output in bf16 (here it stays fp32, like the
rest of the embedded model, so the mismatch measured is FP8's alone).

The functions below are the reference implementation. The swapped-in modules compute through
`fp8_fast.py`, which gives the same tensors bit for bit with far fewer ops
(`tests/engines/test_fp8_fast.py`); `Fp8Weights.cache.reference = True` switches a model back
to the reference path.

Shape legend: M tokens, N output features, K input features, E experts, I expert intermediate
size, H hidden size, B = G = 128.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from megatron_gspo.engines import fp8_blocks as fp8_lib
from megatron_gspo.engines.embedded import fp8_fast

GROUP = fp8_lib.BLOCK
"""Activation group size along K (= the weight block edge, as SGLang requires)."""
ACT_EPS = 1e-10
"""SGLang's floor on a group's amax (an all-zero group gets a tiny positive scale)."""


def quantise_activation(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group e4m3 quantisation of `x [M, K]`.

    Returns `(q [M, K] float8_e4m3fn, scale [M, ceil(K/G)] fp32)` with `x ~= q * scale` per
    group; formula in the module docstring (SGLang's `per_token_group_quant_fp8`).
    """
    m, k = x.shape
    kb = math.ceil(k / group)
    if k == kb * group:
        xg = x.float().reshape(m, kb, group)
    else:  # zero padding leaves a group's amax unchanged
        xg = x.new_zeros((m, kb * group), dtype=torch.float32)
        xg[:, :k] = x
        xg = xg.view(m, kb, group)
    scale = xg.abs().amax(dim=-1).clamp(min=ACT_EPS) / fp8_lib.E4M3_MAX  # [M, Kb]
    inv = 1.0 / scale
    q = (xg * inv[:, :, None]).clamp(-fp8_lib.E4M3_MAX, fp8_lib.E4M3_MAX)
    q = q.to(torch.float8_e4m3fn).view(m, kb * group)[:, :k].contiguous()
    return q, scale


def prepare_weight(
    q_w: torch.Tensor, s_w: torch.Tensor, block: int = GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM operands of a block-FP8 weight: its e4m3 values as fp32 `[N, K]` (exact) and each
    row's block scales `[N, Kb]` (what `block_fp8_matmul` reads; cached between weight loads)."""
    if tuple(s_w.shape) != fp8_lib.scale_shape(q_w.shape, block):
        raise ValueError(
            f"block FP8 GEMM: scale {tuple(s_w.shape)} does not fit weight {tuple(q_w.shape)} "
            f"with block {block}"
        )
    return q_w.float(), s_w.repeat_interleave(block, dim=0)[: q_w.shape[0]]


def block_fp8_matmul(
    q_x: torch.Tensor,
    s_x: torch.Tensor,
    w: torch.Tensor,
    s_w_rows: torch.Tensor,
    block: int = GROUP,
) -> torch.Tensor:
    """`y [M, N] fp32 = sum_j (q_x[:, Kj] @ w[:, Kj].T) * s_x[:, j] * s_w_rows[:, j]`.

    q_x [M, K] e4m3, s_x [M, Kb] fp32, `(w [N, K], s_w_rows [N, Kb]) = prepare_weight(q_w, s_w)`;
    K blocks are added in increasing j (accumulation order: module docstring).
    """
    n, k = w.shape
    kb = math.ceil(k / block)
    if s_x.shape[-1] != kb or s_w_rows.shape[-1] != kb:
        raise ValueError(
            f"block FP8 GEMM: scales {tuple(s_x.shape)} / {tuple(s_w_rows.shape)} do not fit "
            f"K={k} with block {block}"
        )
    a = q_x.float()
    acc = torch.zeros(q_x.shape[0], n, dtype=torch.float32)
    for j in range(kb):
        cols = slice(j * block, min(k, (j + 1) * block))
        acc += (a[:, cols] @ w[:, cols].T) * s_x[:, j : j + 1] * s_w_rows[None, :, j]
    return acc


def fp8_linear(
    x: torch.Tensor,
    q_w: torch.Tensor,
    s_w: torch.Tensor,
    prepared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`x [..., K]` through the block-FP8 weight `(q_w [N, K], s_w)`: `[..., N]` in x's dtype.
    prepared: `prepare_weight(q_w, s_w)` if the caller caches it."""
    flat = x.reshape(-1, x.shape[-1])
    q_x, s_x = quantise_activation(flat)
    w, s_rows = prepared if prepared is not None else prepare_weight(q_w, s_w)
    return block_fp8_matmul(q_x, s_x, w, s_rows).to(x.dtype).view(*x.shape[:-1], q_w.shape[0])


class _PreparedCache:
    """GEMM operands per weight (`prepare_weight` for the reference path, `fp8_fast.Gemm` for
    the fast one) and the last quantised activation (`fp8_fast.ActivationCache`); emptied by
    every weight load (`Fp8Weights.load`). Loads and forward passes never overlap
    (`HFPolicy.lock`)."""

    def __init__(self) -> None:
        self.entries: dict[object, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gemms: dict[object, fp8_fast.Gemm] = {}
        self.expert_gemms: dict[
            object, list[tuple[fp8_fast.Gemm, fp8_fast.Gemm, fp8_fast.Gemm]]
        ] = {}
        self.acts = fp8_fast.ActivationCache()
        self.reference = False
        """Compute with the reference functions (`fp8_linear`, `reference_forward`): slow, the
        same numbers bit for bit (tests compare the two)."""

    def get(
        self, key: object, q_w: torch.Tensor, s_w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self.entries.get(key)
        if hit is None:
            hit = self.entries[key] = prepare_weight(q_w, s_w)
        return hit

    def gemm(self, key: object, q_w: torch.Tensor, s_w: torch.Tensor) -> fp8_fast.Gemm:
        hit = self.gemms.get(key)
        if hit is None:
            hit = self.gemms[key] = fp8_fast.prepare(q_w, s_w)
        return hit

    def clear(self) -> None:
        self.entries.clear()
        self.gemms.clear()
        self.expert_gemms.clear()
        self.acts.clear()


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class BlockFp8Linear(nn.Module):
    """An `nn.Linear` served in block FP8: parameters `weight` (e4m3 [N, K]) and
    `weight_scale_inv` (fp32 [Nb, Kb]), the names of an FP8 checkpoint."""

    def __init__(self, linear: nn.Linear, cache: _PreparedCache | None = None) -> None:
        super().__init__()
        self._cache = cache or _PreparedCache()
        q, s = fp8_lib.quantise_blockwise(linear.weight.detach())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _frozen(q)
        self.weight_scale_inv = _frozen(s)
        self.bias = None if linear.bias is None else _frozen(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._cache.reference:
            prepared = self._cache.get(self, self.weight, self.weight_scale_inv)
            y = fp8_linear(x, self.weight, self.weight_scale_inv, prepared)
        else:
            gemm = self._cache.gemm(self, self.weight, self.weight_scale_inv)
            y = fp8_fast.linear(x, gemm, self._cache.acts)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class BlockFp8Experts(nn.Module):
    """transformers' fused MoE experts (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) served
    in block FP8, each expert's gate, up and down weight quantised on its own (as the sync sends
    `experts.<e>.<gate|up|down>_proj.weight`). Same call as the module it replaces:
    `(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`."""

    def __init__(self, experts: nn.Module, cache: _PreparedCache | None = None) -> None:
        super().__init__()
        self._cache = cache or _PreparedCache()
        gate_up, down = experts.gate_up_proj, experts.down_proj
        assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
        gate_up, down = gate_up.detach(), down.detach()
        self.num_experts = gate_up.shape[0]
        half = gate_up.shape[1] // 2
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = experts.act_fn  # type: ignore[assignment]
        for proj, w in (("gate", gate_up[:, :half]), ("up", gate_up[:, half:]), ("down", down)):
            qs = [fp8_lib.quantise_blockwise(w[e]) for e in range(self.num_experts)]
            setattr(self, f"{proj}_proj", _frozen(torch.stack([q for q, _ in qs])))
            setattr(self, f"{proj}_proj_scale_inv", _frozen(torch.stack([s for _, s in qs])))

    def held(self, prefix: str) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """`(HF checkpoint name, q view, scale view)` of every expert weight."""
        for e in range(self.num_experts):
            for proj in ("gate", "up", "down"):
                q, s = getattr(self, f"{proj}_proj"), getattr(self, f"{proj}_proj_scale_inv")
                yield f"{prefix}.{e}.{proj}_proj.weight", q[e], s[e]

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self._cache.reference:
            return self.reference_forward(hidden, top_k_index, top_k_weights)
        gemms = self._cache.expert_gemms.get(self)
        if gemms is None:  # (gate, up, down) per expert, once per weight version
            gemms = self._cache.expert_gemms[self] = [
                (self._gemm("gate", e), self._gemm("up", e), self._gemm("down", e))
                for e in range(self.num_experts)
            ]
        return fp8_fast.experts_forward(hidden, top_k_index, top_k_weights, gemms, self.act_fn)

    def _gemm(self, proj: str, e: int) -> fp8_fast.Gemm:
        q, s = getattr(self, f"{proj}_proj")[e], getattr(self, f"{proj}_proj_scale_inv")[e]
        return fp8_fast.prepare(q, s)

    def reference_forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Expert by expert, every linear through `fp8_linear` (the fast path's reference)."""
        out = torch.zeros_like(hidden)
        for e in top_k_index.unique().tolist():
            token_idx, slot = torch.where(top_k_index == e)
            x = hidden[token_idx]
            h = self.act_fn(self._linear(x, "gate", e)) * self._linear(x, "up", e)
            y = self._linear(h, "down", e)
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, slot, None]).to(out.dtype))
        return out

    def _linear(self, x: torch.Tensor, proj: str, e: int) -> torch.Tensor:
        q, s = getattr(self, f"{proj}_proj")[e], getattr(self, f"{proj}_proj_scale_inv")[e]
        return fp8_linear(x, q, s, self._cache.get((self, proj, e), q, s))


def _is_fused_experts(module: nn.Module) -> bool:
    """transformers' fused experts layout: 3-D `gate_up_proj`, `down_proj` and an `act_fn`."""
    gate_up = getattr(module, "gate_up_proj", None)
    return isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 and hasattr(module, "act_fn")


class Fp8Weights:
    """The block-FP8 tensors of an emulated model under HF checkpoint names: loads and reports
    them (what `HFPolicy` delegates to for quantised weights and their `_scale_inv`)."""

    def __init__(self, model: nn.Module) -> None:
        self.held: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """HF weight name -> (q view, scale view) inside the model."""
        self.owned: set[str] = set()
        """Model parameter names these tensors live in (the policy skips them)."""
        self.cache = _PreparedCache()
        for mod_name, module in list(model.named_modules()):
            parent_name, _, attr = mod_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if isinstance(module, nn.Linear) and fp8_lib.is_quantised_name(f"{mod_name}.weight"):
                lin = BlockFp8Linear(module, self.cache)
                setattr(parent, attr, lin)
                self.held[f"{mod_name}.weight"] = (lin.weight, lin.weight_scale_inv)
                self.owned |= {f"{mod_name}.weight", f"{mod_name}.weight_scale_inv"}
            elif mod_name.endswith(".experts") and _is_fused_experts(module):
                if getattr(module, "gate_up_proj_bias", None) is not None:
                    raise ValueError(
                        f"{mod_name}: experts with biases are not supported by FP8 emulation; "
                        "unset rollout.launch.quantization"
                    )
                experts = BlockFp8Experts(module, self.cache)
                setattr(parent, attr, experts)
                for name, q, s in experts.held(mod_name):
                    self.held[name] = (q, s)
                self.owned |= {f"{mod_name}.{n}" for n, _ in experts.named_parameters()}
        if not self.held:
            raise ValueError(
                "FP8 emulation found no decoder linear weight to quantise in this model; "
                "unset rollout.launch.quantization"
            )

    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """Store one pushed tensor if it is a quantised weight or its scale; False otherwise.

        e4m3 weights and scales are copied bitwise; a BF16/FP32 weight is quantised with
        `fp8_blocks.quantise_blockwise` (weight and scale both replaced).
        """
        if self.target(name) is None:
            return False
        self.cache.clear()  # the GEMM operands of the old weights
        if name.endswith(fp8_lib.SCALE_SUFFIX):
            entry = self.held[name[: -len(fp8_lib.SCALE_SUFFIX)]]
            _copy(name, entry[1], tensor)
            return True
        q, s = self.held[name]
        if tensor.dtype == torch.float8_e4m3fn:
            _copy(name, q, tensor)
        else:
            if tuple(tensor.shape) != tuple(q.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(q.shape)}")
            new_q, new_s = fp8_lib.quantise_blockwise(tensor)
            q.copy_(new_q)
            s.copy_(new_s)
        return True

    def checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, q)` and `(name_scale_inv, scale)` of every quantised weight, as held."""
        for name, (q, s) in self.held.items():
            yield name, q
            yield fp8_lib.scale_name(name), s

    def target(self, name: str) -> torch.Tensor | None:
        """The held tensor behind an HF name (a quantised weight or its scale), else None."""
        if name.endswith(fp8_lib.SCALE_SUFFIX):
            entry = self.held.get(name[: -len(fp8_lib.SCALE_SUFFIX)])
            return None if entry is None else entry[1]
        entry = self.held.get(name)
        return None if entry is None else entry[0]


def _copy(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{name}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
    if src.dtype != dst.dtype:
        raise ValueError(f"{name}: dtype {src.dtype} != held {dst.dtype} (block FP8 layout)")
    dst.copy_(src)


def is_block_fp8(model_path: str) -> bool:
    """Whether a HF checkpoint is block FP8 (its config.json has `quantization_config` with
    `quant_method: fp8` and a `weight_block_size`, as `tools/fp8_checkpoint.py` writes)."""
    import json
    from pathlib import Path

    qcfg = json.loads((Path(model_path) / "config.json").read_text()).get("quantization_config")
    return bool(qcfg) and qcfg.get("quant_method") == "fp8" and bool(qcfg.get("weight_block_size"))


def unquantised_model(model_path: str, dtype: torch.dtype) -> nn.Module:
    """The model of a block-FP8 checkpoint built without transformers' FP8 integration (which
    needs a GPU) and without its weights: `emulate` it, then load the checkpoint's tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(model_path)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    try:
        model.generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json: the model config's defaults
        pass
    return model


QUANTIZATIONS = ("fp8",)
"""Values of the embedded engine's `--quantization` (rollout.launch.quantization)."""


def emulate(model: nn.Module, quantization: str) -> Fp8Weights:
    """Swap the model's quantisable linears and experts for block-FP8 ones (in place)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"rollout.launch.quantization={quantization!r}: the embedded engine emulates "
            f"{' / '.join(QUANTIZATIONS)} only; use one of them or backend=sglang"
        )
    return Fp8Weights(model)
