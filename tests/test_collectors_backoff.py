"""The sender's retry delays: capped exponential backoff with full jitter, seeded per rank."""

from __future__ import annotations

import statistics

import pytest

from collectors.backoff import Backoff, rank_seed
from collectors.sender import SenderConfig


def test_each_delay_lies_within_its_doubling_interval_up_to_the_cap() -> None:
    backoff = Backoff(0.5, 10.0, seed=1)
    for failures in range(40):
        ceiling = min(10.0, 0.5 * 2**failures)
        assert backoff.ceiling_s() == ceiling
        assert 0.0 <= backoff.next_delay_s() <= ceiling
    assert backoff.failures == 40
    backoff.reset()
    assert (backoff.failures, backoff.ceiling_s()) == (0, 0.5)


def test_without_jitter_each_delay_is_the_bound_itself() -> None:
    backoff = Backoff(0.5, 10.0, jitter=False, seed=1)
    assert [backoff.next_delay_s() for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_a_long_outage_does_not_overflow_the_doubling() -> None:
    backoff = Backoff(0.5, 10.0, seed=3)
    for _ in range(5000):
        assert 0.0 <= backoff.next_delay_s() <= 10.0


def test_one_rank_draws_the_same_delays_every_time_and_ranks_draw_apart() -> None:
    seed = rank_seed("run-a", "inc-1", 7)
    assert seed == rank_seed("run-a", "inc-1", 7)
    first = [Backoff(0.5, 10.0, seed=seed).next_delay_s() for _ in range(3)]
    assert first == [Backoff(0.5, 10.0, seed=seed).next_delay_s() for _ in range(3)]
    seeds = {rank_seed("run-a", "inc-1", rank) for rank in range(16_384)}
    assert len(seeds) == 16_384
    # Two jobs' rank 0s, and a restarted job's, do not share their draws either.
    assert (
        len({rank_seed("run-a", "inc-1", 0), rank_seed("run-b", "inc-1", 0), rank_seed("run-a", "inc-2", 0)})
        == 3
    )


def test_ranks_that_failed_together_spread_over_the_whole_interval() -> None:
    """16,384 ranks' first retry after losing the service together: spread over [0, 0.5 s] as
    a uniform draw is (a quarter in each quarter), none on the same instant as another; the
    plain doubling puts every one on 0.5 s."""
    draws = [Backoff(0.5, 10.0, seed=rank_seed("run", "inc", rank)).next_delay_s() for rank in range(16_384)]
    assert 0.0 <= min(draws) < 0.001 and 0.499 < max(draws) <= 0.5
    quarters = [sum(1 for d in draws if q * 0.125 <= d < (q + 1) * 0.125) for q in range(4)]
    assert all(3_800 < count < 4_400 for count in quarters), quarters
    assert statistics.pstdev(draws) == pytest.approx(0.5 / 12**0.5, rel=0.05)
    plain = {Backoff(0.5, 10.0, jitter=False, seed=rank).next_delay_s() for rank in range(16_384)}
    assert plain == {0.5}


@pytest.mark.parametrize("field", ["retry_initial_s", "retry_max_s", "retry_after_max_s"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_the_sender_config_refuses_a_delay_that_is_not_positive(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SenderConfig(**{field: value})
