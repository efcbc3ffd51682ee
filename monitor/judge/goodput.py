"""A run's goodput and checkpoint interval advice, read from the store (``policies.goodput``,
``policies.checkpoint_interval``).

The windows are one rank's: the lowest rank that reported in each incarnation (ranks of a
data-parallel job end each window together, at its all-reduce). Reading them is one index range
per incarnation (the step records' unique key starts with run, incarnation, rank), so the cost
follows the run's windows, not its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.judge.resumes import started_by_rollback
from monitor.judge.saves import measured_save
from monitor.store import models
from policies.async_checkpoints import ASYNC_TAG, STAGING_S
from policies.checkpoint_interval import IntervalAdvice, IntervalConfig, advise
from policies.goodput import Goodput, GoodputFacts, Life, Span, Stall, Window, goodput
from policies.hangs import HangConfig

INCARNATION = models.table_of(models.Incarnation)
STEP = models.table_of(models.StepRecord)
HEARTBEAT = models.table_of(models.Heartbeat)
CHECKPOINT = models.table_of(models.CheckpointEvent)
CANARY = models.table_of(models.CanaryResult)
INCIDENT = models.table_of(models.Incident)
DIRECTIVE = models.table_of(models.Directive)
ACK = models.table_of(models.DirectiveAck)
AUDIT = models.table_of(models.AuditEntry)


@dataclass(frozen=True)
class Delivery:
    """How the reporting rank's windows reached the store: the monitor's own outages show here,
    not as badput (the ranks train on while the service is down)."""

    late_windows: int
    latest_s: float
    threshold_s: float


@dataclass(frozen=True)
class RunGoodput:
    goodput: Goodput
    advice: IntervalAdvice
    delivery: Delivery
    incarnations: int


def run_goodput(connection: Connection, run_id: int, config: IntervalConfig, hangs: HangConfig) -> RunGoodput:
    lives, save_times, delivery = _lives(connection, run_id, hangs)
    facts = GoodputFacts(
        lives=tuple(lives),
        checkpoints=tuple(_checkpoints(connection, run_id)),
        canaries=tuple(_canaries(connection, run_id)),
        holds=tuple(_holds(connection, run_id)),
        hang_detections=_hangs(connection, run_id),
    )
    found = goodput(facts)
    advice = advise(found.save_costs_s, save_times, found.wall_s, found.interruptions, config)
    return RunGoodput(found, advice, delivery, len(lives))


def _lives(
    connection: Connection, run_id: int, hangs: HangConfig
) -> tuple[list[Life], list[list[float]], Delivery]:
    rows = connection.execute(
        sa.select(INCARNATION.c.incarnation, INCARNATION.c.started_at, INCARNATION.c.finished_at,
                  INCARNATION.c.config)
        .where(INCARNATION.c.run_id == run_id, INCARNATION.c.started_at.is_not(None))
        .order_by(INCARNATION.c.started_at)
    ).all()  # fmt: skip
    lives: list[Life] = []
    save_times: list[list[float]] = []
    late, latest, threshold = 0, 0.0, 0.0
    for row in rows:
        windows, received = _windows(connection, run_id, row.incarnation)
        # Later than the hang rule's silence bound: the hook held the window back (spooled).
        threshold = hangs.silence_s(((row.config or {}).get("runhealth_hook") or {}).get("heartbeat_s"))
        for window, at in zip(windows, received, strict=True):
            lateness = at - window.time
            late += int(lateness > threshold)
            latest = max(latest, lateness)
        last_heartbeat = connection.execute(
            sa.select(sa.func.max(HEARTBEAT.c.time)).where(
                HEARTBEAT.c.run_id == run_id, HEARTBEAT.c.incarnation == row.incarnation
            )
        ).scalar()
        signs = [float(row.started_at), *(w.time for w in windows[-1:])]
        ended = (
            float(row.finished_at) if row.finished_at is not None else max([*signs, last_heartbeat or 0.0])
        )
        lives.append(
            Life(
                row.incarnation,
                float(row.started_at),
                ended,
                tuple(windows),
                by_rollback=started_by_rollback(connection, run_id, row.incarnation),
            )
        )
        save_times.append(_save_times(connection, run_id, row.incarnation))
    return lives, save_times, Delivery(late, latest, threshold)


def _windows(connection: Connection, run_id: int, incarnation: str) -> tuple[list[Window], list[float]]:
    rank = connection.execute(
        sa.select(sa.func.min(STEP.c.rank)).where(STEP.c.run_id == run_id, STEP.c.incarnation == incarnation)
    ).scalar()
    if rank is None:
        return [], []
    rows = connection.execute(
        sa.select(STEP.c.step, STEP.c.time, STEP.c.data_wait_s, STEP.c.received_at)
        .where(STEP.c.run_id == run_id, STEP.c.incarnation == incarnation, STEP.c.rank == rank)
        .order_by(STEP.c.attempt)
    ).all()
    windows = [Window(int(r.step), float(r.time), _finite(r.data_wait_s)) for r in rows]
    return windows, [float(r.received_at) for r in rows]


def _finite(value: float | None) -> float | None:
    return value if value is not None and value == value and value >= 0 else None


def _save_times(connection: Connection, run_id: int, incarnation: str) -> list[float]:
    rows = connection.execute(
        sa.select(sa.func.max(CHECKPOINT.c.time))
        .where(CHECKPOINT.c.run_id == run_id, CHECKPOINT.c.incarnation == incarnation)
        .group_by(CHECKPOINT.c.step)
        .order_by(sa.func.max(CHECKPOINT.c.time))
    ).all()
    return [float(time) for (time,) in rows]


def _checkpoints(connection: Connection, run_id: int) -> list[Stall]:
    """Each checkpoint (all its ranks' records) as the stall it made: where the hook timed the
    save (``rh.checkpoint_saving`` to ``checkpoint_saved``), that long before its publication, or
    for an asynchronous one only its staging (training goes on while it is stored); otherwise
    from the end of the window before it to its publication."""
    rows = connection.execute(
        sa.select(CHECKPOINT.c.incarnation, CHECKPOINT.c.step, CHECKPOINT.c.time, CHECKPOINT.c.metrics,
                  CHECKPOINT.c.tags)
        .where(CHECKPOINT.c.run_id == run_id)
    ).all()  # fmt: skip
    stalls: dict[tuple[str, int], Stall] = {}
    for row in rows:
        stall = _stall(row.incarnation, float(row.time), row.metrics, row.tags)
        known = stalls.get((row.incarnation, row.step))
        if known is None or stall.end > known.end:  # the last rank's publication
            stalls[(row.incarnation, row.step)] = stall
    return list(stalls.values())


def _stall(incarnation: str, published: float, metrics: Any, tags: Any) -> Stall:
    save = measured_save(metrics)
    staging = (metrics or {}).get(STAGING_S)
    if save is None:
        return Stall(incarnation, published)
    if ASYNC_TAG in (tags or ()) and isinstance(staging, int | float) and 0 <= staging <= save:
        return Stall(incarnation, published - save + float(staging), float(staging))
    return Stall(incarnation, published, save)


def _canaries(connection: Connection, run_id: int) -> list[Stall]:
    """Each canary round (one step of one incarnation): as long as its slowest rank's run."""
    rows = connection.execute(
        sa.select(CANARY.c.incarnation, sa.func.max(CANARY.c.time), sa.func.max(CANARY.c.seconds))
        .where(CANARY.c.run_id == run_id)
        .group_by(CANARY.c.incarnation, CANARY.c.step)
    ).all()
    return [Stall(incarnation, float(end), float(seconds)) for incarnation, end, seconds in rows]


def _holds(connection: Connection, run_id: int) -> list[Span]:
    """From the first rank acting on a hold (its acknowledgement) to its release (the audit log),
    or for ever when it was never released (a rollback stopped the held ranks)."""
    holds = connection.execute(
        sa.select(DIRECTIVE.c.id, DIRECTIVE.c.incarnation).where(
            DIRECTIVE.c.run_id == run_id, DIRECTIVE.c.kind == "hold"
        )
    ).all()
    spans = []
    for hold_id, incarnation in holds:
        acted = connection.execute(
            sa.select(sa.func.min(ACK.c.time)).where(
                ACK.c.run_id == run_id, ACK.c.directive_id == hold_id, ACK.c.status == "done"
            )
        ).scalar()
        released = connection.execute(
            sa.select(sa.func.min(AUDIT.c.time)).where(
                AUDIT.c.run_id == run_id,
                AUDIT.c.action == "hold_released",
                AUDIT.c.subject == f"directive:{hold_id}",
            )
        ).scalar()
        if acted is None:
            continue  # no rank held: the run trained on
        spans.append(
            Span(incarnation or "", float(acted), float("inf") if released is None else float(released))
        )
    return spans


def _hangs(connection: Connection, run_id: int) -> dict[str, float]:
    rows = connection.execute(
        sa.select(INCIDENT.c.incarnation, sa.func.min(INCIDENT.c.opened_at))
        .where(INCIDENT.c.run_id == run_id, INCIDENT.c.kind == "hang")
        .group_by(INCIDENT.c.incarnation)
    ).all()
    return {incarnation: float(opened) for incarnation, opened in rows}


def document(found: RunGoodput) -> dict[str, Any]:
    """The report as one JSON document (``runhealth goodput --json``)."""
    result = found.goodput
    wall = result.wall_s
    advice = found.advice
    return {
        "wall_s": wall,
        "incarnations": found.incarnations,
        "interruptions": result.interruptions,
        "goodput_ratio": result.ratio,
        "categories": [
            {
                "cause": c.cause.value,
                "label": c.label,
                "seconds": c.seconds,
                "share": None if c.seconds is None or wall <= 0 else c.seconds / wall,
                "how": c.how,
            }
            for c in result.categories
        ],
        "monitoring": {
            "late_windows": found.delivery.late_windows,
            "latest_s": found.delivery.latest_s,
            "late_threshold_s": found.delivery.threshold_s,
            "note": "windows the hook held back (spooled while the service was unreachable): the "
            "ranks trained on, so the monitor's outage is not badput",
        },
        "interval": {
            "save_cost_s": advice.save_cost_s,
            "mtbi_s": advice.mtbi_s,
            "mtbi_source": advice.mtbi_source,
            "current": None if advice.current is None else vars(advice.current),
            "advised": None if advice.advised is None else vars(advice.advised),
            "arithmetic": list(advice.arithmetic),
        },
    }
