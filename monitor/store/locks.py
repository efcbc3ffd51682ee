"""PostgreSQL advisory locks that keep several service replicas from racing each other.

One process serving SQLite needs none of them (``monitor.store.exclusive`` keeps it one process,
and SQLite has one writer anyway); on PostgreSQL two replicas can write one run's records, and
one audit chain, at the same moment. Each lock is a two-key advisory lock: the first key names
what is locked (one namespace per purpose, so they never collide with each other or with another
application's locks), the second the run. The transaction-scoped ones are released at commit.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

# The namespaces (the first key): "RH" and a purpose number, inside PostgreSQL's int4.
RUN_WRITES = 0x5248_0001
"""Writing one run's records and folding them into its window summaries."""
AUDIT_APPENDS = 0x5248_0002
"""Appending to the audit chain (key 0: there is one chain)."""
RUN_JUDGE = 0x5248_0003
"""Judging one run: a session lock, held by the replica that judges it (``monitor.store.leases``)."""
RUN_INCIDENTS = 0x5248_0004
"""Attaching one run's findings to its incidents."""


# Built once: a ``text()`` made per call is parsed for its parameters again each time (the
# run-writes lock is taken by every batch).
_XACT_LOCK = sa.text("SELECT pg_advisory_xact_lock(:space, :run)")


def is_postgres(connection: Connection) -> bool:
    return connection.dialect.name == "postgresql"


def lock_run_writes(connection: Connection, run_id: int) -> None:
    """Until the transaction ends, no other replica writes this run's records.

    Two replicas folding records of one new window would both insert its summary row (a row
    lock cannot be taken on a row not there yet); and a judge reading "the rows newer than the
    last it saw" by id needs one run's ids committed in order, which holds only when one
    transaction at a time allocates them."""
    if is_postgres(connection):
        connection.execute(_XACT_LOCK, {"space": RUN_WRITES, "run": run_id})


def lock_audit_appends(connection: Connection) -> None:
    """Until the transaction ends, this one is the audit chain's only writer: the tail it reads
    stays the tail (without it, writers that read the same tail retry on the unique
    ``prev_hash``; with many replicas that retrying is most of the work)."""
    if is_postgres(connection):
        connection.execute(sa.text("SELECT pg_advisory_xact_lock(:space, 0)"), {"space": AUDIT_APPENDS})


def lock_run_incidents(connection: Connection, run_id: int) -> None:
    """Until the transaction ends, no other replica attaches findings to this run's incidents.

    One replica judges a run, but two can for a moment (one whose lease session failed, before
    its next look): a finding recorded under this lock sees the incident the other one opened,
    committed, and joins it instead of opening a second."""
    if is_postgres(connection):
        connection.execute(_XACT_LOCK, {"space": RUN_INCIDENTS, "run": run_id})
