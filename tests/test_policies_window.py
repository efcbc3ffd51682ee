import random
import statistics

import pytest

from policies.window import RobustWindow


def test_push_keeps_the_last_capacity_values_in_order() -> None:
    window = RobustWindow(3)
    for value in [5.0, 1.0, 4.0, 2.0]:
        window = window.push(value)
    assert window.values == (1.0, 4.0, 2.0)
    assert window.ordered == (1.0, 2.0, 4.0)


def test_median_and_mad_match_the_statistics_module() -> None:
    rng = random.Random(7)
    window = RobustWindow(51)
    values = [rng.gauss(0, 1) for _ in range(200)]
    for value in values:
        window = window.push(value)
    tail = values[-51:]
    center = statistics.median(tail)
    assert window.median() == pytest.approx(center)
    assert window.mad() == pytest.approx(statistics.median(abs(v - center) for v in tail))


def test_even_window_median_is_the_midpoint() -> None:
    window = RobustWindow(4)
    for value in [1.0, 2.0, 3.0, 10.0]:
        window = window.push(value)
    assert window.median() == 2.5


def test_empty_window_has_no_median() -> None:
    with pytest.raises(ValueError):
        RobustWindow(3).median()


def test_push_returns_a_new_value() -> None:
    empty = RobustWindow(3)
    assert len(empty.push(1.0)) == 1
    assert len(empty) == 0


def test_before_keeps_only_earlier_steps_and_stays_consistent() -> None:
    window = RobustWindow(4)
    for step, value in enumerate([5.0, 1.0, 4.0, 2.0, 3.0]):
        window = window.push(value, step)
    assert window.values == (1.0, 4.0, 2.0, 3.0) and window.steps == (1, 2, 3, 4)
    earlier = window.before(3)
    assert earlier.values == (1.0, 4.0) and earlier.ordered == (1.0, 4.0) and earlier.steps == (1, 2)
    assert window.before(10) is window
    assert len(window.before(0)) == 0


def test_step_mad_ignores_a_steady_trend() -> None:
    window = RobustWindow(50)
    rng = random.Random(3)
    for i in range(50):
        window = window.push(10.0 - 0.1 * i + rng.gauss(0, 0.01))
    assert window.mad() > 1.0  # the fall itself
    assert 0.002 < window.step_mad() < 0.02  # about the noise's 0.01 (MAD units)
