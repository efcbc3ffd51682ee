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
"""

from __future__ import annotations

from collections.abc import Mapping
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


class Arrivals:
    """Per run this replica judges, how far it has read each kind of record."""

    def __init__(self) -> None:
        self._marks: dict[int, _Marks] = {}

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
        self._marks[run_id] = _Marks(newest, int(started), int(finished))

    def forget(self, run_id: int) -> None:
        self._marks.pop(run_id, None)

    def read(self, connection: Connection, run_id: int) -> Arrived:
        """The rows stored since the last read (``begin`` first), and which step records of
        them are late."""
        marks = self._marks[run_id]
        arrived = Arrived()
        *newer, started, finished = connection.execute(
            _ANY_NEWER, {"run_id": run_id, **_mark_params(marks)}
        ).one()
        for kind, any_newer in zip(TABLES, newer, strict=True):
            if not any_newer:
                continue
            result = connection.execute(_READS[kind], {"run_id": run_id, "mark": marks.newest[kind]})
            names = tuple(result.keys())
            rows = [dict(zip(names, row, strict=True)) for row in result]  # not a mapping per row
            if rows:
                marks.newest[kind] = rows[-1]["id"]
                arrived.new_rows[kind] = rows
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
    return sa.exists().where(table.c.run_id == sa.bindparam("run_id"), table.c.id > sa.bindparam(kind))


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
_ANY_NEWER = sa.select(
    *(_newer_than_mark(kind, table) for kind, table in TABLES.items()), *_incarnation_counts()
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
