"""The restart-loop guard over a run's incarnations (``policies.restart_loop``): judged when an
incarnation starts or finishes, from what the store says each one committed."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import models
from policies.restart_loop import KIND, Life, RestartLoopConfig, restart_loop, restart_loop_ended
from policies.types import Finding

INCARNATION = models.table_of(models.Incarnation)
CHECKPOINT = models.table_of(models.CheckpointEvent)
SUMMARY = models.table_of(models.StepSummary)
INCIDENT = models.table_of(models.Incident)


def lives(connection: Connection, run_id: int) -> list[Life]:
    """Each incarnation: when it started, whether it ended without completing, the newest
    checkpoint it committed (a record with its manifest) and its last step."""
    rows = connection.execute(
        sa.select(INCARNATION.c.incarnation, INCARNATION.c.started_at, INCARNATION.c.finish_status)
        .where(INCARNATION.c.run_id == run_id, INCARNATION.c.started_at.is_not(None))
        .order_by(INCARNATION.c.started_at)
    ).all()
    saved = dict(
        connection.execute(
            sa.select(CHECKPOINT.c.incarnation, sa.func.max(CHECKPOINT.c.step))
            .where(CHECKPOINT.c.run_id == run_id, CHECKPOINT.c.manifest.is_not(None))
            .group_by(CHECKPOINT.c.incarnation)
        ).all()
    )
    # From the per-window summaries, which retention keeps (raw step records go after
    # ``retention.raw_days``; a run's old incarnations are still part of its restart history).
    reached = dict(
        connection.execute(
            sa.select(SUMMARY.c.incarnation, sa.func.max(SUMMARY.c.step))
            .where(SUMMARY.c.run_id == run_id)
            .group_by(SUMMARY.c.incarnation)
        ).all()
    )
    return [
        Life(
            incarnation=row.incarnation,
            started_at=float(row.started_at),
            # Failed or stopped, or superseded by the next start with no finish at all (a crash
            # sends none). A completed start is the job ending as meant, never part of a loop.
            ended=row.finish_status in ("failed", "stopped")
            or (row.finish_status is None and index < len(rows) - 1),
            newest_checkpoint=saved.get(row.incarnation),
            last_step=reached.get(row.incarnation),
        )
        for index, row in enumerate(rows)
    ]


def judge_restarts(connection: Connection, run_id: int, config: RestartLoopConfig) -> list[Finding]:
    """A ``restart_loop`` finding while the streak is at its bound, or the note that ends an
    open one once a start made progress."""
    found = lives(connection, run_id)
    finding = restart_loop(found, config)
    if finding is not None:
        return [finding]
    open_loop = connection.execute(
        sa.select(INCIDENT.c.id).where(
            INCIDENT.c.run_id == run_id, INCIDENT.c.kind == KIND, INCIDENT.c.status == "open"
        )
    ).first()
    return [restart_loop_ended(found)] if open_loop is not None else []
