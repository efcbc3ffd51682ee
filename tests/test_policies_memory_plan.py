"""Memory plans against a device budget (``policies.memory_plan``), at the reference text's
example and at the boundary."""

from __future__ import annotations

import pytest

from policies.memory_plan import GIB, MemoryPlan, check_memory_plan, fmt_count


def test_the_reference_texts_70b_at_4_bits_does_not_fit_24_gib_by_8_6() -> None:
    verdict = check_memory_plan(MemoryPlan(parameters=70e9, bits=4, budget_gib=24))
    assert not verdict.fits
    assert verdict.total_bytes == 35e9
    assert round(verdict.total_bytes / GIB, 1) == 32.6
    assert round(-verdict.headroom_bytes / GIB, 1) == 8.6
    message = verdict.message()
    assert "70B x 4 bits / 8 = 35e9 bytes = 32.6 GiB" in message
    assert "exceeds the 24 GiB usable budget by 8.6 GiB" in message


def test_a_base_only_fit_says_what_the_remaining_headroom_must_hold() -> None:
    verdict = check_memory_plan(MemoryPlan(parameters=70e9, bits=4, budget_gib=48))
    assert verdict.fits and verdict.base_only
    assert "the remaining 15.4 GiB must hold everything else" in verdict.message()


def test_exactly_the_budget_fits_and_one_byte_more_does_not() -> None:
    budget = 2.0
    exact = MemoryPlan(parameters=budget * GIB, bits=8, budget_gib=budget)
    assert check_memory_plan(exact).fits
    over = MemoryPlan(parameters=budget * GIB + 1, bits=8, budget_gib=budget)
    assert not check_memory_plan(over).fits


def test_training_terms_count_and_sharding_divides_all_but_activations() -> None:
    full = MemoryPlan(
        parameters=7e9,
        bits=16,
        budget_gib=80,
        trainable_parameters=7e9,
        gradient_bits=16,
        optimizer_bytes_per_parameter=12,
        activations_gib=10,
    )
    verdict = check_memory_plan(full)
    assert [t.name for t in verdict.terms] == ["base weights", "gradients", "optimizer state", "activations"]
    assert verdict.total_bytes == 14e9 + 14e9 + 84e9 + 10 * GIB  # 7B x (2 + 2 + 12) bytes + 10 GiB
    assert not verdict.fits and not verdict.base_only
    sharded = check_memory_plan(MemoryPlan(**{**full.__dict__, "shards": 8}))
    assert sharded.total_bytes == (14e9 + 14e9 + 84e9) / 8 + 10 * GIB
    assert sharded.fits and "/ 8 shards" in sharded.terms[0].arithmetic


@pytest.mark.parametrize(
    "kwargs",
    [
        {"parameters": 0, "bits": 4, "budget_gib": 24},
        {"parameters": 7e9, "bits": 0, "budget_gib": 24},
        {"parameters": 7e9, "bits": 4, "budget_gib": -1},
        {"parameters": 7e9, "bits": 4, "budget_gib": 24, "activations_gib": -1},
        {"parameters": 7e9, "bits": 4, "budget_gib": 24, "shards": 0},
        {"parameters": 7e9, "bits": 4, "budget_gib": 24, "trainable_parameters": 8e9},
    ],
)
def test_an_impossible_plan_is_refused_with_the_field_named(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="MemoryPlan"):
        MemoryPlan(**kwargs)  # type: ignore[arg-type]


def test_counts_print_as_people_write_them() -> None:
    assert [fmt_count(n) for n in (70e9, 1.25e8, 7.5e9, 2e12, 512)] == ["70B", "125M", "7.5B", "2T", "512"]
