"""Independent float64 references: one sequence at a time, python loops, explicit branches.

Written from the GSPO paper (arXiv 2507.18071), not from the packed implementation: no packing, no
index_add, no torch.minimum; clipping is an explicit `if` that turns the ratio into a constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class RefSeq:
    """One response: per-token lists (all of the same length), float64 leaf for logp."""

    logp: Tensor  # [n] float64 leaf, requires grad
    old: list[float]
    mask: list[bool]
    adv: float | list[float]  # scalar, or one per token (gspo_token / grpo)
    rollout: list[float] | None = None


@dataclass
class RefResult:
    loss: Tensor
    clipped_low: int = 0
    clipped_high: int = 0
    unclipped: int = 0
    elements: int = 0  # sequences (gspo) or tokens (token kinds) that count
    tis_truncated: int = 0
    notes: list[str] = field(default_factory=list)


def _clamp(x: Tensor, c: float) -> Tensor:
    return torch.clamp(x, -c, c)


def _clip_case(ratio: float, adv: float, eps_low: float, eps_high: float) -> str:
    if adv > 0 and ratio > 1 + eps_high:
        return "high"
    if adv < 0 and ratio < 1 - eps_low:
        return "low"
    return "none"


def reference_loss(
    seqs: list[RefSeq],
    *,
    kind: str,
    eps_low: float,
    eps_high: float,
    clamp: float = 10.0,
    tis_mode: str = "none",
    tis_cap: float = 2.0,
    denominator: float,
) -> RefResult:
    """sum_i l_i / denominator, each l_i computed on its own from the paper's formulas."""
    res = RefResult(loss=torch.zeros((), dtype=torch.float64))
    total = torch.zeros((), dtype=torch.float64)
    for seq in seqs:
        toks = [t for t, m in enumerate(seq.mask) if m]
        n = len(toks)
        if n == 0:
            continue
        advs = seq.adv if isinstance(seq.adv, list) else [seq.adv] * len(seq.mask)

        seq_w = 1.0
        if tis_mode == "sequence":
            mean = sum(seq.old[t] - seq.rollout[t] for t in toks) / n
            raw = math.exp(max(-clamp, min(clamp, mean)))
            seq_w = min(raw, tis_cap)
            res.tis_truncated += raw > tis_cap

        if kind == "gspo":
            log_ratio = sum(seq.logp[t] - seq.old[t] for t in toks) / n
            s = torch.exp(_clamp(log_ratio, clamp))
            a = advs[0]
            case = _clip_case(s.item(), a, eps_low, eps_high)
            if case == "none":
                obj = s * a
                res.unclipped += 1
            else:
                bound = 1 + eps_high if case == "high" else 1 - eps_low
                obj = torch.tensor(bound * a, dtype=torch.float64)  # constant: no gradient
                res.clipped_high += case == "high"
                res.clipped_low += case == "low"
            res.elements += 1
            total = total + (-obj) * seq_w
            continue

        seq_sum = torch.zeros((), dtype=torch.float64)
        if kind == "gspo_token":
            mean = sum(seq.logp[t].item() - seq.old[t] for t in toks) / n
            s_const = math.exp(max(-clamp, min(clamp, mean)))
            grad_flows = abs(mean) <= clamp
        for t in toks:
            a = advs[t]
            if kind == "gspo_token":
                # sg[s_i] * pi/sg[pi]: value s_i, d/dlogp_t = s_i (0 where the clamp bites).
                ratio = (
                    s_const * torch.exp(seq.logp[t] - seq.logp[t].detach())
                    if grad_flows
                    else (torch.tensor(s_const, dtype=torch.float64))
                )
            elif kind == "grpo":
                ratio = torch.exp(_clamp(seq.logp[t] - seq.old[t], clamp))
            else:
                raise ValueError(kind)
            case = _clip_case(ratio.item(), a, eps_low, eps_high)
            if case == "none":
                obj = ratio * a
                res.unclipped += 1
            else:
                bound = 1 + eps_high if case == "high" else 1 - eps_low
                obj = torch.tensor(bound * a, dtype=torch.float64)
                res.clipped_high += case == "high"
                res.clipped_low += case == "low"
            res.elements += 1
            w = seq_w
            if tis_mode == "token":
                raw = math.exp(max(-clamp, min(clamp, seq.old[t] - seq.rollout[t])))
                w = min(raw, tis_cap)
                res.tis_truncated += raw > tis_cap
            seq_sum = seq_sum + (-obj) * w
        total = total + seq_sum / n
    res.loss = total / denominator
    return res


def reference_logprobs(
    logits: Tensor, target: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """float64 log softmax at the target and entropy, straight from the definitions."""
    logq = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logq.gather(1, target[:, None]).squeeze(1)
    entropy = -(logq.exp() * logq).sum(-1)
    return logp, entropy
