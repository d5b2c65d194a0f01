"""Random test sequences, packed into PolicyLossInputs or handed to the reference one by one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_gspo.algo import PolicyLossConfig, PolicyLossInputs, policy_loss

from .reference import RefResult, RefSeq, reference_loss

NAN = float("nan")


@dataclass
class SeqData:
    """One response: [n] float64 tensors; masked positions hold NaN garbage on purpose."""

    logp: Tensor
    old: Tensor
    mask: Tensor  # bool
    adv: float | Tensor  # scalar, or [n] per token
    rollout: Tensor | None = None
    entropy: Tensor | None = None


def make_seqs(
    gen: torch.Generator,
    lengths: list[int],
    scales: list[float],
    *,
    per_token_adv: bool = False,
    rollout_noise: float | None = None,
    mask_prob: float = 0.25,
    garbage: float = NAN,
) -> list[SeqData]:
    """Sequences whose current/old log-ratios have per-sequence spread `scales[i]`.

    Small scales keep a sequence inside GSPO's clip band, large ones push it out on either side
    (the sign of the noise decides); advantages are +-(0.2..1.7) so both signs occur.
    """
    seqs = []
    for n, scale in zip(lengths, scales, strict=True):
        old = -torch.rand(n, generator=gen, dtype=torch.float64) * 3 - 0.01
        # A per-sequence offset plus per-token noise: the sequence mean lands on either side.
        offset = torch.randn((), generator=gen, dtype=torch.float64) * scale
        logp = old + offset + torch.randn(n, generator=gen, dtype=torch.float64) * scale
        mask = torch.rand(n, generator=gen) >= mask_prob
        sign = 1.0 if torch.rand((), generator=gen).item() < 0.5 else -1.0
        adv: float | Tensor = sign * (0.2 + 1.5 * torch.rand((), generator=gen).item())
        if per_token_adv:
            adv = torch.randn(n, generator=gen, dtype=torch.float64)
        rollout = None
        if rollout_noise is not None:
            rollout = old + torch.randn(n, generator=gen, dtype=torch.float64) * rollout_noise
            rollout[~mask] = garbage
        entropy = torch.rand(n, generator=gen, dtype=torch.float64) * 4
        for t in (logp, old, entropy):
            t[~mask] = garbage
        seqs.append(SeqData(logp, old, mask, adv, rollout, entropy))
    return seqs


def to_reference(seqs: list[SeqData]) -> tuple[list[RefSeq], list[Tensor]]:
    """RefSeq list (fresh float64 leaves) and the leaves, for gradients."""
    out, leaves = [], []
    for s in seqs:
        leaf = s.logp.clone().requires_grad_(True)
        leaves.append(leaf)
        adv = s.adv.tolist() if isinstance(s.adv, Tensor) else s.adv
        rollout = s.rollout.tolist() if s.rollout is not None else None
        out.append(RefSeq(leaf, s.old.tolist(), s.mask.tolist(), adv, rollout))
    return out, leaves


@dataclass
class Packed:
    inputs: PolicyLossInputs
    leaf: Tensor  # [T] the logp leaf
    origin: list[tuple[int, int]]  # packed position -> (sequence, token)


def pack(
    seqs: list[SeqData],
    *,
    gen: torch.Generator | None = None,
    token_adv: bool = False,
    dtype: torch.dtype = torch.float64,
    keep: Callable[[int, int], bool] | None = None,
) -> Packed:
    """Pack sequences into [T] tensors, tokens interleaved by a random permutation.

    `keep(i, t)` selects which tokens this pack holds (a context-parallel shard); sequence ids
    stay 0..S-1 and S stays len(seqs) even when a shard holds no token of a sequence.
    """
    origin = [(i, t) for i, s in enumerate(seqs) for t in range(len(s.mask))]
    if keep is not None:
        origin = [o for o in origin if keep(*o)]
    if gen is not None:
        origin = [origin[j] for j in torch.randperm(len(origin), generator=gen).tolist()]

    def gather(get: Callable[[SeqData, int], float]) -> Tensor:
        return torch.tensor([get(seqs[i], t) for i, t in origin], dtype=torch.float64).to(dtype)

    leaf = gather(lambda s, t: s.logp[t].item()).requires_grad_(True)
    has_rollout = seqs[0].rollout is not None
    if token_adv:
        adv = gather(lambda s, t: s.adv[t].item() if isinstance(s.adv, Tensor) else s.adv)
    else:
        adv = torch.tensor([s.adv for s in seqs], dtype=dtype)
    inputs = PolicyLossInputs(
        logp=leaf,
        old_logp=gather(lambda s, t: s.old[t].item()),
        advantages=adv,
        seq_index=torch.tensor([i for i, _ in origin], dtype=torch.long),
        mask=torch.tensor([seqs[i].mask[t].item() for i, t in origin], dtype=torch.bool),
        num_seqs=len(seqs),
        rollout_logp=gather(lambda s, t: s.rollout[t].item()) if has_rollout else None,
        entropy=gather(lambda s, t: s.entropy[t].item()),
        advantages_per_token=token_adv,
    )
    return Packed(inputs, leaf, origin)


def scatter_grad(packs: list[Packed], seqs: list[SeqData]) -> list[Tensor]:
    """Per-sequence [n] gradients assembled from the leaves of several packs."""
    grads = [torch.zeros(len(s.mask), dtype=torch.float64) for s in seqs]
    for p in packs:
        g = p.leaf.grad if p.leaf.grad is not None else torch.zeros_like(p.leaf)
        for (i, t), v in zip(p.origin, g.double().tolist(), strict=True):
            grads[i][t] += v
    return grads


def run_reference(
    seqs: list[SeqData], cfg: PolicyLossConfig, denominator: float
) -> tuple[RefResult, list[Tensor]]:
    ref_seqs, leaves = to_reference(seqs)
    res = reference_loss(
        ref_seqs,
        kind=cfg.kind,
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        clamp=cfg.log_ratio_clamp,
        tis_mode=cfg.tis_mode,
        tis_cap=cfg.tis_cap,
        denominator=denominator,
    )
    if res.loss.requires_grad:
        res.loss.backward()
    grads = [
        torch.where(s.mask, g.grad, 0.0) if g.grad is not None else torch.zeros_like(g)
        for s, g in zip(seqs, leaves, strict=True)
    ]
    return res, grads


def run_packed(
    seqs: list[SeqData],
    cfg: PolicyLossConfig,
    denominator: float,
    *,
    gen: torch.Generator | None = None,
    token_adv: bool = False,
) -> tuple[Tensor, dict[str, Tensor], list[Tensor]]:
    p = pack(seqs, gen=gen, token_adv=token_adv)
    loss, metrics = policy_loss(p.inputs, cfg, denominator=denominator)
    loss.backward()
    return loss.detach(), metrics, scatter_grad([p], seqs)
