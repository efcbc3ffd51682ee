"""Leases of runs between replicas: session advisory locks on the real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from monitor.store.leases import LeaseChanges, RunLeases, holders
from tests.support import PostgresServer


@pytest.fixture
def database(postgres_server: PostgresServer) -> URL:
    return postgres_server.create_database()


@pytest.fixture
def make(database: URL) -> Iterator[type[RunLeases]]:
    made: list[RunLeases] = []

    class Tracked(RunLeases):
        def __init__(self, url: URL, replica: str, dead_peer_s: float = 8.0) -> None:
            super().__init__(url, replica, dead_peer_s)
            made.append(self)

    yield Tracked
    for leases in made:
        leases.close()


def who(database: URL) -> dict[int, str]:
    engine = sa.create_engine(database)
    try:
        with engine.connect() as connection:
            return holders(connection)
    finally:
        engine.dispose()


def test_one_replica_holds_a_run_and_the_other_takes_it_when_it_is_gone(
    database: URL, make: type[RunLeases]
) -> None:
    first, second = make(database, "first"), make(database, "second")
    assert first.refresh([7]) == LeaseChanges(gained=(7,))
    assert second.refresh([7]) == LeaseChanges()
    assert first.holds(7) and not second.holds(7)
    assert who(database) == {7: "first"}
    first.close()
    assert who(database) == {}
    assert second.refresh([7]) == LeaseChanges(gained=(7,))
    assert who(database) == {7: "second"}


def test_runs_are_shared_out_and_a_replica_that_joins_gets_its_share(
    database: URL, make: type[RunLeases]
) -> None:
    first = make(database, "first")
    runs = [1, 2, 3, 4, 5]
    assert first.refresh(runs).gained == (1, 2, 3, 4, 5)  # alone: all of them
    second = make(database, "second")
    assert second.refresh(runs) == LeaseChanges()  # all held; its share is 3 from now on
    assert first.refresh(runs) == LeaseChanges(lost=(4, 5))  # gives back beyond its 3
    assert second.refresh(runs).gained == (4, 5)
    assert first.refresh(runs) == LeaseChanges() and second.refresh(runs) == LeaseChanges()
    held = who(database)
    assert sorted(held) == runs and sorted(held.values()) == ["first"] * 3 + ["second"] * 2


def test_a_replica_whose_session_ends_stops_judging_every_run_it_held(
    database: URL, make: type[RunLeases]
) -> None:
    first, second = make(database, "first"), make(database, "second")
    first.refresh([1, 2])
    engine = sa.create_engine(database, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            ended = connection.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = 'runhealth-judge first'"
                )
            ).scalars()
            assert list(ended) == [True]
    finally:
        engine.dispose()
    # Its runs are free for the other at once (the session is gone, and is no longer counted).
    assert second.refresh([1, 2]).gained == (1, 2)
    assert first.refresh([1, 2]) == LeaseChanges(lost=(1, 2))  # found at its next look
    assert first.held() == frozenset()
    # The failed session is replaced at the look after, and the runs shared out again.
    assert first.refresh([1, 2]) == LeaseChanges()
    assert second.refresh([1, 2]) == LeaseChanges(lost=(2,))
    assert first.refresh([1, 2]).gained == (2,)
    assert who(database) == {1: "second", 2: "first"}
