"""Findings into incidents, persisted: one incident per fault, grown as evidence arrives.

The grouping rule is pure (``policies.incidents``); this module keeps the store in step
with it. An info-level finding is kept as evidence but opens no incident, and so is a finding in
the windows a carried-out rollback abandoned (past its checkpoint, in the incarnation it
stopped): those are the fault the rollback answered, judged late (the last windows before the
stop can reach the engine after the resume verified and resolved its incident), not a new one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import audit, models
from policies.incidents import RESOLVES, GroupingConfig, extend, matching_incident, open_incident, scope_of
from policies.proposal_lifecycle import ProposalStatus
from policies.types import Finding, IncidentView, Severity

INCIDENT = models.table_of(models.Incident)
FINDING = models.table_of(models.FindingRow)
PROPOSAL = models.table_of(models.Proposal)

# A rollback whose directive is out: the ranks leave its incarnation at the step they stop at.
CARRIED_OUT = (ProposalStatus.EXECUTING.value, ProposalStatus.DONE.value)


@dataclass
class _Open:
    view: IncidentView
    ranks: set[int]
    nodes: set[str]
    devices: set[str]
    dirty: bool = False


class IncidentRecorder:
    def __init__(self, grouping: GroupingConfig, clock: Callable[[], float]) -> None:
        self._grouping = grouping
        self._clock = clock

    def record(
        self, connection: Connection, run_id: int, findings: Sequence[Finding], detected_step: int | None
    ) -> list[int]:
        """Store the findings and attach each to its incident; returns incidents touched."""
        if not findings:
            return []
        now = self._clock()
        opened = self._open_incidents(connection, run_id)
        abandoned = abandoned_spans(connection, run_id)
        touched: list[int] = []
        for finding in findings:
            incident_id = None
            if finding.kind in RESOLVES:
                incident_id = self._resolve(connection, run_id, opened, finding, now)
            elif finding.severity is not Severity.INFO:
                incident_id = self._rolled_back(opened, abandoned, finding)
                if incident_id is None:
                    incident_id = self._attach(connection, run_id, opened, finding, detected_step, now)
                    touched.append(incident_id)
            connection.execute(FINDING.insert(), finding_row(run_id, incident_id, finding, now))
        for key, item in opened.items():
            if item.dirty:
                connection.execute(
                    INCIDENT.update()
                    .where(INCIDENT.c.id == key)
                    .values(
                        kind=item.view.kind,
                        severity=item.view.severity.value,
                        first_step=item.view.first_step,
                        last_step=item.view.last_step,
                        finding_count=item.view.finding_count,
                        ranks=sorted(item.ranks),
                        nodes=sorted(item.nodes),
                        devices=sorted(item.devices),
                        updated_at=now,
                    )
                )
        return sorted(set(touched))

    def _resolve(
        self, connection: Connection, run_id: int, opened: dict[int, _Open], finding: Finding, now: float
    ) -> int | None:
        """Close the open incident this finding says is over (a straggler that recovered)."""
        kind, scope = RESOLVES[finding.kind], scope_of(finding)
        for key, item in list(opened.items()):
            if item.view.kind == kind and item.view.scope == scope:
                close_incident(connection, key, now)
                audit.append(
                    connection,
                    actor="engine",
                    action="incident_resolved",
                    subject=f"incident:{key}",
                    now=now,
                    run_id=run_id,
                    incident_id=key,
                    reason=finding.message,
                )
                del opened[key]
                return key
        return None

    def _rolled_back(
        self, opened: dict[int, _Open], abandoned: dict[str, tuple[int, int]], finding: Finding
    ) -> int | None:
        """The incident a carried-out rollback answered, for a finding in the windows it
        abandoned that no open incident takes (an open one still grows as before)."""
        span = abandoned.get(finding.incarnation or "")
        if span is None or finding.step <= span[0]:
            return None
        if matching_incident(finding, [o.view for o in opened.values()], self._grouping) is not None:
            return None
        return span[1]

    def _open_incidents(self, connection: Connection, run_id: int) -> dict[int, _Open]:
        rows = connection.execute(
            sa.select(INCIDENT).where(INCIDENT.c.run_id == run_id, INCIDENT.c.status == "open")
        ).mappings()
        return {
            row["id"]: _Open(incident_view(row), set(row["ranks"]), set(row["nodes"]), set(row["devices"]))
            for row in rows
        }

    def _attach(
        self,
        connection: Connection,
        run_id: int,
        opened: dict[int, _Open],
        finding: Finding,
        detected_step: int | None,
        now: float,
    ) -> int:
        match = matching_incident(finding, [o.view for o in opened.values()], self._grouping)
        if match is None:
            view = open_incident(0, finding)
            key = int(
                connection.execute(
                    INCIDENT.insert().returning(INCIDENT.c.id),
                    {
                        "run_id": run_id,
                        "kind": view.kind,
                        "severity": view.severity.value,
                        "status": "open",
                        "first_step": view.first_step,
                        "last_step": view.last_step,
                        "incarnation": finding.incarnation,
                        "summary": finding.message,
                        "ranks": [],
                        "nodes": [],
                        "devices": [],
                        "finding_count": 1,
                        "detected_step": detected_step,
                        "scope": view.scope,
                        "opened_at": now,
                        "updated_at": now,
                        "closed_at": None,
                    },
                ).scalar_one()
            )
            opened[key] = _Open(IncidentView(**{**view.__dict__, "key": key}), set(), set(), set())
            audit.append(
                connection,
                actor="engine",
                action="incident_opened",
                subject=f"incident:{key}",
                now=now,
                run_id=run_id,
                incident_id=key,
                reason=finding.message,
                details={
                    "kind": view.kind,
                    "severity": view.severity.value,
                    "first_step": view.first_step,
                    "detected_step": detected_step,
                },
            )
        else:
            key = match.key
            opened[key].view = extend(match, finding)
        item = opened[key]
        item.dirty = True
        if finding.rank is not None:
            item.ranks.add(finding.rank)
        if finding.node is not None:
            item.nodes.add(finding.node)
        if finding.device is not None:
            item.devices.add(finding.device)
        return key


def abandoned_spans(connection: Connection, run_id: int) -> dict[str, tuple[int, int]]:
    """Per incarnation a carried-out rollback stopped: the checkpoint step it rewound to (the
    earliest, if several) and the incident it answered. Windows of that incarnation past that
    step are the history the run abandoned."""
    rows = connection.execute(
        sa.select(INCIDENT.c.incarnation, PROPOSAL.c.target_step, PROPOSAL.c.incident_id)
        .join(INCIDENT, INCIDENT.c.id == PROPOSAL.c.incident_id)
        .where(
            PROPOSAL.c.run_id == run_id,
            PROPOSAL.c.action == "rollback",
            PROPOSAL.c.status.in_(CARRIED_OUT),
            PROPOSAL.c.target_step.is_not(None),
        )
        .order_by(PROPOSAL.c.target_step.desc())
    )
    return {incarnation: (int(step), int(incident)) for incarnation, step, incident in rows}


def incident_view(row: Any) -> IncidentView:
    return IncidentView(
        key=row["id"],
        kind=row["kind"],
        severity=Severity(row["severity"]),
        first_step=row["first_step"],
        last_step=row["last_step"],
        finding_count=row["finding_count"],
        scope=row["scope"],
    )


def finding_row(run_id: int, incident_id: int | None, finding: Finding, now: float) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "incident_id": incident_id,
        "incarnation": finding.incarnation,
        "attempt": finding.attempt,
        "step": finding.step,
        "rank": finding.rank,
        "node": finding.node,
        "device": finding.device,
        "kind": finding.kind,
        "severity": finding.severity.value,
        "signal": finding.signal,
        "value": finding.value,
        "threshold": finding.threshold,
        "message": finding.message,
        "evidence": dict(finding.evidence),
        "created_at": now,
    }


def close_incident(connection: Connection, incident_id: int, now: float, status: str = "resolved") -> None:
    connection.execute(
        INCIDENT.update()
        .where(INCIDENT.c.id == incident_id)
        .values(status=status, closed_at=now, updated_at=now)
    )
