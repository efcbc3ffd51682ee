"""Retention of raw per-rank records: step records, device and link samples, heartbeats.

What the judge and the operator read later is kept: per-window summaries, findings,
incidents, checkpoints, proposals and decisions, and the audit log. Raw records are read only
near their time: a window's records while it is judged (a restarted service rebuilds a run's
state from its summaries), the records of an incident's steps while its proposal and replay
are made, the previous device sample. On PostgreSQL a day of raw records is one partition
(``monitor.store.partitions``) and is dropped whole; a heartbeat, the default partitions'
strays and SQLite's rows are deleted in bounded batches, so no transaction holds the store
for long.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from monitor.errors import ConfigError
from monitor.store import partitions
from monitor.store.models import PARTITION_COLUMN, PARTITIONED_TABLES

log = logging.getLogger("runhealth.retention")

HEARTBEATS = "heartbeats"


@dataclass(frozen=True)
class RetentionConfig:
    """How long raw per-rank records are kept, and how the store is held to it.

    - ``raw_days`` 14: issue 18's default: a two-week window covers the incidents an operator
      still replays or investigates from raw records (a proposal and its replay are made within
      hours of the incident); what outlives it is summarised per window and kept.
      ``0`` keeps raw records for ever.
    - ``partitions_ahead_days`` 3 (PostgreSQL): today's partition and the next three days' exist
      at any time, so a service down over a weekend, or a trainer's clock a day ahead, still
      finds its partition.
    - ``check_s`` 3600: the maintenance job's period; a day partition is dropped within an hour
      of leaving the period, and the next days' partitions are made days before they are needed.
    - ``batch_rows`` 5000: rows deleted per transaction where rows are deleted (SQLite, the
      default partitions, heartbeats); SQLite's one writer is held for one batch at a time.
    - ``lock_timeout_s`` 5 (PostgreSQL): how long dropping a partition waits for its table's
      lock; past it the drop is left to the next run, so ingest never queues behind it.
    """

    raw_days: float = 14.0
    partitions_ahead_days: int = 3
    check_s: float = 3600.0
    batch_rows: int = 5000
    lock_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.raw_days < 0 or self.partitions_ahead_days < 0:
            raise ConfigError("RetentionConfig: raw_days and partitions_ahead_days must be >= 0")
        if self.check_s <= 0 or self.batch_rows < 1 or self.lock_timeout_s <= 0:
            raise ConfigError("RetentionConfig: check_s and lock_timeout_s > 0, batch_rows >= 1")

    @property
    def keeps_everything(self) -> bool:
        return self.raw_days == 0

    def cutoff(self, now: float) -> float:
        """Raw records whose time is before this are dropped."""
        return now - self.raw_days * partitions.DAY_S


@dataclass
class Pass:
    """What one maintenance pass did."""

    created: list[str] = field(default_factory=list)
    dropped: list[partitions.Partition] = field(default_factory=list)
    deleted: dict[str, int] = field(default_factory=dict)
    """Rows deleted one by one, by table."""
    deferred: list[str] = field(default_factory=list)
    """Partitions whose drop waited past ``lock_timeout_s``: the next pass drops them."""


def create_ahead(engine: Engine, config: RetentionConfig, now: float) -> list[str]:
    """Today's and the next days' partitions where the store is partitioned; those created."""
    with engine.begin() as connection:
        if not partitions.is_partitioned(connection):
            return []
        return partitions.ensure_ahead(connection, now, config.partitions_ahead_days)


def maintain(engine: Engine, config: RetentionConfig, now: float) -> Pass:
    """Create the partitions ahead (PostgreSQL), then drop what is past the period."""
    done = Pass(created=create_ahead(engine, config, now))
    with engine.connect() as connection:
        partitioned = partitions.is_partitioned(connection)
    if config.keeps_everything:
        return done
    cutoff = config.cutoff(now)
    if partitioned:
        _drop_partitions(engine, config, cutoff, done)
        tables = [partitions.default_name(table) for table in PARTITIONED_TABLES]
    else:
        tables = list(PARTITIONED_TABLES)
    for table in [*tables, HEARTBEATS]:
        deleted = delete_before(engine, table, cutoff, config.batch_rows)
        if deleted:
            done.deleted[table] = deleted
    if done.dropped or done.deleted:
        log.info(
            "retention: dropped %s, deleted %s (records before %.0f)",
            [p.name for p in done.dropped],
            done.deleted,
            cutoff,
        )
    return done


def _drop_partitions(engine: Engine, config: RetentionConfig, cutoff: float, done: Pass) -> None:
    with engine.connect() as connection:
        due = partitions.expired(connection, cutoff)
    for partition in due:
        try:
            with engine.begin() as connection:
                connection.exec_driver_sql(
                    f"SET LOCAL lock_timeout = '{int(config.lock_timeout_s * 1000)}ms'"
                )
                partitions.drop(connection, partition)
        except sa.exc.OperationalError as exc:  # lock_timeout: a long transaction holds the table
            log.warning("retention: %s not dropped yet (%s); the next pass retries", partition.name, exc.orig)
            done.deferred.append(partition.name)
            continue
        done.dropped.append(partition)


def delete_before(engine: Engine, table: str, cutoff: float, batch_rows: int) -> int:
    """Delete ``table``'s rows whose time is before ``cutoff``, ``batch_rows`` per transaction."""
    with engine.connect() as connection:
        postgres = connection.dialect.name == "postgresql"
    total = 0
    if postgres:
        # By physical row id: a default partition has no index on time, and each batch is one
        # scan that stops at ``batch_rows`` matches.
        statement = sa.text(
            f"DELETE FROM {table} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {table} "
            f"WHERE {PARTITION_COLUMN} < :cutoff LIMIT :n))"
        )
        while True:
            with engine.begin() as connection:
                deleted = connection.execute(statement, {"cutoff": cutoff, "n": batch_rows}).rowcount
            total += deleted
            if deleted < batch_rows:
                return total
    # SQLite: no index on time (one would cost every insert), so walk the table by id in
    # ranges of ``batch_rows``: each transaction reads and deletes at most that many rows.
    with engine.connect() as connection:
        lowest, highest = connection.execute(sa.text(f"SELECT min(id), max(id) FROM {table}")).one()
    if lowest is None:
        return 0
    statement = sa.text(
        f"DELETE FROM {table} WHERE id >= :start AND id < :stop AND {PARTITION_COLUMN} < :cutoff"
    )
    for start in range(lowest, highest + 1, batch_rows):
        with engine.begin() as connection:
            total += connection.execute(
                statement, {"start": start, "stop": start + batch_rows, "cutoff": cutoff}
            ).rowcount
    return total


def oldest_time(connection: Connection, table: str) -> float | None:
    value = connection.execute(sa.text(f"SELECT min({PARTITION_COLUMN}) FROM {table}")).scalar()
    return None if value is None else float(value)
