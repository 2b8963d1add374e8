"""Binomial rate intervals, stdlib only: the Wilson score interval.

The verifier's FP/FN audit, the task sampler's difficulty band and the evaluation report all
bound a success rate with it; it imports nothing from closedloop but the errors, so every layer
can use it.
"""

from __future__ import annotations

import math

from closedloop.errors import EmptySampleError, StatsInputError

__all__ = ["wilson_interval"]


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion.

    center = (p̂ + z²/2n) / (1 + z²/n), half = z·sqrt(p̂(1-p̂)/n + z²/4n²) / (1 + z²/n), clamped to
    [0, 1]. n = 0 raises :class:`EmptySampleError` (an interval with no data is not (0, 1) by
    convention here: the caller must report the missing denominator).
    Hand-worked: 0/10 -> (0, 0.2775); 5/10 -> (0.2366, 0.7634).
    """
    if n < 1:
        raise EmptySampleError(f"wilson_interval needs n >= 1, got n={n}")
    if not 0 <= successes <= n:
        raise StatsInputError(f"need 0 <= successes <= n, got {successes}, {n}")
    if not z > 0:
        raise StatsInputError(f"z must be positive, got {z}")
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n)) / denom
    # At s = 0 (s = n) the bound is exactly 0 (1); set it so rounding cannot leave 1e-17.
    lo = 0.0 if successes == 0 else max(0.0, center - half)
    hi = 1.0 if successes == n else min(1.0, center + half)
    return lo, hi
