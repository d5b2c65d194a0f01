"""Group advantages: examples and hypothesis properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_gspo.algo import group_advantages, token_advantages


def test_known_values_population_std() -> None:
    r = torch.tensor([0.0, 1.0, 2.0, 5.0, 5.0, 5.0])
    adv = group_advantages(r, 3, eps=0.0)
    # Group 1: mean 1, population std sqrt(2/3).
    want = torch.tensor([-1.0, 0.0, 1.0]) / (2.0 / 3.0) ** 0.5
    torch.testing.assert_close(adv[:3], want)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]  # zero-variance group: exactly 0
    torch.testing.assert_close(
        group_advantages(r, 3, normalize_std=False), torch.tensor([-1.0, 0, 1, 0, 0, 0])
    )


def test_zero_variance_is_exactly_zero_never_nan() -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point: the "all equal" check must not rely on the variance.
    r = torch.tensor([0.1, 0.1, 0.1, 7.3, 1e-30, 1e-30])
    ids = torch.tensor([4, 4, 4, 9, 2, 2])  # arbitrary ids; a group of one
    for eps in (0.0, 1e-6):
        for norm in (True, False):
            adv = group_advantages(r, ids, eps=eps, normalize_std=norm)
            assert adv.tolist() == [0.0] * 6


def test_ids_equal_contiguous_layout_and_errors() -> None:
    r = torch.randn(12, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(12) // 4 * 10 + 3
    torch.testing.assert_close(group_advantages(r, ids), group_advantages(r, 4))
    assert group_advantages(r.double(), 4).dtype == torch.float64
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(r, 5)
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(r, torch.zeros(11, dtype=torch.long))
    with pytest.raises(ValueError, match="eps"):
        group_advantages(r, 4, eps=-1.0)


def test_token_broadcast() -> None:
    adv = torch.tensor([1.0, -2.0, 3.0])
    idx = torch.tensor([2, 0, 0, 1, 2])
    assert token_advantages(adv, idx).tolist() == [3.0, 1.0, 1.0, -2.0, 3.0]


groups_strategy = st.lists(
    st.lists(st.floats(-100, 100, allow_nan=False), min_size=1, max_size=8), min_size=1, max_size=6
)


@settings(max_examples=50, deadline=None)
@given(groups=groups_strategy, seed=st.integers(0, 2**16), norm=st.booleans())
@example(groups=[[0.0, 3.922459731233521e-168]], seed=0, norm=True)  # variance underflow
@example(groups=[[0.0, 5e-324]], seed=0, norm=True)  # subnormal: mean not representable
def test_property_group_moments(groups: list[list[float]], seed: int, norm: bool) -> None:
    rewards = torch.tensor([r for g in groups for r in g], dtype=torch.float64)
    ids = torch.tensor([gi for gi, g in enumerate(groups) for _ in g])
    perm = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(seed))
    shuffled = group_advantages(rewards[perm], ids[perm], eps=0.0, normalize_std=norm)
    assert torch.isfinite(shuffled).all()
    adv = torch.empty_like(shuffled)
    adv[perm] = shuffled  # back to the unshuffled order
    for gi, g in enumerate(groups):
        a = adv[ids == gi]
        x = torch.tensor(g, dtype=torch.float64)
        if (x == x[0]).all():
            assert (a == 0).all()
            continue
        assert abs(a.mean().item()) < 1e-9
        if norm:
            spread = x.std(unbiased=False).item()
            if spread > 1e-6:  # far from the eps/rounding regime
                assert abs(a.std(unbiased=False).item() - 1.0) < 1e-9
        else:
            torch.testing.assert_close(a, x - x.mean())
