"""The exact loss history a replay is compared with (``policies/timelines.py``)."""

from __future__ import annotations

from policies.timelines import CHUNK, Timelines


def logged(
    history: Timelines, first: int, last: int, offset: float = 0.0, capacity: int = 10_000
) -> Timelines:
    for step in range(first, last + 1):
        history = history.push(step, step + offset, capacity)
    return history


def test_a_replay_reads_the_timeline_that_went_through_its_step_across_chunks() -> None:
    history = logged(Timelines(), 1, 3 * CHUNK)
    steps = list(range(CHUNK - 2, CHUNK + 3))  # across the first chunk's end
    history = history.begin(CHUNK - 2)
    assert history.reference(CHUNK - 2, steps) == tuple(float(s) for s in steps)
    # Steps the timeline did not log: nothing to compare with.
    assert history.reference(CHUNK - 2, [*steps[:-1], 5 * CHUNK]) is None


def test_a_push_keeps_at_least_capacity_rows_and_drops_whole_chunks() -> None:
    capacity = CHUNK + 10
    history = logged(Timelines(), 1, 4 * CHUNK, capacity=capacity)
    kept = 4 * CHUNK - history.dropped
    assert capacity <= kept < capacity + CHUNK
    assert history.dropped % CHUNK == 0
    last = 4 * CHUNK
    history = history.begin(last - 5)
    assert history.reference(last - 5, range(last - 5, last)) == tuple(
        float(s) for s in range(last - 5, last)
    )
    assert history.reference(5, range(5, 10)) is None  # dropped


def test_timelines_whose_rows_are_all_dropped_are_forgotten() -> None:
    history = logged(Timelines(), 1, 100, capacity=CHUNK)
    history = logged(history.begin(50), 50, 2 * CHUNK + 50, offset=1.0, capacity=CHUNK)
    assert len(history.timelines) == 1
    assert history.timelines[0].first_step == 50


def test_the_newest_timeline_through_the_step_is_the_reference() -> None:
    """Logged 1-600, resumed at 400 (values 1 up) to 500: a restart at 450 reads the second,
    one at 300 the first (the second began after it), one at 400 the first too (the second
    began at 400: another resume of the same checkpoint)."""
    history = logged(Timelines(), 1, 600)
    history = logged(history.begin(400), 400, 500, offset=1.0).begin(0)
    assert history.reference(450, [450, 451]) == (451.0, 452.0)
    assert history.reference(300, [300, 301]) == (300.0, 301.0)
    assert history.reference(400, [400, 401]) == (400.0, 401.0)


def test_a_cut_ends_the_reference_and_the_earliest_cut_stays() -> None:
    history = logged(Timelines(), 1, 600).cut(420).cut(450).begin(0)
    assert history.reference(410, range(410, 415)) == tuple(float(s) for s in range(410, 415))
    assert history.reference(418, range(418, 423)) is None
    assert logged(Timelines(), 1, 600).cut(450).cut(420).begin(0).reference(418, range(418, 423)) is None
    assert logged(Timelines(), 1, 600).cut(420).uncut().begin(0).reference(418, [418, 430]) == (418.0, 430.0)


def test_a_push_leaves_the_state_it_came_from_unchanged() -> None:
    before = logged(Timelines(), 1, CHUNK - 1)
    after = before.push(CHUNK, 1.0, 10_000)
    assert before.end == CHUNK - 1 and after.end == CHUNK
    assert before.begin(3).reference(3, [CHUNK - 1]) == (float(CHUNK - 1),)
