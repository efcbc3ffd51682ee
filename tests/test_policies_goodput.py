"""Goodput by cause (``policies/goodput.py``): every second of the wall time lands in one cause."""

from __future__ import annotations

import math

import pytest

from policies.goodput import Cause, GoodputFacts, Life, Span, Stall, Window, goodput


def windows(
    first_step: int, count: int, start: float, every: float = 1.0, wait: float = 0.2
) -> tuple[Window, ...]:
    return tuple(Window(first_step + i, start + every * i, wait) for i in range(count))


def total(found: object) -> float:
    return sum(c.seconds or 0.0 for c in found.categories)  # type: ignore[attr-defined]


def test_a_clean_run_is_start_up_data_wait_and_productive_and_sums_to_the_wall() -> None:
    # Started at 0, windows end at 10, 11, ..., 19 (1 s each, 0.2 s of it waiting for data).
    life = Life("a", 0.0, 19.0, windows(1, 10, 10.0))
    found = goodput(GoodputFacts((life,)))
    assert found.wall_s == 19.0
    assert math.isclose(total(found), 19.0)
    assert math.isclose(found.seconds(Cause.STARTUP_RESTORE), 10.0 - 0.8)  # less one window's compute
    assert math.isclose(found.seconds(Cause.DATA_WAIT), 9 * 0.2)
    assert math.isclose(found.seconds(Cause.PRODUCTIVE), 10 * 0.8)
    assert found.interruptions == 0 and found.ratio == pytest.approx(8.0 / 19.0)


def test_a_checkpoint_and_a_canary_between_windows_are_their_own_causes() -> None:
    # Window 5 ends at 14; a save is published at 16.5 and a canary of 1 s ends at 17.5; window 6
    # ends at 18.3 after a data wait of 3.5 s (the hook's measure: all of 14 -> 17.5).
    steps = [Window(s, 10.0 + s - 1, 0.2) for s in range(1, 6)]
    steps += [Window(6, 18.3, 3.5)] + [Window(s, 18.3 + s - 6, 0.2) for s in range(7, 9)]
    life = Life("a", 0.0, 20.3, tuple(steps))
    found = goodput(GoodputFacts((life,), checkpoints=(Stall("a", 16.5),), canaries=(Stall("a", 17.5, 1.0),)))
    assert found.seconds(Cause.CHECKPOINT_SAVE) == pytest.approx(2.5)
    assert found.seconds(Cause.CANARY) == pytest.approx(1.0)
    assert found.save_costs_s == pytest.approx((2.5,))
    assert math.isclose(total(found), found.wall_s)


def test_steps_a_rollback_went_back_over_are_redone_and_the_hold_is_its_own() -> None:
    # Incarnation a trains steps 1-20 (windows end 10..29), is held from 29.5 to 40, and the
    # rollback's restore (b, started at 41) resumes at step 11.
    first = Life("a", 0.0, 40.5, windows(1, 20, 10.0))
    second = Life("b", 41.0, 60.0, windows(11, 10, 45.0), by_rollback=True)
    found = goodput(GoodputFacts((first, second), holds=(Span("a", 29.5, math.inf),)))
    assert found.seconds(Cause.REDONE_ROLLBACK) == pytest.approx(10 * 0.8)
    assert found.seconds(Cause.REDONE_RESTART) == 0
    assert found.seconds(Cause.HOLD) == pytest.approx(40.5 - 29.5)
    assert found.seconds(Cause.DOWN) == pytest.approx(0.5 + 0.5)  # 29 -> 29.5 and 40.5 -> 41
    assert found.interruptions == 1
    assert math.isclose(total(found), 60.0)


def test_a_crash_after_a_hang_is_hung_before_detection_then_down_and_the_redo_is_a_restart() -> None:
    first = Life("a", 0.0, 50.0, windows(1, 10, 10.0))  # last window at 19, heartbeats until 50
    second = Life("b", 70.0, 90.0, windows(6, 10, 75.0))
    found = goodput(GoodputFacts((first, second), hang_detections={"a": 35.0}))
    assert found.seconds(Cause.HUNG) == pytest.approx(16.0)
    assert found.seconds(Cause.DOWN) == pytest.approx(15.0 + 20.0)
    assert found.seconds(Cause.REDONE_RESTART) == pytest.approx(5 * 0.8)
    assert math.isclose(total(found), 90.0)


def test_without_recorded_data_wait_it_says_so_instead_of_guessing() -> None:
    life = Life("a", 0.0, 19.0, tuple(Window(w.step, w.time) for w in windows(1, 10, 10.0)))
    found = goodput(GoodputFacts((life,)))
    wait = next(c for c in found.categories if c.cause is Cause.DATA_WAIT)
    assert wait.seconds is None and "not measured" in wait.how
    assert math.isclose(total(found), 19.0)


def test_an_incarnation_that_never_reached_a_window_is_start_up_or_down() -> None:
    crashed = Life("a", 0.0, 5.0)
    found = goodput(GoodputFacts((crashed, Life("b", 8.0, 20.0, windows(1, 5, 16.0)))))
    assert found.seconds(Cause.DOWN) == pytest.approx(8.0)
    assert math.isclose(total(found), 20.0)
