"""Robust statistics: the median, the median absolute deviation (MAD) and the robust z.

Every threshold "calibrated on the run's own normal variability" is a distance from a median
in units of a MAD, so one outlier (the fault being looked for) cannot move the bar it is judged
against. Two forms of each: over plain sequences (small trailing windows kept as tuples) and
over numpy arrays (one value per rank or per device). Both give the same numbers: the middle
value, or the mean of the two middle values.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

# Scales a median absolute deviation to a standard deviation for normal noise (1 / Phi^-1(3/4)).
MAD_TO_SIGMA = 1.4826
SQRT2 = 2.0**0.5


def median_of_sorted(ordered: Sequence[float]) -> float:
    """The median of values already in order (O(1)); an empty sequence has none."""
    n = len(ordered)
    if n == 0:
        raise ValueError("median of no values")
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def median(values: Iterable[float]) -> float:
    return median_of_sorted(sorted(values))


def mad(values: Iterable[float], center: float) -> float:
    """The median absolute deviation of ``values`` from ``center`` (their median, usually)."""
    return median_of_sorted(sorted([abs(value - center) for value in values]))


def step_mad(values: Sequence[float]) -> float:
    """The MAD of step-to-step changes over sqrt 2: the noise of one value whatever the slow
    trend of the sequence (a falling loss inflates the plain MAD with the fall itself). Needs
    three values; below that, the plain MAD."""
    if len(values) < 3:
        return mad(values, median(values))
    changes = sorted([b - a for a, b in itertools.pairwise(values)])
    return mad(changes, median_of_sorted(changes)) / SQRT2


def allowed_excess(z: float, spread: float) -> float:
    """How far above the center ``z`` robust standard deviations reach, for a MAD ``spread``."""
    return z * MAD_TO_SIGMA * spread


def array_median(values: npt.NDArray[Any] | Sequence[float]) -> float:
    return float(np.median(values))


def float_median(values: npt.NDArray[Any]) -> float:
    """``np.median`` of an array, bit for bit, at a fraction of its cost on a float64 vector.

    A window's per-rank medians are taken several times per window, where ``np.median``'s
    generic path (axes, a ``mean`` of the middle values, its NaN check) cost ~20 us a call,
    more than the partition itself. The same partition here: the middle one or two values,
    NaN when any value is NaN, and the middle values summed from 0.0 as ``np.mean`` sums them
    (so a median of -0.0 is 0.0, as there). Other arrays take ``np.median`` itself.
    """
    n = len(values) if values.ndim == 1 else 0
    if n == 0 or values.dtype != np.float64:
        return float(np.median(values))
    mid = n // 2
    part = np.partition(values, [mid, -1] if n % 2 else [mid - 1, mid, -1])
    if math.isnan(part[-1]):  # NaN sorts last
        return math.nan
    if n % 2:
        return 0.0 + float(part[mid])
    return (0.0 + float(part[mid - 1]) + float(part[mid])) / 2


def array_median_mad(values: npt.NDArray[Any]) -> tuple[float, float]:
    """The median of an array and its values' MAD around it."""
    center = float_median(values)
    return center, float_median(np.abs(values - center))


def robust_center_scale(values: npt.NDArray[Any]) -> tuple[float, float]:
    """The median and the robust standard deviation (``MAD_TO_SIGMA`` x MAD)."""
    center, spread = array_median_mad(values)
    return center, MAD_TO_SIGMA * spread


def finite_median(values: npt.NDArray[np.float64]) -> float:
    """The median over the finite values (NaN when none is finite)."""
    finite = values[np.isfinite(values)]
    return float_median(finite) if len(finite) else math.nan


def robust_z(value: float, center: float, scale: float) -> float:
    """How many robust standard deviations ``value`` is above ``center``; with no spread
    (peers that all agree, as error counters often do), any excess is infinitely far."""
    return (value - center) / scale if scale > 0 else math.inf
