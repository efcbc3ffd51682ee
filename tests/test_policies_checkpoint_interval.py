"""Young/Daly checkpoint interval advice (``policies/checkpoint_interval.py``)."""

from __future__ import annotations

import math

import pytest

from policies.checkpoint_interval import IntervalConfig, advise, exposure

CONFIG = IntervalConfig()


def test_the_run_own_interruptions_give_m_and_the_optimum_is_sqrt_2cm() -> None:
    # 4 interruptions in 40,000 s: M = 10,000 s; saves of 50 s: T_opt = sqrt(2 x 50 x 10,000) = 1,000 s.
    advice = advise([40.0, 50.0, 60.0], [[0.0, 350.0, 700.0]], 40_000.0, 4, CONFIG)
    assert advice.mtbi_source == "run" and advice.mtbi_s == 10_000.0
    assert advice.save_cost_s == 50.0
    assert advice.advised is not None and advice.advised.interval_s == pytest.approx(1000.0)
    assert advice.advised.lost_per_interruption_s == pytest.approx(525.0)  # (1000 + 50) / 2
    # Today: saves 350 s apart, 300 s of compute between them.
    assert advice.current is not None and advice.current.interval_s == pytest.approx(300.0)
    assert advice.current.lost_per_interruption_s == pytest.approx(175.0)
    assert advice.current.waste_fraction > advice.advised.waste_fraction
    assert any("sqrt(2 x 50.000 x 10000.0) = 1000.0 s" in line for line in advice.arithmetic)


def test_the_optimum_wastes_least() -> None:
    best = exposure(math.sqrt(2 * 30 * 5000), 30, 5000).waste_fraction
    for interval in (100.0, 300.0, 1000.0, 3000.0):
        assert exposure(interval, 30, 5000).waste_fraction >= best


def test_too_few_interruptions_use_the_configured_fleet_rate() -> None:
    advice = advise([10.0], [], 3600.0, 1, IntervalConfig(fleet_mtbi_s=7200.0))
    assert advice.mtbi_source == "fleet" and advice.mtbi_s == 7200.0
    assert advice.current is None and any("not measured" in line for line in advice.arithmetic)
    assert advice.advised is not None and advice.advised.interval_s == pytest.approx(math.sqrt(2 * 10 * 7200))
    assert CONFIG.fleet_mtbi_s == pytest.approx(54 * 86400 / 419)


def test_no_save_no_advice() -> None:
    advice = advise([], [], 3600.0, 5, CONFIG)
    assert advice.advised is None and advice.save_cost_s is None
    assert any("no interval can be advised" in line for line in advice.arithmetic)


def test_the_config_is_validated() -> None:
    with pytest.raises(ValueError, match="fleet_mtbi_s"):
        IntervalConfig(fleet_mtbi_s=0)
    with pytest.raises(ValueError, match="min_interruptions"):
        IntervalConfig(min_interruptions=0)
