"""time partitions: step records, device and link samples partitioned by day on PostgreSQL

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 17:00:00.000000

On PostgreSQL each of ``step_records``, ``device_samples`` and ``link_samples`` becomes a table
partitioned by range on the record's own ``time`` (one partition per UTC day, a default
partition for what no day covers; ``monitor.store.partitions``), so retention drops a day of raw
records as one table instead of deleting rows. Each table is converted with its rows: a
partitioned table is made beside it, a partition for each day its rows have (and today and the
next days), the rows are copied, the old table dropped and the new one takes its name, its
id sequence and its constraints' names. The copy needs the table's size again on disk for the
duration, and the tables are locked for it.

Conflict detection: a unique key of a partitioned table must hold the partition column, so on
PostgreSQL the keys become (run, incarnation, rank, attempt, time) for step records and (run,
node, device, seq, time) / (run, node, device, port, seq, time) for samples. A record re-sent
carries its first copy's time (the hook renders a record once; the spool replays it as
written), so it is still found by ``ON CONFLICT`` and is a duplicate, and the same key and time
with other content is still a conflict (409). The same key with another *time* is, on
PostgreSQL, stored as a second row instead of being refused; SQLite keeps the key without time
and refuses it. Downgrading fails while such twins are stored.

SQLite is left as it is: this revision changes nothing there.
"""

from collections.abc import Sequence
from datetime import timedelta

import sqlalchemy as sa
from alembic import op

from monitor.store import partitions

# revision identifiers, used by Alembic.
revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

AHEAD_DAYS = 3  # as RetentionConfig.partitions_ahead_days; the service's job keeps its own

KEYS = {
    "step_records": ("run_id", "incarnation", "rank", "attempt"),
    "device_samples": ("run_id", "node", "device_uuid", "seq"),
    "link_samples": ("run_id", "node", "device", "port", "seq"),
}
INDEXES = {"step_records": {"ix_step_records_window": ("run_id", "incarnation", "attempt")}}


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, key in KEYS.items():
        _rebuild(table, partitioned=True, key=(*key, "time"))


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, key in KEYS.items():
        _rebuild(table, partitioned=False, key=key)


def _rebuild(table: str, *, partitioned: bool, key: tuple[str, ...]) -> None:
    connection = op.get_bind()
    new = f"{table}_rebuilt"
    sequence = connection.execute(sa.text("SELECT pg_get_serial_sequence(:t, 'id')"), {"t": table}).scalar()
    # Free the sequence from the old table, so dropping the table keeps it (ids go on from it).
    connection.exec_driver_sql(f"ALTER SEQUENCE {sequence} OWNED BY NONE")
    connection.exec_driver_sql(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
    scheme = " PARTITION BY RANGE (time)" if partitioned else ""
    connection.exec_driver_sql(f"CREATE TABLE {new} (LIKE {table} INCLUDING DEFAULTS){scheme}")
    if partitioned:
        _create_partitions(connection, table, new)
    connection.exec_driver_sql(f"INSERT INTO {new} SELECT * FROM {table}")
    connection.exec_driver_sql(f"DROP TABLE {table} CASCADE")
    connection.exec_driver_sql(f"ALTER TABLE {new} RENAME TO {table}")
    connection.exec_driver_sql(f"ALTER SEQUENCE {sequence} OWNED BY {table}.id")
    primary = "id, time" if partitioned else "id"
    connection.exec_driver_sql(f"ALTER TABLE {table} ADD CONSTRAINT pk_{table} PRIMARY KEY ({primary})")
    connection.exec_driver_sql(
        f"ALTER TABLE {table} ADD CONSTRAINT uq_{table}_{'_'.join(key)} UNIQUE ({', '.join(key)})"
    )
    connection.exec_driver_sql(
        f"ALTER TABLE {table} ADD CONSTRAINT fk_{table}_run_id_runs FOREIGN KEY (run_id) "
        "REFERENCES runs (id) ON DELETE CASCADE"
    )
    for name, columns in INDEXES.get(table, {}).items():
        connection.exec_driver_sql(f"CREATE INDEX {name} ON {table} ({', '.join(columns)})")


def _create_partitions(connection: sa.Connection, table: str, new: str) -> None:
    """The default partition, one for each day the table's rows have, and today's and the
    next ``AHEAD_DAYS``'. Partitions are named for the table (``step_records_p20261203``)
    while it is still built under another name."""
    connection.exec_driver_sql(f"CREATE TABLE {partitions.default_name(table)} PARTITION OF {new} DEFAULT")
    lowest, highest = (
        partitions.day_bounds(day)[0] for day in (partitions.EARLIEST_DAY, partitions.LATEST_DAY)
    )
    days = connection.execute(
        sa.text(
            f"SELECT DISTINCT floor(time / {partitions.DAY_S}) FROM {table} "
            "WHERE time >= :lowest AND time < :highest"
        ),
        {"lowest": lowest, "highest": highest},
    ).scalars()
    found = {partitions.day_of(float(day) * partitions.DAY_S) for day in days}
    now = connection.execute(sa.text("SELECT extract(epoch FROM now())")).scalar_one()
    today = partitions.day_of(float(now))
    found.update(today + timedelta(days=offset) for offset in range(AHEAD_DAYS + 1))
    for day in sorted(found):
        lower, upper = partitions.day_bounds(day)
        connection.exec_driver_sql(
            f"CREATE TABLE {partitions.partition_name(table, day)} PARTITION OF {new} "
            f"FOR VALUES FROM ({lower!r}) TO ({upper!r})"
        )
