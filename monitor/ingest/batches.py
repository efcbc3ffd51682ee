"""Writing one validated batch: idempotent by key, all or nothing, with SQLAlchemy Core.

A record re-sent with the same key and content is stored once; the same key with other
content raises ``ConflictError`` and the caller's transaction rolls the whole batch back.
On PostgreSQL the high-volume kinds (step records, device and link samples, heartbeats) go
in by ``COPY`` (``monitor.ingest.postgres_copy``); which rows were new, re-sent or in
conflict is decided here for both paths, so both give the same answers.
Checkpoints are the exception: their key is their content's identity (path, step, manifest
digest), so the same checkpoint reported again, at another time or with other tags, is a
duplicate, and the same path saved with other content is a new row (a newer version).
"""

from __future__ import annotations

import functools
import hashlib
import marshal
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from monitor.ingest import postgres_copy
from monitor.recovery import directives
from monitor.store import models
from policies import protocol
from policies.checkpoints import manifest_digest
from policies.protocol import to_wire


class InvalidRecord(Exception):
    """A record that is well-formed but refers to something this run does not have."""

    def __init__(self, index: int, field: str, message: str) -> None:
        self.index, self.field = index, field
        super().__init__(f"record {index}: field {field!r}: {message}")


class ConflictError(Exception):
    """A record whose key is stored with other content."""

    def __init__(self, index: int, kind: str, key: dict[str, Any]) -> None:
        self.index, self.kind, self.key = index, kind, key
        super().__init__(
            f"record {index} ({kind}) conflicts with a stored record of the same key {key} "
            "and different content"
        )


@dataclass(frozen=True)
class TableSpec:
    table: sa.Table
    key: tuple[str, ...]
    flat: bool = True
    """No nested models: the record's own field dict is the row (``model_dump`` costs ~10 us
    a record, a third of the ingest budget)."""
    has_dicts: bool = True
    """Some field holds a free-form dict (hashed with sorted keys)."""
    key_is_identity: bool = False
    """The key says all that makes two records one: a stored key is a duplicate whatever the
    rest of the content (checkpoints: the same content at the same path and step)."""
    derive: Callable[[int, dict[str, Any]], None] | None = None
    """Fills in (or checks) key fields the service derives from the record, before hashing."""
    copied: bool = False
    """Written by ``COPY`` on PostgreSQL: a kind that arrives by the thousand a second."""


def _checkpoint_identity(index: int, row: dict[str, Any]) -> None:
    """A checkpoint's manifest digest, derived from its manifest when the sender left it empty
    (a hook older than the field, a hand-made record); one that does not match is refused."""
    derived = manifest_digest(row.get("manifest"))
    sent = row.get("manifest_digest") or ""
    if sent and sent != derived:
        raise InvalidRecord(
            index, "manifest_digest", f"{sent} is not the digest of the manifest sent ({derived})"
        )
    row["manifest_digest"] = derived


# Keys are the protocol's (``policies.protocol.kinds``); a table holds them with its run.
KEYED_TABLES: dict[str, TableSpec] = {
    "step": TableSpec(models.table_of(models.StepRecord), protocol.STEP.key, has_dicts=False, copied=True),
    "device_sample": TableSpec(models.table_of(models.DeviceSample), protocol.DEVICE_SAMPLE.key, copied=True),
    "link_sample": TableSpec(models.table_of(models.LinkSample), protocol.LINK_SAMPLE.key, copied=True),
    "checkpoint": TableSpec(
        models.table_of(models.CheckpointEvent),
        protocol.CHECKPOINT.key,
        flat=False,
        key_is_identity=True,
        derive=_checkpoint_identity,
    ),
    "resume": TableSpec(models.table_of(models.ResumeEvent), protocol.RESUME.key),
    "stack_dump": TableSpec(models.table_of(models.StackDump), protocol.STACK_DUMP.key, has_dicts=False),
    "canary_result": TableSpec(models.table_of(models.CanaryResult), protocol.CANARY_RESULT.key, flat=False),
    "directive_ack": TableSpec(models.table_of(models.DirectiveAck), protocol.DIRECTIVE_ACK.key),
}


@dataclass
class IngestResult:
    accepted: int = 0
    duplicates: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    new_rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """The newly stored rows of each keyed kind, for the engine (duplicates excluded)."""
    stored_at: list[int] = field(default_factory=list)
    """The positions, in the batch, of the records counted in ``accepted`` (in no order)."""
    duplicate_at: list[int] = field(default_factory=list)
    """The positions of the records counted in ``duplicates``."""
    newest_id: dict[str, int] = field(default_factory=dict)
    """Of each kind written by ``COPY`` (PostgreSQL), the id of the newest row stored: a judging
    replica takes ``new_rows`` up to it from memory (``monitor.judge.arrivals``)."""

    def as_json(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "duplicates": self.duplicates, "by_kind": self.by_kind}


def content_hash(row: dict[str, Any], has_dicts: bool = True) -> str:
    """A digest of a record's content: NaN distinct from null, nested dicts key-order-free.

    Rows come from one pydantic model, so their field order is fixed and the tuple of values
    is canonical; only free-form dicts need sorting (``has_dicts=False`` skips looking).
    """
    values = (
        tuple(
            orjson.dumps(to_wire(value), option=orjson.OPT_SORT_KEYS) if isinstance(value, dict) else value
            for value in row.values()
        )
        if has_dicts
        else tuple(row.values())
    )
    # marshal keeps float bits (NaN is not None) and is fast; version 2 has no object
    # references, so equal content gives equal bytes however the objects are shared.
    return hashlib.blake2b(marshal.dumps(values, 2), digest_size=16).hexdigest()


def dialect_insert(connection: Connection, table: sa.Table) -> Any:
    if connection.dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


class WorldSizes:
    """The world size each incarnation declared, as stored, kept between batches by the
    service: a batch of ranked records is then checked without a read. Exact, because a stored
    world size never changes (a run start re-sent with other content is a conflict, and no
    incarnation is deleted); one not stored yet is not kept, and is read again next batch."""

    LIMIT = 65_536
    """Incarnations kept (a few dozen bytes each); past it the map starts again, empty."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, str], int] = {}

    def get(self, run_id: int, incarnation: str) -> int | None:
        return self._known.get((run_id, incarnation))

    def learn(self, run_id: int, declared: Iterable[tuple[str, int]]) -> None:
        if len(self._known) >= self.LIMIT:
            self._known.clear()
        for incarnation, world_size in declared:
            self._known[(run_id, incarnation)] = world_size


def ingest_batch(
    connection: Connection,
    run_id: int,
    records: Sequence[Any],
    now: float,
    *,
    copy: bool = True,
    inline_rows: int = postgres_copy.INLINE_ROWS,
    world_sizes: WorldSizes | None = None,
) -> IngestResult:
    """Store one batch inside the caller's transaction; raise ``ConflictError`` on conflict.
    ``copy``: use ``COPY`` where the store can (PostgreSQL through psycopg2), for a kind of
    more than ``inline_rows`` rows in the batch (fewer go in as arrays, ``postgres_copy``).
    ``world_sizes``: the world sizes stored before, kept by the caller across batches."""
    result = IngestResult()
    copy = copy and postgres_copy.available(connection)
    by_kind: dict[str, list[tuple[int, Any]]] = defaultdict(list)
    for index, record in enumerate(records):
        by_kind[record.kind].append((index, record))
    if "directive_ack" in by_kind:
        _check_directives(connection, run_id, by_kind["directive_ack"])
    _check_ranks(connection, run_id, records, world_sizes or WorldSizes())
    for kind, indexed in by_kind.items():
        if kind in KEYED_TABLES:
            stored = _ingest_keyed(connection, run_id, kind, indexed, now, result, copy, inline_rows)
        elif kind == "run_start":
            stored = _ingest_run_starts(connection, run_id, indexed, result)
        elif kind == "run_finish":
            stored = _ingest_run_finishes(connection, run_id, indexed, result)
        elif kind == "heartbeat":  # every one counted: the newest of each rank's is kept
            stored = _ingest_heartbeats(connection, run_id, [r for _, r in indexed], now, copy, inline_rows)
            result.stored_at.extend(index for index, _ in indexed)
        else:  # the schema's discriminator makes this unreachable
            raise ValueError(f"unknown record kind {kind!r}")
        result.by_kind[kind] = stored
        result.accepted += stored
    return result


_INCARNATIONS = models.table_of(models.Incarnation)
# Built once (an incarnation's world size is read by every batch until its run start is stored).
_DECLARED_WORLD_SIZES = sa.select(_INCARNATIONS.c.incarnation, _INCARNATIONS.c.world_size).where(
    _INCARNATIONS.c.run_id == sa.bindparam("run_id"),
    _INCARNATIONS.c.incarnation.in_(sa.bindparam("wanted", expanding=True)),
    _INCARNATIONS.c.world_size.is_not(None),
)


def _check_ranks(connection: Connection, run_id: int, records: Sequence[Any], known: WorldSizes) -> None:
    """A rank at or past its incarnation's declared world size (its run start, stored or in
    this batch) is refused by name: what the engine keeps per rank stays bounded by the job."""
    declared = {r.incarnation: r.world_size for r in records if r.kind == "run_start"}
    ranked = [
        (i, r)
        for i, r in enumerate(records)
        if getattr(r, "rank", None) is not None and hasattr(r, "incarnation")
    ]
    wanted = set()
    for incarnation in {r.incarnation for _, r in ranked} - set(declared):
        world = known.get(run_id, incarnation)
        if world is None:
            wanted.add(incarnation)
        else:
            declared[incarnation] = world
    if wanted:
        stored = connection.execute(_DECLARED_WORLD_SIZES, {"run_id": run_id, "wanted": list(wanted)}).all()
        known.learn(run_id, stored)
        declared.update(stored)
    for index, record in ranked:
        world = declared.get(record.incarnation)
        if world is not None and record.rank >= world:
            raise InvalidRecord(
                index, "rank", f"rank {record.rank} is not below the declared world size {world}"
            )


def _check_directives(connection: Connection, run_id: int, indexed: list[tuple[int, Any]]) -> None:
    table = models.table_of(models.Directive)
    wanted = {record.directive_id for _, record in indexed}
    known = set(
        connection.execute(
            sa.select(table.c.id).where(table.c.run_id == run_id, table.c.id.in_(wanted))
        ).scalars()
    )
    for index, record in indexed:
        if record.directive_id not in known:
            raise InvalidRecord(index, "directive_id", f"no directive {record.directive_id} for this run")


def _ingest_keyed(
    connection: Connection,
    run_id: int,
    kind: str,
    indexed: list[tuple[int, Any]],
    now: float,
    result: IngestResult,
    copy: bool,
    inline_rows: int,
) -> int:
    spec = KEYED_TABLES[kind]
    fresh: dict[tuple[Any, ...], tuple[int, dict[str, Any]]] = {}
    for index, record in indexed:
        row = _row_of(record, spec)
        if spec.derive is not None:
            spec.derive(index, row)
        digest = content_hash(row, spec.has_dicts)
        key = tuple(row[name] for name in spec.key)
        if key in fresh:
            if fresh[key][1]["content_hash"] != digest and not spec.key_is_identity:
                raise ConflictError(index, kind, dict(zip(spec.key, key, strict=True)))
            result.duplicates += 1
            result.duplicate_at.append(index)
            continue
        row.update(run_id=run_id, received_at=now, content_hash=digest)
        fresh[key] = (index, row)
    rows = [row for _, row in fresh.values()]
    if copy and spec.copied:
        moved = postgres_copy.insert_new(connection, spec.table, rows, inline_rows)
        not_inserted = moved.not_inserted
        if moved.newest_id is not None:
            result.newest_id[kind] = max(moved.newest_id, result.newest_id.get(kind, 0))
    else:
        not_inserted = _insert_new_rows(connection, spec, run_id, rows)
    indexes = [index for index, _ in fresh.values()]
    if not_inserted:
        # Only keys already stored come here: a re-send (counted) or a conflict (refused,
        # the batch's first one named, whichever order the store answered in).
        for position in sorted(not_inserted):
            stored_hash = not_inserted[position]
            row = rows[position]
            if stored_hash is None:
                continue  # deleted since the insert skipped it (retention): neither
            if stored_hash != row["content_hash"] and not spec.key_is_identity:
                raise ConflictError(indexes[position], kind, {name: row[name] for name in spec.key})
            result.duplicates += 1
            result.duplicate_at.append(indexes[position])
        rows = [row for position, row in enumerate(rows) if position not in not_inserted]
        indexes = [index for position, index in enumerate(indexes) if position not in not_inserted]
    result.new_rows.setdefault(kind, []).extend(rows)
    result.stored_at.extend(indexes)
    return len(rows)


def _insert_new_rows(
    connection: Connection, spec: TableSpec, run_id: int, rows: list[dict[str, Any]]
) -> dict[int, str | None]:
    """The Core path: insert the rows whose key is not stored; for each row that was not
    inserted (by position), the content hash stored under its key, and for each inserted row
    whose key is also stored at another time (``_stored_at_other_times``), that row's hash."""
    inserted = _insert_new(connection, spec, rows)
    keys = [tuple(row[name] for name in spec.key) for row in rows]
    elsewhere = _stored_at_other_times(connection, spec, run_id, rows, keys, inserted)
    if len(inserted) == len(rows):
        return elsewhere
    missing = {position: key for position, key in enumerate(keys) if key not in inserted}
    stored = {
        key: stored_hash
        for key, stored_hash in _stored(connection, spec, run_id, missing.values(), spec.table.c.content_hash)
    }
    return {position: stored.get(key) for position, key in missing.items()} | elsewhere


def _stored_at_other_times(
    connection: Connection,
    spec: TableSpec,
    run_id: int,
    rows: list[dict[str, Any]],
    keys: list[tuple[Any, ...]],
    inserted: set[tuple[Any, ...]],
) -> dict[int, str | None]:
    """On a time-partitioned PostgreSQL table the unique key holds the record's time, so a
    record re-sent with another time went in beside the stored one; SQLite's key refuses it.
    For each such inserted row (by position), the hash of the one stored at the other time."""
    if models.partition_free_key(spec.table, connection.dialect.name) is None or not inserted:
        return {}
    query = _other_times_statement(spec.table, spec.key)
    chosen = [position for position, key in enumerate(keys) if key in inserted]
    names = (*spec.key, models.PARTITION_COLUMN)
    # One array per column: the rows' values travel as a few parameters, not one per value
    # (an IN list of key tuples cost PostgreSQL ~0.5 ms of CPU a row on a 1,000-row batch;
    # SQLAlchemy's VALUES construct ~0.2 ms of the service's).
    arrays = [chosen, *([rows[position][name] for position in chosen] for name in names)]
    elsewhere: dict[int, str | None] = {}
    for position, stored_hash in connection.exec_driver_sql(query, (*arrays, run_id)):
        elsewhere.setdefault(position, stored_hash)
    return elsewhere


@functools.cache
def _other_times_statement(table: sa.Table, key: tuple[str, ...]) -> str:
    """The stored rows of the given rows' keys at another time than theirs: the rows joined
    as arrays (``unnest``) on the key, an index probe per row and partition."""
    time = models.PARTITION_COLUMN
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    names = (*key, time)
    arrays = ", ".join(["%s::integer[]", *(f"%s::{table.c[name].type.compile(dialect)}[]" for name in names)])
    same = " AND ".join(f"t.{name} = s.{name}" for name in key)
    return (
        f"SELECT s.position, t.content_hash FROM unnest({arrays}) AS s(position, {', '.join(names)}) "
        f"JOIN {table.name} t ON t.run_id = %s AND {same} AND t.{time} <> s.{time}"
    )


def _row_of(record: Any, spec: TableSpec) -> dict[str, Any]:
    if not spec.flat:
        return dict(record.model_dump(exclude={"kind"}))
    row = dict(record.__dict__)  # pydantic keeps validated field values here, in field order
    del row["kind"]
    return row


def _insert_new(connection: Connection, spec: TableSpec, rows: list[dict[str, Any]]) -> set[tuple[Any, ...]]:
    """Insert the rows whose key is not stored yet; return the keys that were inserted."""
    if not rows:
        return set()
    if connection.dialect.name == "sqlite" and _sqlite_insert_all(connection, spec.table, rows):
        return {tuple(row[name] for name in spec.key) for row in rows}
    key_columns = [spec.table.c[name] for name in spec.key]
    statement = (
        dialect_insert(connection, spec.table)
        .on_conflict_do_nothing(index_elements=models.unique_key(spec.table, connection.dialect.name))
        .returning(*key_columns)
    )
    return {tuple(row) for row in connection.execute(statement, rows)}


def _sqlite_insert_all(connection: Connection, table: sa.Table, rows: list[dict[str, Any]]) -> bool:
    """The common case on SQLite, fast: every key is new. A plain executemany on the driver
    skips SQLAlchemy's per-row parameter processing (a third of the ingest time at 16k-rank
    windows); if any key exists, nothing is written and the caller takes the general path."""
    statement, to_params = _sqlite_plan(table)
    savepoint = connection.begin_nested()
    try:
        connection.exec_driver_sql(statement, [to_params(row) for row in rows])
    except sa.exc.IntegrityError:
        savepoint.rollback()
        return False
    savepoint.commit()
    return True


@functools.cache
def _sqlite_plan(table: sa.Table) -> tuple[str, Callable[[dict[str, Any]], tuple[Any, ...]]]:
    """The INSERT statement of ``table`` and a function from a row to its parameters, applying
    what the column types would (``Float64``'s NaN as text, JSON columns as text)."""
    columns = [column for column in table.columns if column.name != "id"]
    terms = []
    for column in columns:
        get = f"r.get({column.name!r})"
        if isinstance(column.type, models.Float64):
            terms.append(f"_nan({get})")
        elif isinstance(column.type, sa.JSON):
            terms.append(f"_json({get})")
        else:
            terms.append(get)
    # One generated lambda: a tuple of direct lookups is the cheapest row -> parameters in Python.
    to_params = eval(f"lambda r: ({', '.join(terms)},)", {"_nan": _sqlite_nan, "_json": _sqlite_json})
    names = ", ".join(column.name for column in columns)
    marks = ", ".join("?" for _ in columns)
    return f"INSERT INTO {table.name} ({names}) VALUES ({marks})", to_params


def _sqlite_nan(value: Any) -> Any:
    return "NaN" if value != value else value  # only NaN is unequal to itself


def _sqlite_json(value: Any) -> Any:
    return None if value is None else orjson.dumps(to_wire(value)).decode()


def _stored(
    connection: Connection,
    spec: TableSpec,
    run_id: int,
    keys: Iterable[tuple[Any, ...]],
    *columns: sa.ColumnElement[Any],
) -> list[tuple[Any, ...]]:
    """The stored rows of ``keys``: each row's key (a tuple), then its ``columns``."""
    keys = list(keys)
    if not keys:
        return []
    table = spec.table
    key_columns = [table.c[name] for name in spec.key]
    found: list[tuple[Any, ...]] = []
    # Bounded IN lists keep every backend's parameter limit out of reach.
    for start in range(0, len(keys), 500):
        chunk = keys[start : start + 500]
        condition = (
            key_columns[0].in_([k[0] for k in chunk])
            if len(key_columns) == 1
            else sa.tuple_(*key_columns).in_(chunk)
        )
        query = sa.select(*key_columns, *columns).where(table.c.run_id == run_id, condition)
        width = len(key_columns)
        found.extend((tuple(row[:width]), *row[width:]) for row in connection.execute(query))
    return found


def _ingest_run_starts(
    connection: Connection, run_id: int, indexed: list[tuple[int, Any]], result: IngestResult
) -> int:
    table = models.table_of(models.Incarnation)
    stored = 0
    for index, record in indexed:
        row = record.model_dump(exclude={"kind", "time"})
        row["started_at"] = record.time
        digest = content_hash(row)
        existing = connection.execute(
            sa.select(table.c.id, table.c.content_hash).where(
                table.c.run_id == run_id, table.c.incarnation == record.incarnation
            )
        ).first()
        if existing is None:
            connection.execute(table.insert(), {**row, "run_id": run_id, "content_hash": digest})
            directives.retire_older_incarnations(connection, run_id, record.time)
            stored += 1
        elif existing.content_hash == "":
            # A finish that arrived first made a placeholder; the start completes it.
            connection.execute(
                table.update().where(table.c.id == existing.id).values(**row, content_hash=digest)
            )
            directives.retire_older_incarnations(connection, run_id, record.time)
            stored += 1
        elif existing.content_hash == digest:
            result.duplicates += 1
            result.duplicate_at.append(index)
            continue
        else:
            raise ConflictError(index, "run_start", {"incarnation": record.incarnation})
        result.stored_at.append(index)
    return stored


def _ingest_run_finishes(
    connection: Connection,
    run_id: int,
    indexed: list[tuple[int, Any]],
    result: IngestResult,
) -> int:
    table = models.table_of(models.Incarnation)
    stored = 0
    for index, record in indexed:
        digest = content_hash({"time": record.time, "status": record.status})
        existing = connection.execute(
            sa.select(table.c.id, table.c.finish_hash).where(
                table.c.run_id == run_id, table.c.incarnation == record.incarnation
            )
        ).first()
        values = {"finished_at": record.time, "finish_status": record.status, "finish_hash": digest}
        if existing is None:
            connection.execute(
                table.insert(),
                {"run_id": run_id, "incarnation": record.incarnation, "content_hash": "", **values},
            )
        elif existing.finish_hash is None:
            connection.execute(table.update().where(table.c.id == existing.id).values(**values))
        elif existing.finish_hash == digest:
            result.duplicates += 1
            result.duplicate_at.append(index)
            continue
        else:
            raise ConflictError(index, "run_finish", {"incarnation": record.incarnation})
        stored += 1
        result.stored_at.append(index)
    return stored


HEARTBEAT_UPDATES = ("node", "step", "attempt", "phase", "phase_since", "time", "received_at", "cpu_busy_at")


def _ingest_heartbeats(
    connection: Connection, run_id: int, records: list[Any], now: float, copy: bool, inline_rows: int
) -> int:
    """Keep each rank's newest heartbeat; an older one arriving late changes nothing."""
    latest: dict[tuple[str, int], Any] = {}
    for record in records:
        key = (record.incarnation, record.rank)
        if key not in latest or record.time > latest[key].time:
            latest[key] = record
    if not latest:
        return 0
    table = models.table_of(models.Heartbeat)
    rows = [
        {**record.model_dump(exclude={"kind"}), "run_id": run_id, "received_at": now}
        for record in latest.values()
    ]
    if copy:
        postgres_copy.upsert_newer(connection, table, rows, HEARTBEAT_UPDATES, "time", inline_rows)
        return len(records)
    insert = dialect_insert(connection, table)
    statement = insert.on_conflict_do_update(
        index_elements=["run_id", "incarnation", "rank"],
        set_={name: insert.excluded[name] for name in HEARTBEAT_UPDATES},
        where=table.c.time < insert.excluded.time,
    )
    connection.execute(statement, rows)
    return len(records)
