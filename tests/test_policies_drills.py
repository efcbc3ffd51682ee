"""The restart drills' pure verdicts: which values differ and by how much."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policies.drills import (
    Check,
    DrillConfig,
    boundary,
    budget,
    compare_arrays,
    compare_ids,
    compare_numbers,
    memory,
    partition,
    verdict,
)
from policies.setting_error import ConfigError

CONFIG = DrillConfig()


def test_equal_arrays_match_and_say_the_tolerance() -> None:
    weights = {"0.weight": np.ones((2, 3)), "0.bias": np.zeros(2)}
    check = compare_arrays("weights", "weights", weights, {k: v.copy() for k, v in weights.items()}, CONFIG)
    assert check.passed and check.measured["max_abs_diff"] == 0.0
    assert "2 weights match" in check.detail and "1e-06 + 1e-05 x |reference|" in check.detail


def test_a_difference_names_the_array_and_its_size() -> None:
    reference = {"a": np.array([1.0, 2.0]), "b": np.array([3.0])}
    resumed = {"a": np.array([1.0, 2.0 + 1e-9]), "b": np.array([3.5])}
    check = compare_arrays("weights", "weights", reference, resumed, CONFIG)
    assert not check.passed
    assert check.measured["differing"] == ["b"] and check.measured["worst"] == "b"
    assert check.measured["max_abs_diff"] == pytest.approx(0.5)
    assert "1 of 2 weights differ, largest |diff| 0.5 in b" in check.detail


def test_relative_tolerance_scales_with_the_value() -> None:
    reference = {"big": np.array([1e4])}
    within = compare_arrays("w", "weights", reference, {"big": np.array([1e4 + 0.05])}, CONFIG)
    beyond = compare_arrays("w", "weights", reference, {"big": np.array([1e4 + 0.2])}, CONFIG)
    assert within.passed and not beyond.passed


def test_missing_state_fails_by_name() -> None:
    reference = {"0.weight.exp_avg": np.ones(3), "0.weight.exp_avg_sq": np.ones(3)}
    check = compare_arrays("adam_moments", "optimizer values", reference, {}, CONFIG)
    assert not check.passed
    assert check.measured["missing"] == ["0.weight.exp_avg", "0.weight.exp_avg_sq"]
    assert "2 of 2 optimizer values missing" in check.detail


def test_nan_where_the_reference_is_finite_differs_and_nan_on_both_agrees() -> None:
    reference = {"a": np.array([1.0, math.nan])}
    assert compare_arrays("w", "weights", reference, {"a": np.array([1.0, math.nan])}, CONFIG).passed
    check = compare_arrays("w", "weights", reference, {"a": np.array([math.nan, math.nan])}, CONFIG)
    assert not check.passed and check.measured["max_abs_diff"] == math.inf


def test_a_shape_change_differs() -> None:
    check = compare_arrays("w", "weights", {"a": np.ones(4)}, {"a": np.ones(2)}, CONFIG)
    assert not check.passed and check.measured["differing"] == ["a"]


def test_learning_rates_print_both_values() -> None:
    check = compare_numbers("learning_rate", "learning rates", [0.003], [0.00015], CONFIG)
    assert not check.passed
    assert "[0.00015] against [0.003]" in check.detail
    assert not compare_numbers("learning_rate", "learning rates", [0.003, 0.001], [0.003], CONFIG).passed


def test_sample_ids_are_compared_exactly_per_rank() -> None:
    assert compare_ids("next_sample_ids", {0: [1, 2], 1: [3, 4]}, {0: [1, 2], 1: [3, 4]}).passed
    check = compare_ids("next_sample_ids", {0: [1, 2]}, {0: [9, 2]})
    assert not check.passed and check.measured["differing_ranks"] == [0]
    assert "rank 0 reads [9, 2] next, the uninterrupted run [1, 2]" in check.detail


def test_a_repartition_that_covers_the_next_examples_once_passes() -> None:
    saved = {0: [10, 12, 14, 16], 1: [11, 13, 15, 17]}
    restored = {0: [10, 14], 1: [11, 15], 2: [12, 16], 3: [13, 17]}
    check = partition("data_partition", saved, restored)
    assert check.passed and "split over 4 ranks, each once (2, 2, 2, 2 per rank)" in check.detail


def test_a_repartition_that_repeats_or_drops_examples_fails() -> None:
    saved = {0: [10, 12], 1: [11, 13]}
    check = partition("data_partition", saved, {0: [10, 12], 1: [10, 12], 2: [], 3: []})
    assert not check.passed
    assert check.measured["repeated"] == [10, 12] and check.measured["dropped"] == [11, 13]


def test_a_cursor_off_an_update_boundary_is_a_half_window() -> None:
    assert boundary("b", 9, 216, 24).passed
    check = boundary("b", 9, 216 + 12, 24)
    assert not check.passed and "+12 examples off an update boundary" in check.detail


def test_the_preemption_budget_is_the_sum_of_the_path() -> None:
    assert budget(0.3, 0.2, 2.0) == pytest.approx(2.5)


def test_restore_memory_against_a_budget() -> None:
    assert memory("m", {0: 350.0, 1: 360.0}, 0.0).passed
    over = memory("m", {0: 350.0, 1: 360.0}, 300.0)
    assert not over.passed and "rank 1 peaked at 360 MiB, over the 300 MiB budget" in over.detail
    assert not memory("m", {}, 0.0).passed


def test_verdict_needs_every_check_and_at_least_one() -> None:
    assert verdict([Check("a", True, ""), Check("b", True, "")]) == "pass"
    assert verdict([Check("a", True, ""), Check("b", False, "")]) == "fail"
    assert verdict([]) == "fail"


@pytest.mark.parametrize(
    "fields",
    [
        {"atol": -1.0},
        {"rtol": -1e-5},
        {"margin_s": -1.0},
        {"short_warning_fraction": 1.0},
        {"restore_memory_budget_mib": -1.0},
    ],
)
def test_config_rejects_bad_values(fields: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        DrillConfig(**fields)
