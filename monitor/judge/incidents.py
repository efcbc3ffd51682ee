"""Findings into incidents, persisted: one incident per fault, grown as evidence arrives.

The grouping rule is pure (``policies.incidents``); this module keeps the store in step
with it. An info-level finding is kept as evidence but opens no incident, and so is a finding in
the windows a rollback abandoned (in the incarnation its ranks stopped, past its checkpoint, up
to the step they acknowledged stopping at): those are the fault the rollback answered, judged
late (the last windows before the stop can reach the engine after the resume verified), not a
new one and not a reason to propose again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import audit, models
from monitor.store.locks import lock_run_incidents
from policies.incidents import RESOLVES, GroupingConfig, extend, matching_incident, open_incident, scope_of
from policies.types import Finding, IncidentView, Severity

INCIDENT = models.table_of(models.Incident)
FINDING = models.table_of(models.FindingRow)
PROPOSAL = models.table_of(models.Proposal)
ACK = models.table_of(models.DirectiveAck)


@dataclass(frozen=True)
class Abandoned:
    """Windows a rollback left: steps after ``checkpoint_step``, up to ``stopped_at``."""

    checkpoint_step: int
    stopped_at: int
    incident: int

    def holds(self, step: int) -> bool:
        return self.checkpoint_step < step <= self.stopped_at


@dataclass
class _Open:
    view: IncidentView
    ranks: set[int]
    nodes: set[str]
    devices: set[str]
    dirty: bool = False
    summary: str | None = None
    """The finding that refined the incident's kind, when one did: its message is the summary."""


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
        lock_run_incidents(connection, run_id)  # before reading them: see its docstring
        now = self._clock()
        opened = self._open_incidents(connection, run_id)
        abandoned = abandoned_spans(connection, run_id)
        touched: list[int] = []
        for finding in findings:
            incident_id = None
            if finding.kind in RESOLVES:
                incident_id = self._resolve(connection, run_id, opened, finding, now)
            elif finding.severity is not Severity.INFO:
                incident_id = self._rolled_back(abandoned, finding)
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
                        **({} if item.summary is None else {"summary": item.summary}),
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

    def _rolled_back(self, abandoned: dict[str, list[Abandoned]], finding: Finding) -> int | None:
        """The incident a rollback answered, for a finding in the windows it abandoned. Only
        evidence: the incident is not grown or touched, whether or not its resume verified yet,
        so the decision workflow is not asked to propose for it again."""
        for span in abandoned.get(finding.incarnation, ()):
            if span.holds(finding.step):
                return span.incident
        return None

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
            if opened[key].view.kind != match.kind:  # refined (a spike that is a broken resume): say why
                opened[key].summary = finding.message
        item = opened[key]
        item.dirty = True
        if finding.rank is not None:
            item.ranks.add(finding.rank)
        if finding.node is not None:
            item.nodes.add(finding.node)
        if finding.device is not None:
            item.devices.add(finding.device)
        return key


def abandoned_spans(connection: Connection, run_id: int) -> dict[str, list[Abandoned]]:
    """Per incarnation whose ranks a rollback stopped (their acknowledgements say where), the
    windows it abandoned, and the incident it answered."""
    stopped_at = sa.func.max(ACK.c.step)
    rows = connection.execute(
        sa.select(ACK.c.incarnation, PROPOSAL.c.target_step, stopped_at, PROPOSAL.c.incident_id)
        .join(ACK, ACK.c.directive_id == PROPOSAL.c.directive_id)
        .where(
            PROPOSAL.c.run_id == run_id,
            PROPOSAL.c.action == "rollback",
            PROPOSAL.c.target_step.is_not(None),
            ACK.c.status == "done",
            ACK.c.step.is_not(None),
        )
        .group_by(ACK.c.incarnation, PROPOSAL.c.id, PROPOSAL.c.target_step, PROPOSAL.c.incident_id)
    )
    spans: dict[str, list[Abandoned]] = {}
    for incarnation, target, stop, incident in rows:
        spans.setdefault(incarnation, []).append(Abandoned(int(target), int(stop), int(incident)))
    return spans


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
