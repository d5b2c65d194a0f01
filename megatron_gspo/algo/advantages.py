"""Group-relative advantages (GSPO / GRPO).

Shape legend:
    S  sequences (responses) in the batch
    T  packed response-token positions
    G  distinct groups (prompts); each sequence belongs to exactly one group

    A_i = (r_i - mean_{j in g(i)} r_j) / (std_{j in g(i)} r_j + eps)

`std` is the POPULATION standard deviation (divide by the group size, not size - 1), so the
advantages of a group with non-zero variance have mean 0 and population std ~1 (exactly 1 as
eps -> 0). A group whose rewards are all equal (including a group of one) carries no signal and
gets A_i = 0 exactly, never NaN, whatever eps is.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_advantages", "token_advantages"]


def _group_index(groups: Tensor | int, num_seqs: int, device: torch.device) -> tuple[Tensor, int]:
    """Map `groups` (ids [S] or a contiguous group size) to dense indices 0..G-1 and G."""
    if isinstance(groups, int):
        if groups <= 0 or num_seqs % groups != 0:
            raise ValueError(
                f"group_size={groups} must be positive and divide the number of sequences "
                f"({num_seqs})"
            )
        return torch.arange(num_seqs, device=device) // groups, num_seqs // groups
    if groups.shape != (num_seqs,) or groups.dtype.is_floating_point:
        raise ValueError(
            f"group_ids must be an integer tensor of shape [S]=({num_seqs},), got "
            f"{tuple(groups.shape)} {groups.dtype}"
        )
    # Ids can be arbitrary (e.g. prompt hashes); densify them so index_add can bucket by group.
    uniq, dense = torch.unique(groups, return_inverse=True)
    return dense.to(device), uniq.numel()


def group_advantages(
    rewards: Tensor,
    groups: Tensor | int,
    *,
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> Tensor:
    """Group-relative advantages, one per sequence.

        A_i = (r_i - mean_g) / (std_g + eps)     if normalize_std   (std_g: population std)
        A_i =  r_i - mean_g                      otherwise

    Args:
        rewards: [S] scalar reward per sequence (any float dtype).
        groups: either a LongTensor [S] of group ids (any integers; sequences with the same id
            form a group, in any order), or an int `group_size` meaning the S sequences are
            laid out as consecutive groups of that size.
        eps: added to the std (not the variance) before dividing; must be >= 0.
        normalize_std: divide by the group std (GRPO/GSPO default); False gives the std-free
            variant r_i - mean_g.

    Returns:
        [S] advantages in the dtype of `rewards` (computed in float64). Every member of a group
        whose rewards are all equal gets exactly 0.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [S], got shape {tuple(rewards.shape)}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    num_seqs = rewards.shape[0]
    if num_seqs == 0:
        return rewards.clone()
    index, num_groups = _group_index(groups, num_seqs, rewards.device)
    r = rewards.detach().to(torch.float64)

    count = torch.zeros(num_groups, dtype=torch.float64, device=r.device)
    count.index_add_(0, index, torch.ones_like(r))

    # Decide "no signal" from the raw rewards (max == min), not from a float variance that
    # rounding can leave at 1e-17: an all-equal group must give exactly 0.
    gmax = torch.full_like(count, -torch.inf).scatter_reduce_(0, index, r, "amax")
    gmin = torch.full_like(count, torch.inf).scatter_reduce_(0, index, r, "amin")
    constant = (gmax == gmin)[index]

    # Work on z = (r - min_g) / (max_g - min_g) in [0, 1]: the same advantages in exact
    # arithmetic, but the moments of tiny spreads (1e-168: the variance underflows; 5e-324: the
    # mean is not representable) stay in normal floating point.
    # Subnormal spreads can also be flushed to zero by the CPU (FTZ/DAZ): such a group carries
    # no usable signal and is treated as constant rather than producing 0/0.
    spread = gmax - gmin
    usable = spread > 0
    constant = constant | ~usable[index]
    spread = torch.where(usable, spread, torch.ones_like(spread))
    z = (r - gmin[index]) / spread[index]
    z_mean = torch.zeros_like(count).index_add_(0, index, z) / count
    zc = z - z_mean[index]
    if normalize_std:
        z_std = (torch.zeros_like(count).index_add_(0, index, zc * zc) / count).sqrt()
        # (r - mean) / (std + eps) == zc / (z_std + eps / spread)
        denom = z_std + eps / spread
        denom = torch.where(denom > 0, denom, torch.ones_like(denom))
        centered = zc / denom[index]
    else:
        centered = zc * spread[index]
    adv = torch.where(constant, torch.zeros_like(centered), centered)
    return adv.to(rewards.dtype)


def token_advantages(seq_advantages: Tensor, seq_index: Tensor) -> Tensor:
    """Broadcast per-sequence advantages [S] to packed tokens [T]: A_{i,t} = A_i.

    `seq_index` [T] gives the sequence (0..S-1) of each packed token. The result is what
    GSPO-token with constant per-sequence advantages consumes (it then equals GSPO exactly).
    """
    return seq_advantages[seq_index]
