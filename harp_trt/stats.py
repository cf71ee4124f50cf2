"""Small statistics the benchmarks share, with no numpy or scipy: the quantile of Student's t for
their confidence intervals (``bench/stage/latency.paired_speedup``, ``bench/_gpu_common.ci95``)."""
from __future__ import annotations

import math

__all__ = ["t_quantile", "ratio_ci95_across_runs"]


def _t_central_mass(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer ``df`` (Abramowitz & Stegun 26.7.3 and 26.7.4: finite
    sums in theta = atan(t / sqrt(df)))."""
    theta = math.atan(t / math.sqrt(df))
    c2, term, total = math.cos(theta) ** 2, 1.0, 1.0
    if df % 2:  # odd: (2 / pi) (theta + sin cos (1 + 2/3 c2 + 2.4/(3.5) c2^2 + ...)), df - 3 powers
        if df == 1:
            return 2 * theta / math.pi
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    for k in range(1, df // 2):  # even: sin (1 + 1/2 c2 + 1.3/(2.4) c2^2 + ...), df - 2 powers
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with integer ``df`` degrees of freedom, p in (0.5, 1): the root
    of the exact distribution function (``_t_central_mass``) by bisection, to 1e-12. No scipy or numpy
    needed (the GPU scripts import it too); ``tests/test_bench_stats.py`` checks it against scipy."""
    if not 0.5 < p < 1 or df < 1 or int(df) != df:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and an integer df >= 1, got p={p}, df={df}")
    target, lo, hi = 2 * p - 1, 0.0, 1.0
    while _t_central_mass(hi, int(df)) < target:
        hi *= 2
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_central_mass(mid, int(df)) < target else (lo, mid)
    return (lo + hi) / 2


def ratio_ci95_across_runs(ratios: list[float]) -> tuple[float, float] | None:
    """95 % interval of a ratio (a speed-up) across independent runs: Student t on the runs' log
    ratios, so it holds the between-run spread a single run's interval does not see. None for fewer
    than 2 runs (a range of one run is no interval)."""
    n = len(ratios)
    if n < 2:
        return None
    logs = [math.log(x) for x in ratios]
    mean = sum(logs) / n
    half = t_quantile(0.975, n - 1) * math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1) / n)
    return math.exp(mean - half), math.exp(mean + half)
