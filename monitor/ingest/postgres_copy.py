"""Writing a batch's rows on PostgreSQL by ``COPY`` through a staging table.

A multi-row ``INSERT`` costs the service over a hundred microseconds a row in SQLAlchemy's and
the driver's parameter handling; ``COPY`` takes one stream in PostgreSQL's binary format that
one generated function per table writes (binary: a double is packed, not printed, and text
needs no escaping). The rows go into a temporary table of the session (created once with the
models' column types, emptied at each commit), and move to their table with ``INSERT ... SELECT ... ON CONFLICT DO NOTHING``
in the batch's own transaction, so a refused batch still leaves nothing behind. The
statement answers which staged rows did not go in; their stored content hashes are read
back so the caller tells a re-sent record from a conflicting one exactly as on SQLite.

A batch with few rows of a kind (``INLINE_ROWS``, the hook's one rank a post) skips the staging
table: its rows are the moving statement's own arrays (``unnest``), the same statement otherwise,
so the answers are the same, in one round trip instead of three.

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

from monitor.store import models, prepared
from policies.protocol import to_wire

ORDINAL = "batch_ord"
"""The staging table's extra column: a row's position in the list the caller passed."""


def available(connection: Connection) -> bool:
    """``COPY`` needs psycopg2's ``copy_expert`` (and the moves, its placeholders: they are
    prepared statements, ``monitor.store.prepared``); another driver takes the INSERT path."""
    return prepared.available(connection)


@dataclass(frozen=True)
class Stage:
    """A table's staging table: how to make it ready, fill it, and write a row's line."""

    name: str
    columns: tuple[str, ...]
    prepare: str
    copy: str
    row: Callable[[dict[str, Any], int], bytes]
    inline: str
    """The same rows as the statement's own CTE ``staged``, from one array parameter per column
    (``unnest``): a small batch's rows travel inside the statement that moves them."""
    arrays: Callable[[Sequence[dict[str, Any]]], list[list[Any]]]
    """The rows as those parameters: their positions, then each column's values."""

    def data(self, rows: Sequence[dict[str, Any]]) -> bytes:
        """The rows in COPY's binary format, each with its position first."""
        tuples = [self.row(row, position) for position, row in enumerate(rows)]
        return b"".join((_HEADER, *tuples, _TRAILER))


INLINE_ROWS = 16
"""The most rows of a kind in a batch that go in as arrays inside the statement that moves them
(one round trip) rather than by ``COPY`` into the staging table (three: empty the table, copy,
move; and PostgreSQL makes the table's file anew at each ``TRUNCATE``). Measured with
``ingest_batch`` of step records on PostgreSQL 15, client and server CPU per batch (load 5-7):
1 row 1,270 + 2,030 us inline against 1,761 + 4,050 by COPY; 8 rows 1,553 + 2,460 against
2,057 + 6,460; 32 rows 2,551 + 4,160 against 2,308 + 2,960. Past that the arrays' text
(psycopg2 writes every value into the statement, ~40 us a row) costs more than COPY's binary
stream saves, so a large batch still goes by ``COPY``. The hook's one rank a post sends one to
a few records of each kind."""


@dataclass(frozen=True)
class Moved:
    """What ``insert_new`` did with a batch's rows of one table."""

    not_inserted: dict[int, str | None]
    """For each row that was not inserted (by its position in the rows passed), the content
    hash stored under its key (``None`` if that row went away meanwhile), and for each row
    whose key without its time is stored at another time (a time-partitioned table,
    ``models.partition_free_key``), that row's hash; empty when all went in and none was
    stored at another time."""
    newest_id: int | None = None
    """The id of the newest row inserted (``None`` if none was): with the run's write lock
    held, every row of the run up to it is either this batch's or was committed before it
    (``monitor.judge.arrivals`` hands a judging replica its own rows without reading them)."""


def insert_new(
    connection: Connection, table: sa.Table, rows: Sequence[dict[str, Any]], inline_rows: int = INLINE_ROWS
) -> Moved:
    """Insert the rows whose unique key is not stored yet (``Moved`` says which were not, and
    the newest id inserted). Up to ``inline_rows`` rows go in as the statement's own arrays,
    more by ``COPY`` into the staging table."""
    if not rows:
        return Moved({})
    stage = _stage_of(table)
    inline = len(rows) <= inline_rows
    # Inline, the rows are both statements' parameters: the second (only when some key was
    # stored) reads them again, and sees what was committed since the first, as it does from
    # the staging table.
    arrays: tuple[list[Any], ...] = tuple(stage.arrays(rows)) if inline else ()
    if not inline:
        _staged(connection, stage, rows)
    move, stored = _keyed_statements(table, inline)
    # The one row without a position is the newest id inserted (the move's last part).
    newest: int | None = None
    answered: list[tuple[int, str | None]] = []
    for position, value in prepared.execute(connection, move, arrays):
        if position is not None:
            answered.append((position, value))
        elif value is not None:
            newest = int(value)
    if not answered:
        return Moved({}, newest)
    missing = [position for position, other_time_hash in answered if other_time_hash is None]
    found = (
        {p: stored_hash for p, stored_hash in prepared.execute(connection, stored, (*arrays, missing))}
        if missing
        else {}
    )
    # A key stored at another time is answered as that record: its content differs (the time
    # is content), so the caller refuses it as SQLite's unique key on the key alone would.
    elsewhere = {position: other for position, other in answered if other is not None}
    return Moved({position: found.get(position) for position in missing} | elsewhere, newest)


def upsert_newer(
    connection: Connection,
    table: sa.Table,
    rows: Sequence[dict[str, Any]],
    update: Sequence[str],
    newer: str,
    inline_rows: int = INLINE_ROWS,
) -> None:
    """Insert each row, or update its stored row's ``update`` columns when the row's ``newer``
    column is greater than the stored one (a heartbeat: the newest wins). Up to
    ``inline_rows`` rows go in as the statement's own arrays, as in ``insert_new``."""
    if not rows:
        return
    stage = _stage_of(table)
    if len(rows) <= inline_rows:
        statement = _upsert_statement(table, tuple(update), newer, True)
        prepared.execute(connection, statement, stage.arrays(rows))
        return
    _staged(connection, stage, rows)
    prepared.execute(connection, _upsert_statement(table, tuple(update), newer, False))


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
    inline, arrays = _array_source(table, columns)
    return Stage(stage, columns, prepare, copy, _row_writer(table, columns), inline, arrays)


def _array_source(
    table: sa.Table, columns: tuple[str, ...]
) -> tuple[str, Callable[[Sequence[dict[str, Any]]], list[list[Any]]]]:
    """The CTE ``staged`` over one array parameter per column, each cast to the models' type
    as the staging table's columns are; and the function from rows to those arrays. A JSON
    value travels as its text, written as ``COPY`` writes it (NaN by name, None as JSON null)."""
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    arrays, selected = ["%s::integer[]"], [ORDINAL]
    converters: list[Callable[[Any], str] | None] = []
    for name in columns:
        kind = table.c[name].type
        typed = kind.compile(dialect)
        if isinstance(kind, sa.TypeDecorator):  # models.Float64: a double on PostgreSQL
            kind = kind.impl_instance
        if isinstance(kind, sa.JSON):
            arrays.append("%s::text[]")
            selected.append(f"{name}::{typed} AS {name}")
            converters.append(_json_text)
        else:
            arrays.append(f"%s::{typed}[]")
            selected.append(name)
            converters.append(None)
    source = (
        f"staged AS (SELECT {', '.join(selected)} FROM unnest({', '.join(arrays)}) "
        f"AS u({ORDINAL}, {', '.join(columns)}))"
    )
    plan = tuple(zip(columns, converters, strict=True))

    def to_arrays(rows: Sequence[dict[str, Any]]) -> list[list[Any]]:
        found: list[list[Any]] = [list(range(len(rows)))]
        for name, convert in plan:
            values = [row[name] for row in rows]
            found.append(values if convert is None else [convert(value) for value in values])
        return found

    return source, to_arrays


@functools.cache
def _keyed_statements(table: sa.Table, inline: bool = False) -> tuple[str, str]:
    """The move (staged rows into the table; answers the positions not inserted) and the read
    of the stored hashes of those positions, matched on the conflict target. ``inline``: the
    staged rows are the statements' own CTE (``Stage.inline``), not the staging table."""
    stage = _stage_of(table)
    names = ", ".join(stage.columns)
    keys = unique_key(table)
    source, staged = ("staged", f"{stage.inline}, ") if inline else (stage.name, "")
    # The CTE's rows are the ones inserted; a staged row without one was not.
    inserted = " AND ".join(f"i.{name} = s.{name}" for name in keys)
    move = (
        f"WITH {staged}inserted AS (INSERT INTO {table.name} ({names}) SELECT {names} FROM {source} "
        f"ON CONFLICT ({', '.join(keys)}) DO NOTHING RETURNING id, {', '.join(keys)}) "
        f"SELECT s.{ORDINAL}, NULL::text FROM {source} s "
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
            f" UNION ALL SELECT s.{ORDINAL}, t.content_hash FROM {source} s "
            f"JOIN {table.name} t ON {same} AND t.{models.PARTITION_COLUMN} <> s.{models.PARTITION_COLUMN}"
        )
    # And always one row without a position: the newest id inserted (NULL if none was).
    move += " UNION ALL SELECT NULL::integer, max(id)::text FROM inserted"
    # A statement of its own, so a row another transaction committed meanwhile is seen.
    same_key = " AND ".join(f"t.{name} = s.{name}" for name in keys)
    stored = (
        f"{f'WITH {stage.inline} ' if inline else ''}SELECT s.{ORDINAL}, t.content_hash "
        f"FROM {source} s JOIN {table.name} t ON {same_key} WHERE s.{ORDINAL} = ANY(%s)"
    )
    return move, stored


@functools.cache
def _upsert_statement(table: sa.Table, update: tuple[str, ...], newer: str, inline: bool) -> str:
    stage = _stage_of(table)
    names = ", ".join(stage.columns)
    sets = ", ".join(f"{name} = EXCLUDED.{name}" for name in update)
    source, with_source = ("staged", f"WITH {stage.inline} ") if inline else (stage.name, "")
    return (
        f"{with_source}INSERT INTO {table.name} ({names}) SELECT {names} FROM {source} "
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
    data = _json_bytes(value)
    return _LENGTH(len(data)) + data


def _json_text(value: Any) -> str:
    return _json_bytes(value).decode()


def _json_bytes(value: Any) -> bytes:
    """As the engine's JSON serializer writes it (``monitor.store.db``): NaN by name, None as
    JSON null. orjson alone writes a nonfinite float as null, and takes no mapping but a dict:
    only a value with a null in it, or one orjson refuses, takes the walk through ``to_wire``."""
    try:
        data = orjson.dumps(value)
    except TypeError:
        data = b"null"
    if b"null" in data and value is not None:
        data = orjson.dumps(to_wire(value))
    return data
