"""Batch arithmetic on resume (``policies.batch_size``): each incarnation's batch against the one
before it, once the new one has judged enough windows.

An incarnation's batch comes from its run-start record (world size, the parallel layout's sizes,
what the trainer declared: micro batch, accumulation, the schedule's unit) and the lowest rank's
step records (microbatches per window: K as the hook counted them; the consumed count's steps:
examples per update), with the run's tokens per update from the judged window summaries: the
earlier incarnation's last windows, the later one's first.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import models
from policies.batch_size import KIND, BatchConfig, BatchShape, batch_change, declared
from policies.types import Finding

INCARNATION = models.table_of(models.Incarnation)
STEP = models.table_of(models.StepRecord)
SUMMARY = models.table_of(models.StepSummary)
FINDING = models.table_of(models.FindingRow)


def judge_batch(
    connection: Connection, run_id: int, incarnation: str, config: BatchConfig
) -> list[Finding] | None:
    """The batch finding for this incarnation against the one before it: ``[]`` when nothing
    changed (or there is nothing before it), ``None`` while it has too few judged windows."""
    rows = connection.execute(
        sa.select(INCARNATION).where(INCARNATION.c.run_id == run_id, INCARNATION.c.started_at.is_not(None))
        .order_by(INCARNATION.c.started_at)
    ).mappings().all()  # fmt: skip
    index = next((i for i, row in enumerate(rows) if row["incarnation"] == incarnation), None)
    if index is None:
        return None  # its run-start record has not arrived yet
    after = _shape(connection, run_id, rows[index], config.windows, newest=False)
    if after is None:
        return None
    before = next(
        (
            shape
            for row in reversed(rows[:index])
            if (shape := _shape(connection, run_id, row, config.windows, newest=True)) is not None
        ),
        None,
    )
    if before is None or _already(connection, run_id, incarnation):
        return []
    finding = batch_change(before, after, config)
    return [] if finding is None else [finding]


def _already(connection: Connection, run_id: int, incarnation: str) -> bool:
    """A finding stored for it already (the service restarted since)."""
    found = connection.execute(
        sa.select(FINDING.c.id)
        .where(FINDING.c.run_id == run_id, FINDING.c.incarnation == incarnation, FINDING.c.kind == KIND)
        .limit(1)
    ).first()
    return found is not None


def _shape(connection: Connection, run_id: int, row: Any, windows: int, *, newest: bool) -> BatchShape | None:
    """The incarnation's batch over its first (or newest) ``windows`` judged windows; None
    until it has that many."""
    order = SUMMARY.c.attempt.desc() if newest else SUMMARY.c.attempt
    summaries = connection.execute(
        sa.select(SUMMARY.c.attempt, SUMMARY.c.step, SUMMARY.c.tokens)
        .where(
            SUMMARY.c.run_id == run_id,
            SUMMARY.c.incarnation == row["incarnation"],
            SUMMARY.c.judged.is_(True),
        )
        .order_by(order)
        .limit(windows)
    ).all()
    if len(summaries) < windows:
        return None
    attempts = sorted(s.attempt for s in summaries)
    rank = connection.execute(
        sa.select(sa.func.min(STEP.c.rank)).where(
            STEP.c.run_id == run_id, STEP.c.incarnation == row["incarnation"]
        )
    ).scalar()
    records = connection.execute(
        sa.select(STEP.c.attempt, STEP.c.microbatches, STEP.c.consumed)
        .where(
            STEP.c.run_id == run_id,
            STEP.c.incarnation == row["incarnation"],
            STEP.c.rank == rank,
            STEP.c.attempt.between(attempts[0], attempts[-1]),
        )
        .order_by(STEP.c.attempt)
    ).all()
    tokens = [float(s.tokens) for s in summaries if s.tokens is not None]
    layout = row["layout"] or {}
    micro, declared_k, unit = declared(row["config"])
    counted = Counter(r.microbatches for r in records if r.microbatches)
    tokens_median = statistics.median(tokens) if tokens else None
    return BatchShape(
        incarnation=row["incarnation"],
        world_size=row["world_size"],
        tp=_size(layout, "tp"),
        pp=_size(layout, "pp"),
        cp=_size(layout, "cp"),
        accumulation=counted.most_common(1)[0][0] if counted else declared_k,
        micro_batch=micro,
        examples_per_update=_examples_per_update(records),
        tokens_per_update=tokens_median,
        tokens_spread=statistics.median(abs(t - tokens_median) for t in tokens) if tokens_median else 0.0,
        schedule_unit=unit,
        first_step=min(s.step for s in summaries),
    )


def _size(layout: Any, name: str) -> int:
    value = layout.get(name) if isinstance(layout, dict) else None
    return value if isinstance(value, int) and value >= 1 else 1


def _examples_per_update(records: Any) -> int | None:
    """The most common step of the consumed count between consecutive windows."""
    steps = Counter(
        b.consumed - a.consumed
        for a, b in itertools.pairwise(records)
        if a.consumed is not None and b.consumed is not None and b.attempt == a.attempt + 1
        and b.consumed > a.consumed
    )  # fmt: skip
    return steps.most_common(1)[0][0] if steps else None
