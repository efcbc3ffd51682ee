"""Writing a batch's rows on PostgreSQL by ``COPY`` through a staging table.

A multi-row ``INSERT`` costs the service over a hundred microseconds a row in SQLAlchemy's and
the driver's parameter handling; ``COPY`` takes one stream in PostgreSQL's binary format that
one generated function per table writes (binary: a double is packed, not printed, and text
needs no escaping). The rows go into a temporary table of the session (created once with the
models' column types, emptied at each commit), and move to their table with ``INSERT ... SELECT ... ON CONFLICT DO NOTHING``
in the batch's own transaction, so a refused batch still leaves nothing behind. The
statement answers which staged rows did not go in; their stored content hashes are read
back so the caller tells a re-sent record from a conflicting one exactly as on SQLite.

The conflict target is the table's unique constraint as the models declare it: on a table
partitioned by time that constraint (and so the arbiter index) includes the partition key, so
the same statement also answers the staged rows whose key is stored at another time (a record
re-sent with another time, which SQLite's key refuses as a conflict).
"""

from __future__ import annotations

import functools
import io
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from monitor.store import models
from policies.protocol import to_wire

ORDINAL = "batch_ord"
"""The staging table's extra column: a row's position in the list the caller passed."""


def available(connection: Connection) -> bool:
    """``COPY`` needs psycopg2's ``copy_expert``; another driver takes the INSERT path."""
    return connection.dialect.name == "postgresql" and connection.dialect.driver == "psycopg2"


@dataclass(frozen=True)
class Stage:
    """A table's staging table: how to make it ready, fill it, and write a row's line."""

    name: str
    columns: tuple[str, ...]
    prepare: str
    copy: str
    row: Callable[[dict[str, Any], int], bytes]

    def data(self, rows: Sequence[dict[str, Any]]) -> bytes:
        """The rows in COPY's binary format, each with its position first."""
        tuples = [self.row(row, position) for position, row in enumerate(rows)]
        return b"".join((_HEADER, *tuples, _TRAILER))


def insert_new(
    connection: Connection, table: sa.Table, rows: Sequence[dict[str, Any]]
) -> dict[int, str | None]:
    """Insert the rows whose unique key is not stored yet. Returns, for each row that was not
    inserted (by its position in ``rows``), the content hash stored under its key (``None`` if
    that row went away meanwhile), and for each row whose key without its time is stored at
    another time (a time-partitioned table, ``models.partition_free_key``), that row's hash;
    empty when all went in and none was stored at another time."""
    if not rows:
        return {}
    _staged(connection, _stage_of(table), rows)
    move, stored = _keyed_statements(table)
    answered = connection.exec_driver_sql(move).all()
    if not answered:
        return {}
    missing = [position for position, other_time_hash in answered if other_time_hash is None]
    found = (
        {p: stored_hash for p, stored_hash in connection.exec_driver_sql(stored, (missing,))}
        if missing
        else {}
    )
    # A key stored at another time is answered as that record: its content differs (the time
    # is content), so the caller refuses it as SQLite's unique key on the key alone would.
    elsewhere = {position: other for position, other in answered if other is not None}
    return {position: found.get(position) for position in missing} | elsewhere


def upsert_newer(
    connection: Connection, table: sa.Table, rows: Sequence[dict[str, Any]], update: Sequence[str], newer: str
) -> None:
    """Insert each row, or update its stored row's ``update`` columns when the row's ``newer``
    column is greater than the stored one (a heartbeat: the newest wins)."""
    if not rows:
        return
    _staged(connection, _stage_of(table), rows)
    connection.exec_driver_sql(_upsert_statement(table, tuple(update), newer))


def unique_key(table: sa.Table) -> tuple[str, ...]:
    """The columns of ``table``'s unique constraint on PostgreSQL: the ``ON CONFLICT`` target
    (on the time-partitioned tables it holds the partition key, ``models.raw_record_keys``)."""
    return models.unique_key(table, "postgresql")


def _staged(connection: Connection, stage: Stage, rows: Sequence[dict[str, Any]]) -> None:
    """Empty the staging table (made first if this session has none) and copy ``rows`` in."""
    connection.exec_driver_sql(stage.prepare)
    data = stage.data(rows)
    dbapi = connection.dialect.loaded_dbapi
    cursor = connection.connection.cursor()
    try:
        cursor.copy_expert(stage.copy, io.BytesIO(data))
    except dbapi.Error as exc:  # raised as SQLAlchemy raises a driver's error on its statements
        raise sa.exc.DBAPIError.instance(stage.copy, None, exc, dbapi.Error) from exc
    finally:
        cursor.close()


@functools.cache
def _stage_of(table: sa.Table) -> Stage:
    columns = tuple(column.name for column in table.columns if column.name != "id")
    names = ", ".join(columns)
    stage = f"runhealth_stage_{table.name}"
    # The models' types, not the table's: the binary format is read as exactly these, and
    # the move to the table casts where a migration made a column wider.
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    typed = ", ".join(f"{name} {table.c[name].type.compile(dialect)}" for name in columns)
    # Emptied at each commit, and here too: a second batch in one transaction must not see
    # the first one's rows. One round trip for both statements.
    prepare = (
        f"CREATE TEMPORARY TABLE IF NOT EXISTS {stage} ({ORDINAL} INTEGER, {typed}) "
        f"ON COMMIT DELETE ROWS; TRUNCATE {stage}"
    )
    copy = f"COPY {stage} ({ORDINAL}, {names}) FROM STDIN WITH (FORMAT binary)"
    return Stage(stage, columns, prepare, copy, _row_writer(table, columns))


@functools.cache
def _keyed_statements(table: sa.Table) -> tuple[str, str]:
    """The move (staged rows into the table; answers the positions not inserted) and the read
    of the stored hashes of those positions, matched on the conflict target."""
    stage = _stage_of(table)
    names = ", ".join(stage.columns)
    keys = unique_key(table)
    # The CTE's rows are the ones inserted; a staged row without one was not.
    inserted = " AND ".join(f"i.{name} = s.{name}" for name in keys)
    move = (
        f"WITH inserted AS (INSERT INTO {table.name} ({names}) SELECT {names} FROM {stage.name} "
        f"ON CONFLICT ({', '.join(keys)}) DO NOTHING RETURNING {', '.join(keys)}) "
        f"SELECT s.{ORDINAL}, NULL::text FROM {stage.name} s "
        f"WHERE NOT EXISTS (SELECT FROM inserted i WHERE {inserted})"
    )
    key = models.partition_free_key(table, "postgresql")
    if key is not None:
        # The same record at another time: the table's unique key holds the time (its
        # partition column), so the insert let it in. The statement's scan of the table sees
        # the rows stored before it, not the CTE's own (one snapshot), and the unique index
        # (key..., time) makes each probe an index lookup per partition.
        same = " AND ".join(f"t.{name} = s.{name}" for name in key)
        move += (
            f" UNION ALL SELECT s.{ORDINAL}, t.content_hash FROM {stage.name} s "
            f"JOIN {table.name} t ON {same} AND t.{models.PARTITION_COLUMN} <> s.{models.PARTITION_COLUMN}"
        )
    # A statement of its own, so a row another transaction committed meanwhile is seen.
    same_key = " AND ".join(f"t.{name} = s.{name}" for name in keys)
    stored = (
        f"SELECT s.{ORDINAL}, t.content_hash FROM {stage.name} s JOIN {table.name} t ON {same_key} "
        f"WHERE s.{ORDINAL} = ANY(%s)"
    )
    return move, stored


@functools.cache
def _upsert_statement(table: sa.Table, update: tuple[str, ...], newer: str) -> str:
    stage = _stage_of(table)
    names = ", ".join(stage.columns)
    sets = ", ".join(f"{name} = EXCLUDED.{name}" for name in update)
    return (
        f"INSERT INTO {table.name} ({names}) SELECT {names} FROM {stage.name} "
        f"ON CONFLICT ({', '.join(unique_key(table))}) DO UPDATE SET {sets} "
        f"WHERE {table.name}.{newer} < EXCLUDED.{newer}"
    )


def _row_writer(table: sa.Table, columns: tuple[str, ...]) -> Callable[[dict[str, Any], int], bytes]:
    """A function from a row and its position to its tuple in COPY's binary format: the
    field count, then each field as its length and bytes (a length of -1 for NULL)."""
    fields = ["_int4(4, o)"]
    for name in columns:
        kind = table.c[name].type
        if isinstance(kind, sa.TypeDecorator):  # models.Float64: a double on PostgreSQL
            kind = kind.impl_instance
        value = f"r[{name!r}]"  # a row holds every column (a record's fields, its run, hash)
        if isinstance(kind, sa.JSON):
            fields.append(f"_json({value})")
        elif isinstance(kind, sa.String):
            fields.append(f"_text({value})")
        elif isinstance(kind, sa.Boolean):
            fields.append(f"_bool[{value}]")
        elif isinstance(kind, sa.Float | sa.Integer):
            pack = (
                "_float8(8, v)"
                if isinstance(kind, sa.Float)
                else "_int8(8, v)"
                if isinstance(kind, sa.BigInteger)
                else "_int4(4, v)"
            )
            fields.append(f"(_NULL if (v := {value}) is None else {pack})")
        else:
            raise TypeError(f"{table.name}.{name}: no binary COPY writer for {kind!r}")
    count = struct.pack(">h", len(fields))
    source = f"lambda r, o: b''.join((_count, {', '.join(fields)}))"
    # One generated lambda, as for SQLite: direct lookups are the cheapest row -> bytes in Python.
    names = {
        "_count": count,
        "_NULL": _NULL,
        "_int4": _INT4,
        "_int8": _INT8,
        "_float8": _FLOAT8,
        "_bool": _BOOLEANS,
        "_json": _json,
        "_text": _text,
    }
    writer: Callable[[dict[str, Any], int], bytes] = eval(source, names)
    return writer


# COPY's binary format: a signature, flags and header extension length; -1 fields end it.
_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
_TRAILER = struct.pack(">h", -1)
_NULL = struct.pack(">i", -1)
_LENGTH = struct.Struct(">i").pack
_INT4 = struct.Struct(">ii").pack
_INT8 = struct.Struct(">iq").pack
_FLOAT8 = struct.Struct(">id").pack  # NaN and the infinities are doubles like any other
_BOOLEANS = {None: _NULL, True: _LENGTH(1) + b"\x01", False: _LENGTH(1) + b"\x00"}


def _text(value: str | None) -> bytes:
    if value is None:
        return _NULL
    data = value.encode()
    return _LENGTH(len(data)) + data


def _json(value: Any) -> bytes:
    """As the engine's JSON serializer writes it (``monitor.store.db``): NaN by name, None as
    JSON null. orjson alone writes a nonfinite float as null, and takes no mapping but a dict:
    only a value with a null in it, or one orjson refuses, takes the walk through ``to_wire``."""
    try:
        data = orjson.dumps(value)
    except TypeError:
        data = b"null"
    if b"null" in data and value is not None:
        data = orjson.dumps(to_wire(value))
    return _LENGTH(len(data)) + data
