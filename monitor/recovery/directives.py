"""Directives: instructions from the service to a run's hooks, and their acknowledgements.

A hook learns them off its training step, with the answer to each batch it posts or from
``GET /v1/runs/{run}/directives`` when it sent nothing; a directive applies to an incarnation
(or any) and to some ranks (or all), and one for an incarnation that has since restarted is
retired when the next one starts. ``dump_stacks`` acts at once; directives
that must act at one step on every rank name ``act_at_step``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import hook_settings, models
from policies import directive_lifecycle
from policies.directive_lifecycle import DirectiveStatus, Retired
from policies.proposals import act_at_step, current_step

DIRECTIVE = models.table_of(models.Directive)
ACK = models.table_of(models.DirectiveAck)
SUMMARY = models.table_of(models.StepSummary)
INCARNATION = models.table_of(models.Incarnation)

KINDS = ("dump_stacks",)


def create_directive(
    connection: Connection,
    run_id: int,
    kind: str,
    *,
    created_by: str,
    now: float,
    incarnation: str | None = None,
    ranks: Sequence[int] | None = None,
    act_at_step: int | None = None,
    payload: dict[str, Any] | None = None,
    incident_id: int | None = None,
) -> int:
    result = connection.execute(
        DIRECTIVE.insert().returning(DIRECTIVE.c.id),
        {
            "run_id": run_id,
            "kind": kind,
            "incarnation": incarnation,
            "ranks": list(ranks) if ranks is not None else None,
            "act_at_step": act_at_step,
            "payload": payload or {},
            "status": DirectiveStatus.PENDING.value,
            "incident_id": incident_id,
            "created_by": created_by,
            "created_at": now,
        },
    )
    return int(result.scalar_one())


def pending_for(connection: Connection, run_id: int, incarnation: str, rank: int) -> list[dict[str, Any]]:
    """The pending directives this rank of this incarnation has not answered yet."""
    return pending_for_ranks(connection, run_id, incarnation, (rank,))[rank]


def pending_for_ranks(
    connection: Connection, run_id: int, incarnation: str, ranks: Sequence[int]
) -> dict[int, list[dict[str, Any]]]:
    """``pending_for`` for several ranks of one incarnation (a node relay's batch) in two reads
    at most: the pending directives, then, only when there are some, those ranks' answers."""
    rows = connection.execute(_PENDING, {"run_id": run_id, "incarnation": incarnation}).mappings().all()
    answered: set[tuple[int, int]] = set()
    if rows:
        asked = {
            "run_id": run_id,
            "incarnation": incarnation,
            "ranks": sorted(set(ranks)),
            "ids": [row["id"] for row in rows],
        }
        answered = {(int(row.rank), int(row.directive_id)) for row in connection.execute(_ANSWERED, asked)}
    return {
        rank: [
            directive_view(row)
            for row in rows
            if (rank, row["id"]) not in answered and (row["ranks"] is None or rank in row["ranks"])
        ]
        for rank in ranks
    }


# Built once: every batch that asks for its ranks' directives reads them, and a statement built
# per call cost SQLAlchemy its construction and cache key each time (9% of a post's service time
# in a profile of the fleet benchmark).
_PENDING = (
    sa.select(DIRECTIVE)
    .where(
        DIRECTIVE.c.run_id == sa.bindparam("run_id"),
        DIRECTIVE.c.status == DirectiveStatus.PENDING.value,
        sa.or_(DIRECTIVE.c.incarnation.is_(None), DIRECTIVE.c.incarnation == sa.bindparam("incarnation")),
    )
    .order_by(DIRECTIVE.c.id)
)
_ANSWERED = sa.select(ACK.c.rank, ACK.c.directive_id).where(
    ACK.c.run_id == sa.bindparam("run_id"),
    ACK.c.incarnation == sa.bindparam("incarnation"),
    ACK.c.rank.in_(sa.bindparam("ranks", expanding=True)),
    ACK.c.directive_id.in_(sa.bindparam("ids", expanding=True)),
)


def directive_view(row: Any) -> dict[str, Any]:
    return {
        "id": row["id"],
        "kind": row["kind"],
        "incarnation": row["incarnation"],
        "ranks": row["ranks"],
        "act_at_step": row["act_at_step"],
        "payload": row["payload"],
        "status": row["status"],
        "incident": row["incident_id"],
        "created_by": row["created_by"],
        "created_at": row["created_at"],
    }


def retire_older_incarnations(connection: Connection, run_id: int, started_at: float) -> int:
    """A new incarnation started at ``started_at``: directives still pending for incarnations
    that started before it can never be answered (their ranks are gone) and are marked
    superseded, as a reissued directive is. Run-wide ones (no incarnation) stay pending."""
    older = sa.select(INCARNATION.c.incarnation).where(
        INCARNATION.c.run_id == run_id, INCARNATION.c.started_at < started_at
    )
    retired = connection.execute(
        DIRECTIVE.update()
        .where(
            DIRECTIVE.c.run_id == run_id,
            DIRECTIVE.c.status.in_([status.value for status in directive_lifecycle.OPEN]),
            DIRECTIVE.c.incarnation.in_(older),
        )
        .values(status=directive_lifecycle.outcome(Retired).value)
    )
    return int(retired.rowcount or 0)


def has_pending(connection: Connection, run_id: int, kind: str, incident_id: int | None) -> bool:
    query = sa.select(DIRECTIVE.c.id).where(
        DIRECTIVE.c.run_id == run_id,
        DIRECTIVE.c.kind == kind,
        DIRECTIVE.c.status == DirectiveStatus.PENDING.value,
    )
    if incident_id is not None:
        query = query.where(DIRECTIVE.c.incident_id == incident_id)
    return connection.execute(query.limit(1)).first() is not None


def directive_step(
    connection: Connection,
    run_id: int,
    default_poll_s: float,
    margin: float,
    after_step: int = 0,
    now: float | None = None,
) -> int:
    """The step at which every rank of a run acts: ahead of where the ranks are now (the newest
    reported step moved on by the time since, when ``now`` is given) by the polling delay (the
    hooks state their poll and flush intervals in the run-start config; ``default_poll_s``
    otherwise), measured in the run's own step time. The ranks act at their first agreement on
    it at or after that step (``collectors.directives``: within two agreement periods of the
    last rank arming it)."""
    newest = connection.execute(
        sa.select(SUMMARY.c.step, SUMMARY.c.last_time)
        .where(SUMMARY.c.run_id == run_id)
        .order_by(SUMMARY.c.last_time.desc())  # the newest window: after a rollback, not the
        .limit(1)  # abandoned timeline's higher steps
    ).first()
    times = sorted(
        connection.execute(
            sa.select(SUMMARY.c.last_time)
            .where(SUMMARY.c.run_id == run_id)
            .order_by(SUMMARY.c.id.desc())
            .limit(50)
        ).scalars()
    )
    gaps = [b - a for a, b in pairwise(times) if b > a]
    config = connection.execute(
        sa.select(INCARNATION.c.config)
        .where(INCARNATION.c.run_id == run_id, INCARNATION.c.config.is_not(None))
        .order_by(INCARNATION.c.id.desc())
        .limit(1)
    ).scalar()
    poll_s = hook_settings.stated(config, "directive_poll_s") or default_poll_s
    flush_s = hook_settings.stated(config, "flush_s") or default_poll_s
    step_time = statistics.median(gaps) if gaps else 0.0
    highest = int(newest.step) if newest is not None else 0
    reported_at = float(newest.last_time) if newest is not None else None
    now_step = current_step(highest, reported_at, now, step_time, max_lag_s=flush_s + poll_s)
    return act_at_step(max(now_step, after_step), step_time, poll_s, margin)
