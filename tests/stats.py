"""Statistics the sampling tests share: a two-sample chi-square on token counts."""

from __future__ import annotations

from collections import Counter


def two_sample_chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom; rare categories pooled."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rest_a = sum(v for k, v in a.items() if k not in keys)
    rest_b = sum(v for k, v in b.items() if k not in keys)
    rows = [(a[k], b[k]) for k in keys] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for x, y in rows:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(rows) - 1


# chi-square critical values at significance 0.001 by degrees of freedom
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
             10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70, 16: 39.25, 17: 40.79,
             18: 42.31, 19: 43.82, 20: 45.31}
