"""Reads shared by the API and the CLI. Each returns plain dicts, ready to print as JSON."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import models
from monitor.store.tokens import new_token, token_digest

RUN = models.table_of(models.Run)
SUMMARY = models.table_of(models.StepSummary)
INCIDENT = models.table_of(models.Incident)
FINDING = models.table_of(models.FindingRow)
STEP = models.table_of(models.StepRecord)
INCARNATION = models.table_of(models.Incarnation)
PROPOSAL = models.table_of(models.Proposal)


class NotFound(LookupError):
    pass


class AlreadyExists(Exception):
    pass


def create_run(connection: Connection, name: str, now: float | None = None) -> str:
    """Create a run; return its bearer token (shown once: only a digest is kept)."""
    if connection.execute(sa.select(RUN.c.id).where(RUN.c.name == name)).first() is not None:
        raise AlreadyExists(f"run {name!r} already exists")
    token = new_token("rh_run")
    connection.execute(
        RUN.insert(),
        {"name": name, "token_hash": token_digest(token), "created_at": now or time.time()},
    )
    return token


def renew_run_token(connection: Connection, name: str) -> str:
    """Replace a run's bearer token (a restarted job's embedded service: the first token was
    shown once, to the previous start); the old one is refused from now on."""
    token = new_token("rh_run")
    updated = connection.execute(
        RUN.update().where(RUN.c.name == name).values(token_hash=token_digest(token))
    ).rowcount
    if not updated:
        raise NotFound(f"no run named {name!r}")
    return token


# Built once: every batch's token is checked with it, and a statement built per call costs
# SQLAlchemy its construction and cache key again each time.
_RUN_BY_NAME = sa.select(RUN).where(RUN.c.name == sa.bindparam("name"))


def run_row(connection: Connection, name: str) -> Any:
    row = connection.execute(_RUN_BY_NAME, {"name": name}).first()
    if row is None:
        raise NotFound(f"no run named {name!r}")
    return row


def run_ids(connection: Connection) -> list[int]:
    """Every run's id, oldest first."""
    return [int(run_id) for run_id in connection.execute(sa.select(RUN.c.id).order_by(RUN.c.id)).scalars()]


def run_names(connection: Connection, ids: Iterable[int]) -> list[str]:
    """The names of the runs ``ids``, by id."""
    wanted = sorted(ids)
    if not wanted:
        return []
    return list(
        connection.execute(sa.select(RUN.c.name).where(RUN.c.id.in_(wanted)).order_by(RUN.c.id)).scalars()
    )


def newest_world_size(connection: Connection, run_id: int) -> int | None:
    """The world size the run's newest incarnation with a run-start record declared."""
    world = connection.execute(
        sa.select(INCARNATION.c.world_size)
        .where(INCARNATION.c.run_id == run_id, INCARNATION.c.world_size.is_not(None))
        .order_by(INCARNATION.c.id.desc())
        .limit(1)
    ).scalar()
    return int(world) if world else None


def list_runs(connection: Connection) -> list[dict[str, Any]]:
    latest = (
        sa.select(
            SUMMARY.c.run_id,
            sa.func.max(SUMMARY.c.step).label("latest_step"),
            sa.func.count().label("windows"),
            sa.func.max(SUMMARY.c.last_time).label("last_record_at"),
        )
        .group_by(SUMMARY.c.run_id)
        .subquery()
    )
    open_incidents = (
        sa.select(INCIDENT.c.run_id, sa.func.count().label("open_incidents"))
        .where(INCIDENT.c.status == "open")
        .group_by(INCIDENT.c.run_id)
        .subquery()
    )
    query = (
        sa.select(
            RUN.c.name,
            RUN.c.created_at,
            latest.c.latest_step,
            latest.c.windows,
            latest.c.last_record_at,
            sa.func.coalesce(open_incidents.c.open_incidents, 0).label("open_incidents"),
        )
        .outerjoin(latest, latest.c.run_id == RUN.c.id)
        .outerjoin(open_incidents, open_incidents.c.run_id == RUN.c.id)
        .order_by(RUN.c.created_at)
    )
    return [dict(row) for row in connection.execute(query).mappings()]


def list_steps(
    connection: Connection, run_id: int, start: int | None, end: int | None, limit: int
) -> list[dict[str, Any]]:
    query = sa.select(SUMMARY).where(SUMMARY.c.run_id == run_id)
    if start is not None:
        query = query.where(SUMMARY.c.step >= start)
    if end is not None:
        query = query.where(SUMMARY.c.step <= end)
    rows = connection.execute(query.order_by(SUMMARY.c.id).limit(limit)).mappings()
    return [_step_view(row) for row in rows]


def _step_view(row: Any) -> dict[str, Any]:
    tokens, loss_sum = row["tokens"], row["loss_sum"]
    reported = row["reported_loss_sum"] / row["reported_loss_count"] if row["reported_loss_count"] else None
    return {
        "incarnation": row["incarnation"],
        "attempt": row["attempt"],
        "step": row["step"],
        "ranks": row["ranks_reported"],
        "tokens": tokens,
        "loss": loss_sum / tokens if tokens and loss_sum is not None else reported,
        "reported_loss": reported,
        "grad_norm": row["grad_norm"],
        "lr": row["lr"],
        "loss_scale": row["loss_scale"],
        "skipped_ranks": row["skipped_ranks"],
        "consumed": row["consumed"],
        "time": row["last_time"],
        "judged": row["judged"],
    }


@dataclass(frozen=True)
class IncidentFilter:
    run: str | None = None
    kind: str | None = None
    severity: str | None = None
    status: str | None = None
    node: str | None = None
    since: float | None = None
    until: float | None = None


def list_incidents(connection: Connection, where: IncidentFilter, limit: int = 1000) -> list[dict[str, Any]]:
    query = sa.select(INCIDENT, RUN.c.name.label("run")).join(RUN, RUN.c.id == INCIDENT.c.run_id)
    if where.run is not None:
        query = query.where(RUN.c.name == where.run)
    if where.kind is not None:
        query = query.where(INCIDENT.c.kind == where.kind)
    if where.severity is not None:
        query = query.where(INCIDENT.c.severity == where.severity)
    if where.status is not None:
        query = query.where(INCIDENT.c.status == where.status)
    if where.since is not None:
        query = query.where(INCIDENT.c.opened_at >= where.since)
    if where.until is not None:
        query = query.where(INCIDENT.c.opened_at <= where.until)
    rows = [incident_document(row) for row in connection.execute(query.order_by(INCIDENT.c.id)).mappings()]
    if where.node is not None:
        # Nodes are a small JSON list per incident; filtering here keeps the query portable.
        rows = [row for row in rows if where.node in row["nodes"]]
    return rows[:limit]


def incident_document(row: Any) -> dict[str, Any]:
    return {
        "id": row["id"],
        "run": row["run"],
        "kind": row["kind"],
        "severity": row["severity"],
        "status": row["status"],
        "first_step": row["first_step"],
        "last_step": row["last_step"],
        "incarnation": row["incarnation"],
        "summary": row["summary"],
        "ranks": row["ranks"],
        "nodes": row["nodes"],
        "devices": row["devices"],
        "findings": row["finding_count"],
        "opened_at": row["opened_at"],
        "updated_at": row["updated_at"],
        "closed_at": row["closed_at"],
    }


def get_incident(connection: Connection, incident_id: int) -> dict[str, Any]:
    row = (
        connection.execute(
            sa.select(INCIDENT, RUN.c.name.label("run"))
            .join(RUN, RUN.c.id == INCIDENT.c.run_id)
            .where(INCIDENT.c.id == incident_id)
        )
        .mappings()
        .first()
    )
    if row is None:
        raise NotFound(f"no incident {incident_id}")
    from monitor.store import audit

    incident = incident_document(row)
    incident["evidence"] = list_findings(connection, row["run_id"], incident_id=incident_id)
    incident["proposals"] = [
        p for p in list_proposals(connection, run=row["run"]) if p["incident"] == incident_id
    ]
    incident["story"] = audit.story(connection, incident_id)
    return incident


def list_proposals(
    connection: Connection, run: str | None = None, status: str | None = None
) -> list[dict[str, Any]]:
    query = sa.select(PROPOSAL, RUN.c.name.label("run")).join(RUN, RUN.c.id == PROPOSAL.c.run_id)
    if run is not None:
        query = query.where(RUN.c.name == run)
    if status is not None:
        query = query.where(PROPOSAL.c.status == status)
    return [proposal_view(row) for row in connection.execute(query.order_by(PROPOSAL.c.id)).mappings()]


def proposal_view(row: Any) -> dict[str, Any]:
    return {
        "id": row["id"],
        "run": row["run"],
        "incident": row["incident_id"],
        "action": row["action"],
        "status": row["status"],
        "target": {
            "checkpoint": row["checkpoint_id"],
            "step": row["target_step"],
            "path": row["target_path"],
        },
        "data_action": row["data_action"],
        "skip_batches": row["skip_batches"],
        "quarantine": {"node": row["quarantine_node"], "device": row["quarantine_device"]},
        "verdict": row["verdict"],
        "cost_steps": row["cost_steps"],
        "evidence": row["evidence"],
        "created_at": row["created_at"],
        "decided_by": row["decided_by"],
        "decided_at": row["decided_at"],
        "reason": row["decision_reason"],
        "directive": row["directive_id"],
    }


def list_findings(
    connection: Connection, run_id: int, incident_id: int | None = None, limit: int = 10_000
) -> list[dict[str, Any]]:
    query = sa.select(FINDING).where(FINDING.c.run_id == run_id)
    if incident_id is not None:
        query = query.where(FINDING.c.incident_id == incident_id)
    rows = connection.execute(query.order_by(FINDING.c.id).limit(limit)).mappings()
    return [finding_view(row) for row in rows]


def finding_view(row: Any) -> dict[str, Any]:
    return {
        "id": row["id"],
        "incident": row["incident_id"],
        "step": row["step"],
        "attempt": row["attempt"],
        "incarnation": row["incarnation"],
        "rank": row["rank"],
        "kind": row["kind"],
        "severity": row["severity"],
        "signal": row["signal"],
        "value": row["value"],
        "threshold": row["threshold"],
        "message": row["message"],
        "evidence": row["evidence"],
    }


def step_record_columns() -> Sequence[str]:
    return [c.name for c in STEP.columns if c.name not in ("id", "run_id", "content_hash")]


def step_records(connection: Connection, run_id: int) -> list[dict[str, Any]]:
    query = (
        sa.select(*[STEP.c[name] for name in step_record_columns()])
        .where(STEP.c.run_id == run_id)
        .order_by(STEP.c.incarnation, STEP.c.attempt, STEP.c.rank)
    )
    return [dict(row) for row in connection.execute(query).mappings()]
