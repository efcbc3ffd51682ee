"""What the store holds: rows and bytes per table, and what retention drops next.

PostgreSQL: bytes are ``pg_total_relation_size`` (table, indexes and TOAST), summed over a
partitioned table's partitions; rows are the planner's estimate (``reltuples``, kept by
autovacuum and ANALYZE), counted exactly only for a table never analyzed yet. SQLite: rows are
counted, bytes are the pages ``dbstat`` gives each table and its indexes; an SQLite built
without ``dbstat`` gives only the whole file's size (page count times page size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import partitions
from monitor.store.models import PARTITIONED_TABLES, Base
from monitor.store.retention import HEARTBEATS, RetentionConfig, oldest_time


@dataclass(frozen=True)
class TableUsage:
    table: str
    rows: int
    rows_estimated: bool
    bytes: int | None
    partitions: int | None
    """Day partitions (PostgreSQL's partitioned tables), else ``None``."""


@dataclass(frozen=True)
class NextDrop:
    """What retention removes next from one table: a day partition (PostgreSQL) or the rows
    before a time (SQLite)."""

    table: str
    partition: str | None
    start: float | None
    end: float
    """Records with a time before this (and from ``start`` on, for a partition) go."""
    due_at: float
    """When they leave the retention period (``end`` plus the period): the first maintenance
    pass after it removes them."""
    rows: int
    bytes: int | None


@dataclass(frozen=True)
class Usage:
    backend: str
    retention_days: float
    tables: list[TableUsage]
    total_bytes: int | None
    next_drops: list[NextDrop]

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def usage(connection: Connection, config: RetentionConfig) -> Usage:
    if connection.dialect.name == "postgresql":
        tables = [_postgres_table(connection, name) for name in sorted(Base.metadata.tables)]
        total = int(connection.execute(sa.text("SELECT pg_database_size(current_database())")).scalar_one())
        if partitions.is_partitioned(connection):
            # A default partition's strays and heartbeats go row by row.
            one_by_one = [*(partitions.default_name(t) for t in PARTITIONED_TABLES), HEARTBEATS]
            drops = _postgres_next(connection, config)
        else:
            one_by_one, drops = [*PARTITIONED_TABLES, HEARTBEATS], []
        drops += _rows_next(connection, config, lambda name: _postgres_size(connection, [name]), one_by_one)
    else:
        pages = _sqlite_sizes(connection)
        tables = [
            TableUsage(name, _count(connection, name), False, pages.get(name) if pages else None, None)
            for name in sorted(Base.metadata.tables)
        ]
        page_size = connection.exec_driver_sql("PRAGMA page_size").scalar_one()
        total = int(connection.exec_driver_sql("PRAGMA page_count").scalar_one()) * int(page_size)
        sizes = {t.table: t.bytes for t in tables}
        drops = _rows_next(connection, config, sizes.get, [*PARTITIONED_TABLES, HEARTBEATS])
    if config.keeps_everything:
        drops = []
    return Usage(connection.dialect.name, config.raw_days, tables, total, drops)


def _count(connection: Connection, table: str) -> int:
    return int(connection.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


def _postgres_rows(connection: Connection, relation: str) -> tuple[int, bool]:
    """A relation's rows and whether that is the planner's estimate."""
    estimate = connection.execute(
        sa.text("SELECT reltuples FROM pg_class WHERE oid = to_regclass(:r)"), {"r": relation}
    ).scalar_one()
    if estimate < 0:  # never analyzed: a young table, cheap to count
        return _count(connection, relation), False
    return int(estimate), True


def _postgres_size(connection: Connection, relations: list[str]) -> int:
    size = connection.execute(
        sa.text("SELECT sum(pg_total_relation_size(to_regclass(r))) FROM unnest(CAST(:rs AS text[])) AS r"),
        {"rs": relations},
    ).scalar_one()
    return int(size or 0)


def _postgres_table(connection: Connection, table: str) -> TableUsage:
    parts = partitions.partitions(connection, table)
    relations = [p.name for p in parts] or [table]
    counted = [_postgres_rows(connection, relation) for relation in relations]
    days = len([p for p in parts if not p.is_default]) if parts else None
    return TableUsage(
        table,
        sum(rows for rows, _ in counted),
        any(estimated for _, estimated in counted),
        _postgres_size(connection, relations),
        days,
    )


def _postgres_next(connection: Connection, config: RetentionConfig) -> list[NextDrop]:
    """Each partitioned table's oldest day partition."""
    drops = []
    period = config.raw_days * partitions.DAY_S
    for table in PARTITIONED_TABLES:
        days = [p for p in partitions.partitions(connection, table) if not p.is_default]
        if not days:
            continue
        oldest = days[0]
        assert oldest.lower is not None and oldest.upper is not None
        rows, _ = _postgres_rows(connection, oldest.name)
        size = _postgres_size(connection, [oldest.name])
        drops.append(
            NextDrop(table, oldest.name, oldest.lower, oldest.upper, oldest.upper + period, rows, size)
        )
    return drops


def _rows_next(
    connection: Connection,
    config: RetentionConfig,
    size_of: Callable[[str], int | None],
    tables: list[str],
) -> list[NextDrop]:
    """Rows deleted one by one (SQLite; heartbeats everywhere): each table's oldest day of records, from its oldest
    record to the end of that UTC day; its bytes in proportion to its rows."""
    drops = []
    period = config.raw_days * partitions.DAY_S
    for table in tables:
        oldest = oldest_time(connection, table)
        if oldest is None:
            continue
        end = partitions.day_bounds(partitions.day_of(oldest))[1]
        rows = int(
            connection.execute(
                sa.text(f"SELECT count(*) FROM {table} WHERE time < :end"), {"end": end}
            ).scalar_one()
        )
        total_rows = _count(connection, table)
        size = size_of(table)
        share = None if size is None or not total_rows else round(size * rows / total_rows)
        drops.append(NextDrop(table, None, oldest, end, end + period, rows, share))
    return drops


def _sqlite_sizes(connection: Connection) -> dict[str, int] | None:
    """Bytes of each table with its indexes, from ``dbstat``; ``None`` where SQLite lacks it."""
    try:
        pages = connection.exec_driver_sql(
            "SELECT m.tbl_name, sum(s.pgsize) FROM dbstat s JOIN sqlite_master m ON m.name = s.name "
            "GROUP BY m.tbl_name"
        ).all()
    except sa.exc.OperationalError:  # no such table: dbstat
        return None
    return {name: int(size) for name, size in pages}
