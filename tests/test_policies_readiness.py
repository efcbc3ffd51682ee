"""Window readiness as a pure decision: watermarks, declared world sizes, late ranks, and the
service-clock guard, without a store."""

from __future__ import annotations

import pytest

from policies.readiness import (
    IncarnationWindows,
    PendingWindow,
    Readiness,
    ReadinessConfig,
    WindowReadiness,
    expected_ranks,
    ready_windows,
)

CONFIG = ReadinessConfig()  # a 5 s watermark, two attempts


def windows(
    attempts: range, ranks: int, first_seen: float = 0.0, seconds_per_attempt: float = 1.0
) -> list[PendingWindow]:
    return [PendingWindow(a, ranks, a * seconds_per_attempt, first_seen) for a in attempts]


def incarnation(
    waiting: list[PendingWindow], expected: int = 2, name: str = "b", watermark_s: float = 5.0
) -> IncarnationWindows:
    return IncarnationWindows(name, waiting, expected, watermark_s)


def attempts(ready: list[WindowReadiness]) -> list[int]:
    return [w.attempt for w in ready]


def test_a_complete_window_is_ready_at_once() -> None:
    ready = ready_windows([incarnation(windows(range(1, 3), ranks=2))], seen_now=0.0, now=None, config=CONFIG)
    assert ready == [
        WindowReadiness("b", 1, Readiness.COMPLETE, missing_ranks=0),
        WindowReadiness("b", 2, Readiness.COMPLETE, missing_ranks=0),
    ]


def test_windows_are_judged_in_order_so_a_waiting_window_holds_back_later_complete_ones() -> None:
    waiting = [PendingWindow(1, 2, 1.0, 0.0), PendingWindow(2, 1, 2.0, 0.0), PendingWindow(3, 2, 3.0, 0.0)]
    ready = ready_windows([incarnation(waiting)], seen_now=0.0, now=None, config=CONFIG)
    assert attempts(ready) == [1]


def test_a_dead_rank_is_given_up_on_a_watermark_later_by_every_clock() -> None:
    """Two attempts later, 5 s of record time later, and 5 s waited at the service."""
    waiting = windows(range(1, 11), ranks=1)  # rank 1 never reports; attempts 1 s apart
    group = incarnation(waiting)
    assert ready_windows([group], seen_now=4.0, now=None, config=CONFIG) == []  # here 4 s only
    ready = ready_windows([group], seen_now=5.0, now=None, config=CONFIG)
    # Attempt 5 is exactly 5 s behind attempt 10 and 5 attempts behind: given up on too.
    assert attempts(ready) == [1, 2, 3, 4, 5]
    assert {(w.readiness, w.missing_ranks) for w in ready} == {(Readiness.GIVEN_UP, 1)}


def test_record_time_alone_does_not_give_up_on_a_rank_replaying_its_spool() -> None:
    """After an outage rank 0's spool replays first, far ahead of rank 1's in record time; the
    windows between have only just been seen here, so rank 1 is still waited for (its bad batch
    would otherwise reach a window already judged)."""
    before = windows(range(1, 21), ranks=2, first_seen=0.0)
    burst = windows(range(21, 100), ranks=1, first_seen=100.0)
    group = incarnation(before + burst)
    assert attempts(ready_windows([group], seen_now=100.5, now=None, config=CONFIG)) == list(range(1, 21))
    # Had rank 1 never come back, the burst's windows go once they waited a watermark here.
    assert attempts(ready_windows([group], seen_now=105.0, now=None, config=CONFIG)) == list(range(1, 95))


def test_a_quiet_run_releases_its_last_windows_on_the_periodic_pass() -> None:
    """A paused or finished run sends nothing newer: with the service's clock two watermarks
    past a window's newest record, it is judged without its missing rank."""
    group = incarnation(windows(range(1, 3), ranks=1))
    assert ready_windows([group], seen_now=20.0, now=None, config=CONFIG) == []  # no newer records
    assert ready_windows([group], seen_now=20.0, now=10.9, config=CONFIG) == []  # 9.9 s: under 10
    ready = ready_windows([group], seen_now=20.0, now=12.0, config=CONFIG)
    assert attempts(ready) == [1, 2]


def test_the_service_clock_guard_holds_on_the_periodic_pass_too() -> None:
    group = incarnation(windows(range(1, 3), ranks=1, first_seen=19.0))
    assert ready_windows([group], seen_now=20.0, now=60.0, config=CONFIG) == []


def test_the_watermark_is_the_one_the_incarnation_waits_by() -> None:
    waiting = windows(range(1, 6), ranks=1)
    short = incarnation(waiting, watermark_s=2.0)
    assert attempts(ready_windows([short], seen_now=2.0, now=None, config=CONFIG)) == [1, 2, 3]
    assert CONFIG.watermark_for(0.5) == 2.0  # two 0.5 s flushes and 1 s of slack
    assert CONFIG.watermark_for(None) == 5.0


def test_a_restart_releases_the_older_incarnations_windows_first() -> None:
    """The old incarnation's ranks send nothing more: all its windows are ready, missing ranks
    and all, and judged before the new one's."""
    old = incarnation(windows(range(8, 11), ranks=1), name="a")
    new = incarnation(windows(range(1, 3), ranks=2), name="b")
    ready = ready_windows([old, new], seen_now=0.0, now=None, config=CONFIG)
    assert [(w.incarnation, w.attempt, w.readiness) for w in ready] == [
        ("a", 8, Readiness.RESTARTED),
        ("a", 9, Readiness.RESTARTED),
        ("a", 10, Readiness.RESTARTED),
        ("b", 1, Readiness.COMPLETE),
        ("b", 2, Readiness.COMPLETE),
    ]
    assert {w.missing_ranks for w in ready[:3]} == {1}


def test_nothing_waiting_is_nothing_ready() -> None:
    assert ready_windows([], seen_now=0.0, now=None, config=CONFIG) == []


def test_the_declared_world_size_is_what_a_window_waits_for() -> None:
    assert expected_ranks(declared=4, guessed=2, prior=8, seen=3) == 4


def test_a_new_incarnation_before_its_run_start_waits_for_the_runs_declared_world() -> None:
    """After an in-process rollback any rank's records may come before rank 0's run start: the
    world is the run's newest declared size, not the one rank seen first."""
    world = expected_ranks(declared=None, guessed=None, prior=2, seen=1)
    assert world == 2
    group = incarnation(windows(range(1, 4), ranks=1), expected=world)
    assert ready_windows([group], seen_now=0.0, now=None, config=CONFIG) == []
    # Once guessed, the guess stands until declared, raised by more ranks seen in one window.
    assert expected_ranks(declared=None, guessed=2, prior=1, seen=1) == 2
    assert expected_ranks(declared=None, guessed=2, prior=1, seen=3) == 3
    assert expected_ranks(declared=None, guessed=None, prior=1, seen=1) == 1  # nothing declared yet


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("watermark_attempts", 0),
        ("watermark_s", -1.0),
        ("watermark_slack_s", -0.1),
        ("idle_watermarks", -1.0),
    ],
)
def test_a_bad_threshold_is_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match="ReadinessConfig"):
        ReadinessConfig(**{field: value})
