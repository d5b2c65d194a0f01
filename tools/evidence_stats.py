"""Exact small-sample statistics for the pre-registered evidence study (docs/evidence/plan.md).

Pure Python (scipy is not in the project's venv), exact where n is small enough to enumerate:

- `fisher_greater` / `fisher_two_sided`: Fisher's exact test on two arms' event counts (the
  hypergeometric law of arm A's count given both margins).
- `mcnemar_greater`: the exact McNemar test on seed-paired binary outcomes (binomial on the
  discordant pairs).
- `sign_flip_p`: the exact paired permutation test, every one of the 2^n sign vectors of the
  paired differences enumerated; statistic sum(d).
- `tost_paired`: two one-sided sign-flip tests against +-delta (equivalence).
- `holm`: Holm's step-down adjusted p-values.
- `t_quantile`, `mde_paired`: the paired minimum detectable effect,
  (t_{1-alpha/2, n-1} + t_{power, n-1}) * sd(d) / sqrt(n).
- `mde_rate`: the smallest event rate in one arm that the one-sided Fisher test detects with the
  given power against the other arm's rate (exact binomial enumeration).

tests/test_evidence_stats.py checks each against a brute-force enumeration and planted cases.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

__all__ = [
    "fisher_greater",
    "fisher_two_sided",
    "holm",
    "mcnemar_greater",
    "mde_paired",
    "mde_rate",
    "sign_flip_p",
    "t_cdf",
    "t_quantile",
    "tost_paired",
]

# Relative tolerance for "as or more extreme": sums of floats that are equal in exact
# arithmetic can differ in the last bits (scipy uses the same idea, 1e-7 relative).
_REL = 1e-9


def _hypergeom_pmf(k: int, n_a: int, n_b: int, events: int) -> float:
    """P(arm A has k of the `events`) when `events` are spread at random over n_a + n_b runs."""
    return math.comb(n_a, k) * math.comb(n_b, events - k) / math.comb(n_a + n_b, events)


def fisher_greater(x_a: int, n_a: int, x_b: int, n_b: int) -> float:
    """One-sided Fisher exact p-value for "arm A's event rate is higher than arm B's":
    P(K >= x_a), K hypergeometric with both margins fixed."""
    _check_counts(x_a, n_a, x_b, n_b)
    m = x_a + x_b
    hi = min(n_a, m)
    return min(1.0, sum(_hypergeom_pmf(k, n_a, n_b, m) for k in range(x_a, hi + 1)))


def fisher_two_sided(x_a: int, n_a: int, x_b: int, n_b: int) -> float:
    """Two-sided Fisher exact p-value: the probability of every table no more likely than the
    observed one (margins fixed)."""
    _check_counts(x_a, n_a, x_b, n_b)
    m = x_a + x_b
    lo, hi = max(0, m - n_b), min(n_a, m)
    p_obs = _hypergeom_pmf(x_a, n_a, n_b, m)
    ps = [_hypergeom_pmf(k, n_a, n_b, m) for k in range(lo, hi + 1)]
    return min(1.0, sum(p for p in ps if p <= p_obs * (1 + _REL)))


def _check_counts(x_a: int, n_a: int, x_b: int, n_b: int) -> None:
    if not (0 <= x_a <= n_a and 0 <= x_b <= n_b and n_a > 0 and n_b > 0):
        raise ValueError(f"counts out of range: {x_a}/{n_a} vs {x_b}/{n_b}")


def mcnemar_greater(a: Sequence[bool], b: Sequence[bool]) -> float:
    """Exact one-sided McNemar p-value for "A has the event more often than B" on seed-paired
    outcomes: with n10 pairs (A yes, B no) and n01 pairs (A no, B yes), P(Bin(n10 + n01, 1/2)
    >= n10)."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes need equal lengths: {len(a)} vs {len(b)}")
    n10 = sum(1 for x, y in zip(a, b, strict=True) if x and not y)
    n01 = sum(1 for x, y in zip(a, b, strict=True) if y and not x)
    n = n10 + n01
    return sum(math.comb(n, k) for k in range(n10, n + 1)) / 2**n


def sign_flip_p(d: Sequence[float], alternative: str = "two-sided") -> float:
    """Exact paired permutation (sign-flip) p-value of sum(d) over all 2^n sign vectors.

    alternative: "greater" (mean(d) > 0), "less" (mean(d) < 0) or "two-sided" (|sum| as large).
    n is at most 20 (a million sign vectors)."""
    if alternative not in ("greater", "less", "two-sided"):
        raise ValueError(f"alternative={alternative!r}: use greater, less or two-sided")
    n = len(d)
    if not 1 <= n <= 20:
        raise ValueError(f"sign_flip_p enumerates 2^n sign vectors: n={n} must be in 1..20")
    t_obs = sum(d)
    tol = _REL * max(1.0, sum(abs(x) for x in d))
    hits = 0
    for signs in itertools.product((1.0, -1.0), repeat=n):
        t = sum(s * x for s, x in zip(signs, d, strict=True))
        if alternative == "greater":
            hits += t >= t_obs - tol
        elif alternative == "less":
            hits += t <= t_obs + tol
        else:
            hits += abs(t) >= abs(t_obs) - tol
    return hits / 2**n


def tost_paired(d: Sequence[float], delta: float) -> tuple[float, float, float]:
    """Two one-sided sign-flip tests of equivalence within +-delta on the paired differences d:
    (p_TOST, p_lower, p_upper), p_lower testing H0 mean(d) <= -delta (on d + delta, "greater"),
    p_upper testing H0 mean(d) >= +delta (on d - delta, "less"); p_TOST = max of the two."""
    if delta <= 0:
        raise ValueError(f"equivalence margin delta={delta} must be > 0")
    p_lo = sign_flip_p([x + delta for x in d], "greater")
    p_hi = sign_flip_p([x - delta for x in d], "less")
    return max(p_lo, p_hi), p_lo, p_hi


def holm(ps: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p-values (same order as `ps`; monotone; capped at 1)."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out = [0.0] * len(ps)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                   -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):  # fmt: skip
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
    lbt += b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student t CDF with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df={df} must be > 0")
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(q: float, df: float) -> float:
    """Student t quantile (bisection on `t_cdf`)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q={q} must be in (0, 1)")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return 0.5 * (lo + hi)


def mde_paired(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """Minimum detectable mean paired difference, two-sided level `alpha`, given power:
    (t_{1-alpha/2, n-1} + t_{power, n-1}) * sd / sqrt(n)."""
    if n < 2:
        return math.inf
    return (t_quantile(1 - alpha / 2, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n)


def _binom_pmf(k: int, n: int, p: float) -> float:
    return math.comb(n, k) * p**k * (1 - p) ** (n - k)


def fisher_power(p_a: float, n_a: int, p_b: float, n_b: int, alpha: float) -> float:
    """Power of the one-sided Fisher test (A higher) at level `alpha` when arm A's true rate is
    p_a and arm B's p_b: the sum over every outcome pair of its probability where p <= alpha."""
    return sum(
        _binom_pmf(xa, n_a, p_a) * _binom_pmf(xb, n_b, p_b)
        for xa in range(n_a + 1)
        for xb in range(n_b + 1)
        if fisher_greater(xa, n_a, xb, n_b) <= alpha
    )


def mde_rate(
    p_b: float, n_a: int, n_b: int, alpha: float = 0.025, power: float = 0.8
) -> float | None:
    """Smallest rate of arm A (grid of 0.01) that the one-sided Fisher test at `alpha` detects
    with `power` against arm B's rate p_b; None when not even a rate of 1 is detected."""
    for i in range(101):
        p_a = i / 100
        if p_a > p_b and fisher_power(p_a, n_a, p_b, n_b, alpha) >= power:
            return p_a
    return None
