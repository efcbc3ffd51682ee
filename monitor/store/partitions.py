"""Daily time partitions of the raw per-rank tables on PostgreSQL.

Step records, device samples and link samples (``models.PARTITIONED_TABLES``) are partitioned
by range on the record's own ``time``, one partition per UTC day (``step_records_p20261203``):
a record re-sent carries the time of its first copy, so it lands in the same partition and
``ON CONFLICT`` sees the copy. A ``DEFAULT`` partition (``step_records_default``) takes a record
no day partition covers (a trainer whose clock is days off, a late record of a day retention
already dropped), so ingest never fails on a record's time. Day partitions are created ahead
by the service (``ensure_ahead``, a scheduled job) and at migration time; retention drops
them whole (``drop``). SQLite keeps one table per kind.

Heartbeats are not partitioned: their table holds one row per rank of each incarnation, updated
in place by the newest heartbeat (``ON CONFLICT (run, incarnation, rank) DO UPDATE``). A unique
key holding a time would make every heartbeat a new row, so the table would grow with time
instead of with ranks; retention deletes the rows of ranks silent for the period instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store.models import PARTITION_COLUMN, PARTITIONED_TABLES

DAY_S = 86_400.0
# One key for pg_advisory_xact_lock: replicas that maintain partitions at once take turns
# (two CREATE TABLEs of one partition would make one of them fail).
MAINTENANCE_LOCK = 0x72686D61  # "rhma"
# Days outside these bounds (a clock at 0 or in year 5000) are left to the default partition
# rather than given a partition each.
EARLIEST_DAY = date(2000, 1, 1)
LATEST_DAY = date(2100, 1, 1)

_PARTITION_NAME = re.compile(rf"^({'|'.join(PARTITIONED_TABLES)})_(p\d{{8}}|default)$")
_BOUND = re.compile(r"FROM \('?([-0-9.e+]+)'?\) TO \('?([-0-9.e+]+)'?\)")


@dataclass(frozen=True)
class Partition:
    """One partition of a partitioned table; a default partition has no bounds."""

    table: str
    name: str
    lower: float | None
    upper: float | None

    @property
    def is_default(self) -> bool:
        return self.lower is None


def is_partition(name: str) -> bool:
    """A partition's table name (the schema comparison leaves partitions out)."""
    return _PARTITION_NAME.match(name) is not None


def day_of(seconds: float) -> date:
    return datetime.fromtimestamp(seconds, UTC).date()


def day_bounds(day: date) -> tuple[float, float]:
    start = datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()
    return start, start + DAY_S


def partition_name(table: str, day: date) -> str:
    return f"{table}_p{day:%Y%m%d}"


def default_name(table: str) -> str:
    return f"{table}_default"


def is_partitioned(connection: Connection, table: str = PARTITIONED_TABLES[0]) -> bool:
    """Whether ``table`` is a partitioned table here (PostgreSQL at revision 0011 or later)."""
    if connection.dialect.name != "postgresql":
        return False
    kind = connection.execute(
        sa.text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:table)"), {"table": table}
    ).scalar()
    return kind == "p"


def partitions(connection: Connection, table: str) -> list[Partition]:
    """The partitions of ``table``, the default first, then days oldest first."""
    rows = connection.execute(
        sa.text(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(:table)"
        ),
        {"table": table},
    ).all()
    found = []
    for name, bound in rows:
        match = _BOUND.search(bound)
        if match is None:
            found.append(Partition(table, name, None, None))
        else:
            found.append(Partition(table, name, float(match.group(1)), float(match.group(2))))
    return sorted(found, key=lambda p: (p.lower is not None, p.lower or 0.0))


def create_default(connection: Connection, table: str) -> None:
    connection.exec_driver_sql(
        f"CREATE TABLE IF NOT EXISTS {default_name(table)} PARTITION OF {table} DEFAULT"
    )


def create_day(connection: Connection, table: str, day: date) -> bool:
    """The partition of ``day``, unless it exists; whether it was created. Rows of that day
    the default partition holds move into it (PostgreSQL refuses a partition whose range the
    default partition already has rows of)."""
    name = partition_name(table, day)
    exists = connection.execute(sa.text("SELECT to_regclass(:name)"), {"name": name}).scalar()
    if exists is not None:
        return False
    lower, upper = day_bounds(day)
    default = default_name(table)
    column = PARTITION_COLUMN
    stray = connection.execute(
        sa.text(f"SELECT EXISTS (SELECT FROM {default} WHERE {column} >= :lower AND {column} < :upper)"),
        {"lower": lower, "upper": upper},
    ).scalar()
    if not stray:
        connection.exec_driver_sql(
            f"CREATE TABLE {name} PARTITION OF {table} FOR VALUES FROM ({lower!r}) TO ({upper!r})"
        )
        return True
    connection.exec_driver_sql(f"CREATE TABLE {name} (LIKE {table} INCLUDING DEFAULTS)")
    connection.execute(
        sa.text(
            f"WITH moved AS (DELETE FROM {default} WHERE {column} >= :lower AND {column} < :upper "
            f"RETURNING *) INSERT INTO {name} SELECT * FROM moved"
        ),
        {"lower": lower, "upper": upper},
    )
    connection.exec_driver_sql(
        f"ALTER TABLE {table} ATTACH PARTITION {name} FOR VALUES FROM ({lower!r}) TO ({upper!r})"
    )
    return True


def ensure_ahead(connection: Connection, now: float, ahead_days: int) -> list[str]:
    """Today's partition and the next ``ahead_days`` days' of every partitioned table; the
    names of those created."""
    connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": MAINTENANCE_LOCK})
    today = day_of(now)
    created = []
    for table in PARTITIONED_TABLES:
        for offset in range(ahead_days + 1):
            day = today + timedelta(days=offset)
            if create_day(connection, table, day):
                created.append(partition_name(table, day))
    return created


def expired(connection: Connection, cutoff: float) -> list[Partition]:
    """Day partitions whose whole range is before ``cutoff``, oldest first."""
    return [
        partition
        for table in PARTITIONED_TABLES
        for partition in partitions(connection, table)
        if partition.upper is not None and partition.upper <= cutoff
    ]


def drop(connection: Connection, partition: Partition) -> None:
    """Drop one partition. It takes an exclusive lock on its parent for a moment: inserts wait
    for it, and it waits for the transactions that use the table (``lock_timeout`` bounds how
    long, so a long reader delays the drop instead of ingest queueing behind it)."""
    # IF EXISTS: another replica's pass may have dropped it first.
    connection.exec_driver_sql(f"DROP TABLE IF EXISTS {partition.name}")
