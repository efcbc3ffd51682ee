"""The store reads behind one scrape: a few index lookups per run, never a scan of history.

Every query is bounded by what is current, not by how long the run has been going: the newest
windows come from ``ix_step_summaries_run_judged`` (and the unique key on run, incarnation and
attempt), heartbeats from their unique key (one row per rank of the current incarnation), open
incidents from ``ix_incidents_run_status``. Step records, device samples and link samples are
never read here: the summaries and the fleet watch's newest readings already hold what is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.judge.readings import point_from_summary
from monitor.recovery import checkpoints
from monitor.store import models
from policies.checkpoints import CheckpointFacts, superseded

RUN = models.table_of(models.Run)
SUMMARY = models.table_of(models.StepSummary)
INCARNATION = models.table_of(models.Incarnation)
HEARTBEAT = models.table_of(models.Heartbeat)
CHECKPOINT = models.table_of(models.CheckpointEvent)
VALIDATION = models.table_of(models.CheckpointValidation)
INCIDENT = models.table_of(models.Incident)


@dataclass(frozen=True)
class RunState:
    """One run as ``/metrics`` shows it; ``None`` where the run has not reported that yet."""

    id: int
    name: str
    incarnation: str | None
    step: int | None = None
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    loss_scale: float | None = None
    tokens_per_second: float | None = None
    skipped_updates: int | None = None
    ranks: int | None = None
    ranks_heartbeating: int | None = None
    last_heartbeat: float | None = None
    oldest_heartbeat: float | None = None
    last_record: float | None = None
    finished: bool = False
    checkpoint_time: float | None = None
    checkpoint_step: int | None = None


@dataclass(frozen=True)
class OpenIncident:
    id: int
    run_id: int
    kind: str
    severity: str
    scope: str | None
    opened_at: float


def read_runs(
    connection: Connection, now: float, recent_windows: int, silence_s: float, retention_s: float
) -> list[RunState]:
    """Every run with a record (or created) within ``retention_s`` of ``now``."""
    found = []
    for run_id, name, created_at in connection.execute(sa.select(RUN.c.id, RUN.c.name, RUN.c.created_at)):
        state = _read_run(
            connection, run_id, name, created_at, now, recent_windows, silence_s, now - retention_s
        )
        if state is not None:
            found.append(state)
    return found


def _read_run(
    connection: Connection,
    run_id: int,
    name: str,
    created_at: float,
    now: float,
    recent_windows: int,
    silence_s: float,
    cutoff: float,
) -> RunState | None:
    """The run, or None when nothing of it is newer than ``cutoff``: a run that finished before
    it costs three index lookups, not its heartbeats and checkpoints."""
    recent = _recent_judged(connection, run_id, recent_windows)
    newest = _newest_window(connection, run_id, recent[0] if recent else None)
    incarnation = _current_incarnation(connection, run_id)
    finished_at = incarnation["finished_at"] if incarnation else None
    started_at = incarnation["started_at"] if incarnation else None
    window_time = newest["last_time"] if newest else None
    if finished_at is not None and _newest_of(created_at, finished_at, started_at, window_time) < cutoff:
        return None
    current = incarnation["incarnation"] if incarnation else (newest["incarnation"] if newest else None)
    values: dict[str, Any] = {}
    if current is not None:
        values.update(_heartbeats(connection, run_id, current, now, silence_s))
    last_record = _newest_of(window_time, values.get("last_heartbeat"), started_at)
    if _newest_of(last_record, finished_at, created_at) < cutoff:
        return None
    if recent:
        point = point_from_summary(recent[0], restart=False)
        values.update(loss=point.loss, grad_norm=point.grad_norm, lr=point.lr, loss_scale=point.loss_scale)
        values["tokens_per_second"] = _tokens_per_second(recent)
    if newest is not None:
        values["step"] = newest["step"]
        values["ranks"] = newest["ranks_reported"]
    if current is not None:
        values["skipped_updates"] = _skipped_updates(connection, run_id, current)
    if incarnation is not None:
        values["finished"] = finished_at is not None
        values["ranks"] = incarnation["world_size"] or values.get("ranks")
    values.update(_checkpoint(connection, run_id))
    return RunState(
        id=run_id,
        name=name,
        incarnation=current,
        last_record=None if last_record == -math.inf else last_record,
        **values,
    )


def _newest_of(*moments: float | None) -> float:
    """The latest of the finite moments given; -inf when there is none."""
    return max((m for m in moments if m is not None and math.isfinite(m)), default=-math.inf)


def _recent_judged(connection: Connection, run_id: int, limit: int) -> list[dict[str, Any]]:
    """The newest judged windows, newest first (``ix_step_summaries_run_judged``)."""
    rows = connection.execute(
        sa.select(SUMMARY)
        .where(SUMMARY.c.run_id == run_id, SUMMARY.c.judged.is_(True))
        .order_by(SUMMARY.c.id.desc())
        .limit(limit)
    ).mappings()
    return [dict(row) for row in rows]


def _newest_window(
    connection: Connection, run_id: int, judged: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The newest window, judged or not. Unjudged windows are the few still filling, so this
    asks the index for them alone rather than ordering the run's whole history."""
    row = (
        connection.execute(
            sa.select(SUMMARY)
            .where(SUMMARY.c.run_id == run_id, SUMMARY.c.judged.is_(False))
            .order_by(SUMMARY.c.id.desc())
            .limit(1)
        )
        .mappings()
        .first()
    )
    if row is None or (judged is not None and judged["id"] > row["id"]):
        return judged
    return dict(row)


def _current_incarnation(connection: Connection, run_id: int) -> dict[str, Any] | None:
    """The incarnation that started last (run start records arrive first from every hook)."""
    row = (
        connection.execute(
            sa.select(
                INCARNATION.c.incarnation,
                INCARNATION.c.world_size,
                INCARNATION.c.started_at,
                INCARNATION.c.finished_at,
            )
            .where(INCARNATION.c.run_id == run_id)
            .order_by(INCARNATION.c.id.desc())
            .limit(1)
        )
        .mappings()
        .first()
    )
    return None if row is None else dict(row)


def _tokens_per_second(recent: list[dict[str, Any]]) -> float | None:
    """Tokens of the newest windows of one incarnation over the time they took: the first
    window's tokens are left out, since its start is not known, only its end."""
    same = [r for r in recent if r["incarnation"] == recent[0]["incarnation"]]
    same.sort(key=lambda r: r["attempt"])
    if len(same) < 2 or any(r["tokens"] is None for r in same[1:]):
        return None
    span = float(same[-1]["last_time"] - same[0]["last_time"])
    if not span > 0:
        return None
    return float(sum(r["tokens"] for r in same[1:])) / span


def _heartbeats(
    connection: Connection, run_id: int, incarnation: str, now: float, silence_s: float
) -> dict[str, Any]:
    """One aggregate over the incarnation's heartbeats: one row per rank, however long it runs."""
    heard = sa.case((HEARTBEAT.c.received_at >= now - silence_s, 1), else_=0)
    row = connection.execute(
        sa.select(
            sa.func.max(HEARTBEAT.c.received_at),
            sa.func.min(HEARTBEAT.c.received_at),
            sa.func.coalesce(sa.func.sum(heard), 0),
        ).where(HEARTBEAT.c.run_id == run_id, HEARTBEAT.c.incarnation == incarnation)
    ).one()
    if row[0] is None:
        return {}
    return {"last_heartbeat": row[0], "oldest_heartbeat": row[1], "ranks_heartbeating": int(row[2])}


def _skipped_updates(connection: Connection, run_id: int, incarnation: str) -> int | None:
    """Windows attempted minus updates made, from the incarnation's first and newest windows
    (two lookups on the unique key): ``attempt`` counts windows tried, skipped ones included, and
    ``step`` successful updates, so their difference is the skips without reading every window."""

    def edge(order: Any) -> Any:
        return (
            connection.execute(
                sa.select(SUMMARY.c.attempt, SUMMARY.c.step, SUMMARY.c.skipped_ranks)
                .where(SUMMARY.c.run_id == run_id, SUMMARY.c.incarnation == incarnation)
                .order_by(order)
                .limit(1)
            )
            .mappings()
            .first()
        )

    first, newest = edge(SUMMARY.c.attempt.asc()), edge(SUMMARY.c.attempt.desc())
    if first is None or newest is None:
        return None
    attempted = int(newest["attempt"]) - int(first["attempt"]) + 1
    step_before = int(first["step"]) - (0 if first["skipped_ranks"] else 1)
    return max(0, attempted - (int(newest["step"]) - step_before))


def _checkpoint(connection: Connection, run_id: int) -> dict[str, Any]:
    """The newest resumable checkpoint, as the registry tags ``latest-resumable`` (complete,
    current, not unsafe), except that one not re-checked yet counts when it was reported with
    its manifest: the registry re-reads the files only when a recovery needs a target, and
    between those the age of the newest checkpoint is what an operator watches. A version a
    later save to its path superseded never counts: its files are gone."""
    reported = sa.func.coalesce(sa.cast(CHECKPOINT.c.manifest, sa.Text), "null") != "null"  # JSON null too
    rows = connection.execute(
        sa.select(
            CHECKPOINT.c.id, CHECKPOINT.c.step, CHECKPOINT.c.path, CHECKPOINT.c.time, VALIDATION.c.valid
        )
        .outerjoin(VALIDATION, VALIDATION.c.checkpoint_id == CHECKPOINT.c.id)
        .where(CHECKPOINT.c.run_id == run_id, reported)
    ).all()
    replaced = superseded((r.id, r.path, r.time) for r in rows)
    candidates = tuple(
        CheckpointFacts(key=r.id, step=r.step, path=r.path, valid=r.valid, time=r.time)
        for r in rows
        if r.valid is not False and r.id not in replaced
    )
    unsafe = checkpoints.unsafe_for(connection, run_id, candidates) if candidates else {}
    newest = max((c for c in candidates if c.key not in unsafe), key=lambda c: (c.step, c.time), default=None)
    return {} if newest is None else {"checkpoint_time": newest.time, "checkpoint_step": newest.step}


def read_open_incidents(connection: Connection, run_ids: list[int]) -> list[OpenIncident]:
    """The runs' open incidents, newest first (``ix_incidents_run_status``: closed history is
    not read)."""
    if not run_ids:
        return []
    rows = connection.execute(
        sa.select(
            INCIDENT.c.id,
            INCIDENT.c.run_id,
            INCIDENT.c.kind,
            INCIDENT.c.severity,
            INCIDENT.c.scope,
            INCIDENT.c.opened_at,
        )
        .where(INCIDENT.c.run_id.in_(run_ids), INCIDENT.c.status == "open")
        .order_by(INCIDENT.c.id.desc())
    )
    return [OpenIncident(*row) for row in rows]


def nodes_of_ranks(
    connection: Connection, run_id: int, incarnation: str | None, ranks: list[int]
) -> dict[int, str]:
    """Each rank's node, from its heartbeat (one lookup per rank on the heartbeats' key)."""
    if not ranks or incarnation is None:
        return {}
    rows = connection.execute(
        sa.select(HEARTBEAT.c.rank, HEARTBEAT.c.node).where(
            HEARTBEAT.c.run_id == run_id, HEARTBEAT.c.incarnation == incarnation, HEARTBEAT.c.rank.in_(ranks)
        )
    )
    return {rank: node for rank, node in rows if node is not None}
