"""Row statistics of a (vocab-sharded) softmax shared by `logprobs` and `lm_head`.

Shape legend:
    C  token rows of one chunk
    Vb vocab columns of one block (a shard, or a chunk of a shard)

Both paths reduce each row to three sums over the full vocab, with m the row's global max,
e_v = exp(z_v - m):

    s = sum_v e_v      a = sum_v e_v (z_v - m)      lse = m + log s
    logp_t = z_t - lse          H = log s - a / s    (entropy of p = softmax(z))

and both need the same block of dL/dz in backward, given dL/dlogp (g) and dL/dH (g_H):

    dL/dz_v = g * (onehot_t(v) - p_v) - g_H * p_v (log p_v + H)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_reduce_rows", "finish_rows", "neg_softmax_grad_"]


def all_reduce_rows(x: Tensor, op: Any, group: dist.ProcessGroup | None) -> None:
    """All-reduce over the vocab shards' group (nothing when unsharded)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)


def finish_rows(
    stats: Tensor, row_max: Tensor, *, target_shifted: bool, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(lse [C], logp [C], entropy [C] or None) from the all-reduced row sums.

    Args:
        stats: [2 or 3, C] = (s, target logit, a); the target logit is z_t - m when
            `target_shifted`, else z_t; `a` only `with_entropy`.
        row_max: [C] the global row max m.
    """
    log_se = stats[0].log()
    lse = row_max + log_se
    logp = stats[1] - (log_se if target_shifted else lse)
    entropy = log_se - stats[2] / stats[0] if with_entropy else None
    return lse, logp, entropy


def neg_softmax_grad_(
    logq: Tensor,
    g_lp: Tensor,
    g_h: Tensor | None,
    entropy: Tensor | None,
    *,
    p_out: Tensor | None = None,
) -> Tensor:
    """-p (g + g_H (log p + H)) for one [C, Vb] block, built in place in `logq` (= log p);
    the caller adds the one-hot term g at the target column of the shard that owns it.

    Args:
        logq: [C, Vb] log p (overwritten).
        g_lp: [C, 1] dL/dlogp.  g_h, entropy: [C, 1] dL/dH and H, or None without entropy.
        p_out: optional [C, Vb] buffer for p (the entropy term's second block; reused by
            callers that loop over blocks). The result is then `p_out`, else `logq`.
    """
    if g_h is None:
        return logq.exp_().mul_(-g_lp)
    assert entropy is not None
    p = logq.exp() if p_out is None else torch.exp(logq, out=p_out)
    coef = logq.add_(entropy).mul_(g_h)
    return p.mul_(coef.add_(g_lp)).neg_()
