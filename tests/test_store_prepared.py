"""Prepared statements on PostgreSQL (``monitor.store.prepared``): prepared once per database
session, kept across transactions (a rolled-back one included), prepared again in a new session."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.store import prepared
from monitor.store.db import create_store_engine
from tests.support import PostgresServer

STATEMENT = "SELECT sum(v) FROM unnest(%s::integer[]) AS u(v) WHERE v > %s"


@pytest.fixture
def engine(postgres_server: PostgresServer) -> Iterator[Engine]:
    made = create_store_engine(postgres_server.create_database())
    try:
        yield made
    finally:
        made.dispose()


def counted(engine: Engine) -> Counter[str]:
    """The statements sent, by their first word."""
    seen: Counter[str] = Counter()

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _count(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        seen[statement.split()[0]] += 1

    return seen


def total(engine: Engine, values: list[int], above: int) -> int:
    with engine.begin() as connection:
        return int(prepared.execute(connection, STATEMENT, (values, above)).scalar_one())


def test_a_statement_is_prepared_once_per_session(engine: Engine) -> None:
    seen = counted(engine)
    assert [total(engine, [1, 2, 3], above) for above in (0, 1, 2)] == [6, 5, 3]
    assert seen == {"PREPARE": 1, "EXECUTE": 3}


def test_a_rolled_back_transaction_keeps_the_statement(engine: Engine) -> None:
    seen = counted(engine)
    with engine.connect() as connection:
        assert prepared.execute(connection, STATEMENT, ([4, 5], 4)).scalar_one() == 5
        connection.rollback()
        with pytest.raises(sa.exc.DBAPIError):  # the transaction fails after the PREPARE
            prepared.execute(connection, STATEMENT, (["not a number"], 0))
        connection.rollback()
        assert prepared.execute(connection, STATEMENT, ([4, 5], 0)).scalar_one() == 9
    assert seen["PREPARE"] == 1


def test_a_new_session_prepares_it_again(engine: Engine) -> None:
    seen = counted(engine)
    with engine.connect() as connection:
        assert prepared.execute(connection, STATEMENT, ([7], 0)).scalar_one() == 7
        connection.invalidate()  # the pool replaces the session: what it prepared is gone
    assert total(engine, [7, 8], 7) == 8
    assert seen["PREPARE"] == 2


def test_a_statement_without_parameters(engine: Engine) -> None:
    with engine.begin() as connection:
        assert prepared.execute(connection, "SELECT 41 + 1").scalar_one() == 42
