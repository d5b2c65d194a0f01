"""tools/evidence_stats.py against brute-force enumerations, published table values and planted
cases (scipy is not in the venv to compare with)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from tools.evidence_stats import (
    fisher_greater,
    fisher_power,
    fisher_two_sided,
    holm,
    mcnemar_greater,
    mde_paired,
    mde_rate,
    sign_flip_p,
    t_cdf,
    t_quantile,
    tost_paired,
)

TABLES = [(6, 10, 0, 10), (3, 10, 1, 10), (0, 5, 0, 7), (4, 6, 2, 8), (2, 3, 3, 3), (1, 4, 5, 6)]


def _brute_fisher(x_a: int, n_a: int, x_b: int, n_b: int) -> tuple[float, float]:
    """Every assignment of the n_a + n_b runs (their outcomes fixed) to arm A enumerated:
    (one-sided greater, two-sided) p-values."""
    outcomes = [1] * (x_a + x_b) + [0] * (n_a + n_b - x_a - x_b)
    counts = [
        sum(outcomes[i] for i in c) for c in itertools.combinations(range(len(outcomes)), n_a)
    ]
    total = len(counts)
    freq = {k: counts.count(k) for k in set(counts)}
    greater = sum(1 for c in counts if c >= x_a) / total
    two = sum(f for f in freq.values() if f <= freq[x_a]) / total
    return greater, two


@pytest.mark.parametrize("table", TABLES)
def test_fisher_matches_enumeration(table: tuple[int, int, int, int]) -> None:
    greater, two = _brute_fisher(*table)
    assert fisher_greater(*table) == pytest.approx(greater, rel=1e-12)
    assert fisher_two_sided(*table) == pytest.approx(two, rel=1e-12)


def test_fisher_planted() -> None:
    # The exploratory count (6 of 10 vs 0 of 10): only the observed table is as extreme.
    assert fisher_greater(6, 10, 0, 10) == pytest.approx(210 / 38760)
    assert fisher_greater(10, 10, 0, 10) == pytest.approx(1 / math.comb(20, 10))
    assert fisher_greater(0, 10, 0, 10) == 1.0  # no events: nothing to detect
    assert fisher_greater(0, 10, 6, 10) == 1.0  # the wrong direction
    with pytest.raises(ValueError):
        fisher_greater(11, 10, 0, 10)


def _sum_distribution(d: list[int]) -> dict[int, int]:
    """Number of sign vectors giving each sum (dynamic programming over integers)."""
    dist = {0: 1}
    for x in d:
        nxt: dict[int, int] = {}
        for s, c in dist.items():
            for v in (s + x, s - x):
                nxt[v] = nxt.get(v, 0) + c
        dist = nxt
    return dist


def test_sign_flip_matches_dynamic_programming() -> None:
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(1, 10)
        d = [rng.randint(-5, 5) for _ in range(n)]
        dist, t = _sum_distribution(d), sum(d)
        total = 2**n
        assert sign_flip_p(d, "greater") == sum(c for s, c in dist.items() if s >= t) / total
        assert sign_flip_p(d, "less") == sum(c for s, c in dist.items() if s <= t) / total
        two = sum(c for s, c in dist.items() if abs(s) >= abs(t)) / total
        assert sign_flip_p(d, "two-sided") == two


def test_sign_flip_planted() -> None:
    d = [0.01 * (i + 1) for i in range(10)]  # every difference positive: the most extreme sum
    assert sign_flip_p(d, "greater") == 1 / 1024
    assert sign_flip_p(d, "two-sided") == 2 / 1024
    assert sign_flip_p(d, "less") == 1.0
    assert sign_flip_p([0.0] * 6, "two-sided") == 1.0
    # Float sums equal in exact arithmetic count as ties (0.1 + 0.2 vs 0.3).
    assert sign_flip_p([0.1, 0.2, -0.3], "two-sided") == 1.0


def test_mcnemar_is_the_sign_flip_test_of_the_paired_outcomes() -> None:
    rng = random.Random(1)
    for _ in range(30):
        a = [rng.random() < 0.5 for _ in range(10)]
        b = [rng.random() < 0.3 for _ in range(10)]
        d = [int(x) - int(y) for x, y in zip(a, b, strict=True)]
        assert mcnemar_greater(a, b) == pytest.approx(sign_flip_p(d, "greater"))
    assert mcnemar_greater([True] * 6 + [False] * 4, [False] * 10) == 1 / 64


def test_tost_planted() -> None:
    rng = random.Random(2)
    close = [rng.uniform(-0.005, 0.005) for _ in range(10)]  # well inside +-0.02
    p, p_lo, p_hi = tost_paired(close, 0.02)
    assert p == p_lo == p_hi == 1 / 1024
    far = [0.05 + rng.uniform(-0.005, 0.005) for _ in range(10)]  # outside: not equivalent
    p, p_lo, p_hi = tost_paired(far, 0.02)
    assert p_lo == 1 / 1024 and p_hi == 1.0 and p == 1.0
    # Spread wider than the margin: equivalence cannot be shown even with mean 0.
    wide = [0.1, -0.1] * 5
    assert tost_paired(wide, 0.02)[0] > 0.05


def test_holm() -> None:
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert holm([0.9, 0.8]) == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize(
    ("q", "df", "want"),
    [(0.975, 9, 2.262157), (0.8, 9, 0.883404), (0.975, 2, 4.302653), (0.995, 30, 2.749996),
     (0.9, 1, 3.077684), (0.025, 9, -2.262157)],
)  # fmt: skip
def test_t_quantile_matches_tables(q: float, df: int, want: float) -> None:
    assert t_quantile(q, df) == pytest.approx(want, abs=2e-6)


def test_t_cdf_closed_forms() -> None:
    assert t_cdf(0.0, 7) == pytest.approx(0.5)
    assert t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(t)/pi
    assert t_cdf(-2.0, 2) == pytest.approx(0.5 - 1 / math.sqrt(6))  # df 2: 1/2 + t/(2 sqrt(2+t^2))


def test_mde_paired() -> None:
    assert mde_paired(1.0, 10) == pytest.approx((2.262157 + 0.883404) / math.sqrt(10), rel=1e-5)
    assert mde_paired(0.0, 10) == 0.0
    assert mde_paired(1.0, 1) == math.inf


def _brute_power(p_a: float, n_a: int, p_b: float, n_b: int, alpha: float) -> float:
    """Every outcome vector of the n_a + n_b runs enumerated with its probability."""
    total = 0.0
    for out in itertools.product((0, 1), repeat=n_a + n_b):
        xa, xb = sum(out[:n_a]), sum(out[n_a:])
        prob = math.prod(p_a if o else 1 - p_a for o in out[:n_a])
        prob *= math.prod(p_b if o else 1 - p_b for o in out[n_a:])
        if fisher_greater(xa, n_a, xb, n_b) <= alpha:
            total += prob
    return total


def test_fisher_power_and_mde_rate() -> None:
    for p_a, p_b in ((0.9, 0.1), (0.6, 0.0), (0.5, 0.5)):
        want = _brute_power(p_a, 5, p_b, 6, 0.05)
        assert fisher_power(p_a, 5, p_b, 6, 0.05) == pytest.approx(want, rel=1e-12)
    mde = mde_rate(0.0, 10, 10, alpha=0.025)
    assert mde is not None
    assert fisher_power(mde, 10, 0.0, 10, 0.025) >= 0.8
    assert fisher_power(mde - 0.01, 10, 0.0, 10, 0.025) < 0.8
    assert mde_rate(0.9, 3, 3) is None  # 3 runs against a 0.9 rate: nothing detectable
