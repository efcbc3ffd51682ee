"""Server-side prepared statements for the ingest path's fixed statements on PostgreSQL.

psycopg2 sends every statement as text, so PostgreSQL parses and plans it at every execution.
The statement that moves a small batch's step records in (``monitor.ingest.postgres_copy``) is
planned against every partition of its table: PostgreSQL's own statistics
(``pg_stat_statements``, one rank's post of two step records, 5 partitions) gave 1,349 us of
planning beside 775 us of executing it, most of the server's CPU for that post. Prepared once
per connection, a statement is parsed once, and after five executions PostgreSQL plans it once
for all parameters when that plan costs no more than a custom one (``plan_cache_mode = auto``).

A prepared statement lives as long as the database session: a ``ROLLBACK`` keeps it, and
PostgreSQL replans it by itself when a table it reads changes (a partition made or dropped).
Which statements a connection has prepared is kept in the pool's ``info`` of that connection,
which SQLAlchemy empties when it replaces the connection with a new session.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection, CursorResult
from sqlalchemy.util.typing import TupleAny, Unpack

_PREPARED = "runhealth_prepared"
"""The key, in a pooled connection's ``info``, of the names prepared in its session."""

_PLACEHOLDER = re.compile(r"%s")


@functools.cache
def _forms(statement: str) -> tuple[str, str, str]:
    """A statement's name, its ``PREPARE`` and its ``EXECUTE`` (with psycopg2's ``%s`` where
    the statement had them). ``statement`` holds no ``%`` but its placeholders."""
    name = "runhealth_" + hashlib.blake2b(statement.encode(), digest_size=8).hexdigest()
    numbers = iter(range(1, statement.count("%s") + 1))
    numbered = _PLACEHOLDER.sub(lambda _match: f"${next(numbers)}", statement)
    count = statement.count("%s")
    execute = f"EXECUTE {name}({', '.join(['%s'] * count)})" if count else f"EXECUTE {name}"
    return name, f"PREPARE {name} AS {numbered}", execute


def available(connection: Connection) -> bool:
    """Whether ``execute`` may be used: PostgreSQL through psycopg2 (its ``%s`` placeholders)."""
    return connection.dialect.name == "postgresql" and connection.dialect.driver == "psycopg2"


def execute(
    connection: Connection, statement: str, parameters: Sequence[Any] | None = None
) -> CursorResult[Unpack[TupleAny]]:
    """``connection.exec_driver_sql(statement, parameters)`` on PostgreSQL through psycopg2, as
    a statement prepared in this session (the first time, prepared here)."""
    name, prepare, run = _forms(statement)
    prepared: set[str] = connection.connection.info.setdefault(_PREPARED, set())
    if name not in prepared:
        connection.exec_driver_sql(prepare)
        prepared.add(name)
    return connection.exec_driver_sql(run, tuple(parameters) if parameters else None)
