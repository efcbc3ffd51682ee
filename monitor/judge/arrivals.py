"""What a run's judge has not looked at yet, whichever replica stored it.

With several replicas over one PostgreSQL, the replica that judges a run (``monitor.store.leases``)
did not receive most of its records: it reads each kind's rows newer than the newest it has seen,
by id. That is exact because one run's records are written one transaction at a time
(``monitor.store.locks.lock_run_writes``), so their ids are committed in order and none can
appear later below a mark already passed. The judge reads a window's step records only up to its
mark (``PolicyEngine.step_ceiling``), so a record stored while a window was being judged is
judged late, once, not twice and not never.

A judge that takes a run over starts at the newest rows then stored: windows not judged yet are
judged from the store; what the previous judge had read but not yet acted on (a directive
acknowledgement, a resume, a canary result in its last second) is not acted on again.

The rows a replica stored itself for a run it judges (most of them, with one replica or a load
balancer that keeps a run on one) are handed to its judge in memory (``written``) with the
newest id the store gave them, and not read back: reading a 1,000-record batch back was a sixth
of the service's CPU. The look takes them only where the store holds exactly as many rows of
the run between its mark and that id as were handed (one count, in the statement that asks
which kinds have new rows): then no other replica's row lies among them, and the mark moves to
that id. Otherwise (another replica's batch in between, a batch committed and read from the
store before it was handed) the look reads the store as it does without them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.judge.readings import RANK_FIELDS
from monitor.store import models

STEP = models.table_of(models.StepRecord)
SUMMARY = models.table_of(models.StepSummary)
INCARNATION = models.table_of(models.Incarnation)
# The kinds of record whose new rows the service's judging takes (``Service.judge``).
TABLES: Mapping[str, sa.Table] = {
    "step": STEP,
    "device_sample": models.table_of(models.DeviceSample),
    "link_sample": models.table_of(models.LinkSample),
    "checkpoint": models.table_of(models.CheckpointEvent),
    "resume": models.table_of(models.ResumeEvent),
    "canary_result": models.table_of(models.CanaryResult),
    "directive_ack": models.table_of(models.DirectiveAck),
}

# The kinds whose stored rows a judge takes from its own replica's writes (the engine and the
# device rules read them as a batch's new rows on a single service, without ids).
HANDED = ("step", "device_sample", "link_sample")
MAX_HANDED_ROWS = 65_536
"""The most rows a run's judge keeps handed between two looks: four seconds of 16,384 ranks at
one step a second, about 60 MB (a step record's row is 0.9 KB of dicts and values, measured
with tracemalloc). Past it the judge is behind, and the rows wait in the store, not in this
process's memory, for the look that reads them from there."""


@dataclass
class Arrived:
    new_rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    late: list[dict[str, Any]] = field(default_factory=list)
    """Step records whose window was judged before they were stored."""
    started: bool = False
    """An incarnation's run-start record arrived."""
    finished: bool = False
    """An incarnation's run-finish record arrived."""


@dataclass
class _Marks:
    newest: dict[str, int]
    started: int
    """How many of the run's incarnations the store held a start of, at the last read."""
    finished: int
    """How many it held a finish of."""


@dataclass(frozen=True)
class _Written:
    newest: int
    """The newest id the store gave the rows (each of theirs is above the mark they were
    stored past: the run's writes are one transaction at a time)."""
    rows: Sequence[dict[str, Any]]


class Arrivals:
    """Per run this replica judges, how far it has read each kind of record, and the rows it
    stored itself since (``written``)."""

    def __init__(self) -> None:
        self._marks: dict[int, _Marks] = {}
        self._written: dict[int, dict[str, list[_Written]]] = {}
        self._handed_rows: dict[int, int] = {}  # of each run, the rows in ``_written``
        self._written_lock = threading.Lock()  # ingest threads hand rows; the judge takes them

    def written(self, run_id: int, kind: str, rows: Sequence[dict[str, Any]], newest: int) -> None:
        """Rows of ``kind`` this replica has just committed for ``run_id``, the newest with id
        ``newest``: called in commit order (the write lock held), after the commit."""
        if kind not in HANDED or not rows:
            return
        with self._written_lock:
            if run_id not in self._marks:
                return  # a run another replica judges: its judge reads the store
            handed = self._handed_rows.get(run_id, 0) + len(rows)
            if handed > MAX_HANDED_ROWS:  # the next look reads them all from the store
                self._written.pop(run_id, None)
                self._handed_rows.pop(run_id, None)
                return
            self._handed_rows[run_id] = handed
            self._written.setdefault(run_id, {}).setdefault(kind, []).append(_Written(newest, rows))

    def _take_written(self, run_id: int, marks: _Marks) -> dict[str, _Written]:
        """The rows handed since the last look, of each kind past its mark, as one."""
        with self._written_lock:
            written = self._written.pop(run_id, {})
            self._handed_rows.pop(run_id, None)
        taken = {}
        for kind, batches in written.items():
            # A batch is committed whole: one at or below the mark was read from the store.
            fresh = [batch for batch in batches if batch.newest > marks.newest[kind]]
            if fresh:
                rows = [row for batch in fresh for row in batch.rows]
                taken[kind] = _Written(max(batch.newest for batch in fresh), rows)
        return taken

    def step_mark(self, run_id: int) -> int | None:
        marks = self._marks.get(run_id)
        return None if marks is None else marks.newest["step"]

    def begin(self, connection: Connection, run_id: int) -> None:
        """Start reading the run at the newest rows stored now (a lease just taken)."""
        newest = {
            kind: int(
                connection.execute(
                    sa.select(sa.func.coalesce(sa.func.max(table.c.id), 0)).where(table.c.run_id == run_id)
                ).scalar_one()
            )
            for kind, table in TABLES.items()
        }
        started, finished = connection.execute(_INCARNATIONS, {"run_id": run_id}).one()
        with self._written_lock:
            self._marks[run_id] = _Marks(newest, int(started), int(finished))

    def forget(self, run_id: int) -> None:
        with self._written_lock:
            self._marks.pop(run_id, None)
            self._written.pop(run_id, None)
            self._handed_rows.pop(run_id, None)

    def read(self, connection: Connection, run_id: int) -> Arrived:
        """The rows stored since the last read (``begin`` first), and which step records of
        them are late."""
        marks = self._marks[run_id]
        arrived = Arrived()
        handed = self._take_written(run_id, marks)
        tops = {kind: handed[kind].newest if kind in handed else marks.newest[kind] for kind in HANDED}
        *answers, started, finished = connection.execute(
            _ANY_NEWER, {"run_id": run_id, **_mark_params(marks), **_top_params(tops)}
        ).one()
        newer, stored = answers[: len(TABLES)], dict(zip(HANDED, answers[len(TABLES) :], strict=True))
        for kind, any_newer in zip(TABLES, newer, strict=True):
            mine = handed.get(kind)
            if mine is not None and stored[kind] == len(mine.rows):
                # Exactly the rows handed lie between the mark and their newest id.
                arrived.new_rows[kind] = list(mine.rows)
                marks.newest[kind] = mine.newest
            elif mine is not None:
                any_newer = True  # another replica's rows among them: read all from the store
            if not any_newer:
                continue
            result = connection.execute(_READS[kind], {"run_id": run_id, "mark": marks.newest[kind]})
            names = tuple(result.keys())
            rows = [dict(zip(names, row, strict=True)) for row in result]  # not a mapping per row
            if rows:
                marks.newest[kind] = rows[-1]["id"]
                arrived.new_rows.setdefault(kind, []).extend(rows)
        arrived.late = _late(connection, run_id, arrived.new_rows.get("step", []))
        arrived.started = started > marks.started
        arrived.finished = finished > marks.finished
        marks.started, marks.finished = int(started), int(finished)
        return arrived


def _columns(kind: str, table: sa.Table) -> list[sa.ColumnElement[Any]]:
    """The columns read of a kind's new rows: of a step record, its id and the fields its
    window is judged by (``readings.RANK_FIELDS``, what the engine reads of a window from the
    store), a third fewer than all; of the other kinds, every column."""
    if kind == "step":
        return [table.c.id, *(table.c[name] for name in RANK_FIELDS)]
    return list(table.columns)


def _newer_than_mark(kind: str, table: sa.Table) -> sa.Exists:
    """Rows past the kind's mark, or past the newest id handed (``top_<kind>``) for ``HANDED``."""
    mark: sa.BindParameter[int] = sa.bindparam(f"top_{kind}" if kind in HANDED else kind)
    return sa.exists().where(table.c.run_id == sa.bindparam("run_id"), table.c.id > mark)


def _stored_up_to_top(kind: str, table: sa.Table) -> sa.ScalarSelect[int]:
    """How many of the run's rows lie past the kind's mark, up to the newest id handed."""
    return (
        sa.select(sa.func.count())
        .select_from(table)
        .where(
            table.c.run_id == sa.bindparam("run_id"),
            table.c.id > sa.bindparam(kind),
            table.c.id <= sa.bindparam(f"top_{kind}"),
        )
        .scalar_subquery()
    )


def _incarnation_counts() -> tuple[sa.ScalarSelect[int], sa.ScalarSelect[int]]:
    """How many of the run's incarnations the store holds a start of (a placeholder a finish
    made first has no content hash yet), and a finish of. Both only grow (a start completes a
    placeholder, a finish fills ``finished_at``; no row is deleted but with its run), so a
    count past the last read's is a start or a finish arrived since, exactly as the sets of ids
    a look compared were."""
    mine = INCARNATION.c.run_id == sa.bindparam("run_id")
    count = sa.select(sa.func.count()).select_from(INCARNATION)
    return (
        count.where(mine, INCARNATION.c.content_hash != "").scalar_subquery(),
        count.where(mine, INCARNATION.c.finished_at.is_not(None)).scalar_subquery(),
    )


_INCARNATIONS = sa.select(*_incarnation_counts())

# Whether each kind has rows past its mark, in one statement (``TABLES``' order), then the
# incarnation counts: of the seven kinds a look reads, a training run's batches bring one or
# two, and a read of a kind with nothing new cost a round trip and SQLAlchemy's making of its
# statement all the same. A look after 8 one-rank batches on PostgreSQL went from 9 statements
# to 4, and from 10-12 ms of the service's CPU to 4 (a loaded machine, load 9-12, both trees
# back to back); the counts, read apart on every look, one statement fewer again.
# With the rows handed (``HANDED``): whether any lie past the newest id handed, and how many up
# to it, in the same statement.
_ANY_NEWER = sa.select(
    *(_newer_than_mark(kind, table) for kind, table in TABLES.items()),
    *(_stored_up_to_top(kind, TABLES[kind]) for kind in HANDED),
    *_incarnation_counts(),
)


# Each kind's rows past its mark, built once (a look made them anew, a few dozen microseconds each).
_READS = {
    kind: sa.select(*_columns(kind, table))
    .where(table.c.run_id == sa.bindparam("run_id"), table.c.id > sa.bindparam("mark"))
    .order_by(table.c.id)
    for kind, table in TABLES.items()
}


def _mark_params(marks: _Marks) -> dict[str, int]:
    return {kind: marks.newest[kind] for kind in TABLES}


def _top_params(tops: Mapping[str, int]) -> dict[str, int]:
    return {f"top_{kind}": top for kind, top in tops.items()}


def _late(connection: Connection, run_id: int, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = sorted({(row["incarnation"], row["attempt"]) for row in rows})
    judged: set[tuple[str, int]] = set()
    for start in range(0, len(keys), 500):
        chunk = keys[start : start + 500]
        judged.update(
            (incarnation, attempt)
            for incarnation, attempt in connection.execute(
                sa.select(SUMMARY.c.incarnation, SUMMARY.c.attempt).where(
                    SUMMARY.c.run_id == run_id,
                    SUMMARY.c.judged.is_(True),
                    sa.tuple_(SUMMARY.c.incarnation, SUMMARY.c.attempt).in_(chunk),
                )
            )
        )
    return [row for row in rows if (row["incarnation"], row["attempt"]) in judged]
