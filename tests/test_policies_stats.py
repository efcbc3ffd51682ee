"""Robust statistics (``policies.stats``): the one median, MAD and robust z of the policies."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.stats import (
    MAD_TO_SIGMA,
    allowed_excess,
    array_median,
    array_median_mad,
    finite_median,
    float_median,
    mad,
    median,
    median_of_sorted,
    robust_center_scale,
    robust_z,
    step_mad,
)

reals = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False)
samples = st.lists(reals, min_size=1, max_size=40)


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@settings(database=None)
@given(samples)
def test_the_sequence_and_array_forms_give_the_same_numbers(values: list[float]) -> None:
    # Bit for bit: the policies moved between them must not move a threshold.
    assert median(values) == statistics.median(values) == array_median(np.array(values))
    center, spread = array_median_mad(np.array(values))
    assert (center, spread) == (median(values), mad(values, median(values)))


def test_median_of_an_even_count_is_the_mean_of_the_middle_two() -> None:
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert median_of_sorted((1.0, 2.0, 10.0)) == 2.0
    with pytest.raises(ValueError, match="no values"):
        median([])


def test_mad_is_the_median_distance_from_the_center() -> None:
    assert mad([1.0, 2.0, 3.0, 4.0, 100.0], 3.0) == 1.0


def test_step_mad_ignores_a_steady_trend() -> None:
    falling = [10.0 - 0.5 * i for i in range(20)]
    assert step_mad(falling) == 0.0
    assert mad(falling, median(falling)) > 2.0
    assert step_mad([1.0, 3.0]) == mad([1.0, 3.0], 2.0) == 1.0  # too short for changes


def test_the_robust_scale_and_the_allowed_excess_use_the_normal_constant() -> None:
    center, scale = robust_center_scale(np.array([1.0, 2.0, 3.0, 4.0, 100.0]))
    assert (center, scale) == (3.0, MAD_TO_SIGMA * 1.0)
    # The order of the product is part of the number: z x 1.4826 first, then the spread.
    assert allowed_excess(7.0, 0.3) == 7.0 * MAD_TO_SIGMA * 0.3


def test_robust_z_with_no_spread_is_infinite() -> None:
    assert robust_z(5.0, 1.0, 2.0) == 2.0
    assert robust_z(1.5, 1.0, 0.0) == math.inf


def test_finite_median_skips_what_was_not_logged() -> None:
    assert finite_median(np.array([np.nan, 1.0, 3.0, np.inf])) == 2.0
    assert same(finite_median(np.array([np.nan])), math.nan)


odd_values = st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 1e308, -1e308, 5e-324, 1.0])


@settings(database=None)
@given(st.lists(st.one_of(reals, odd_values), min_size=1, max_size=40))
def test_float_median_is_numpys_median_bit_for_bit(values: list[float]) -> None:
    # Signed zeros included: numpy sums the middle values from 0.0, so a median of -0.0 is 0.0.
    array = np.array(values)
    with np.errstate(all="ignore"):  # inf - inf, 1e308 + 1e308 in numpy's mean
        expected = float(np.median(array))
    assert repr(float_median(array)) == repr(expected)


def test_float_median_of_other_arrays_is_numpys() -> None:
    assert float_median(np.array([1, 2, 4, 9])) == 3.0
    assert float_median(np.array([[3.0, 1.0], [2.0, 5.0]])) == 2.5
