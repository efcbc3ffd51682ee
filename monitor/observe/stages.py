"""Spans for the stages the store records, however and wherever they were made.

Every stage of a fault after detection is already an entry in the audit log (incident opened,
proposed, approved or rejected, quarantine, rollback executed, resume verified, ...), each with
its incident, time and actor; every directive is a row in the directives table, audited or not
(the hang watch's stack-dump requests are not). Rather than instrument each writer, the service
wraps the work that can create them in ``following()``, which afterwards emits one span per new
audit entry and per new directive, at its recorded time and linked to its incident's span.
Stages made elsewhere (an approval through the API) are emitted by the next wrapped job: the hang
check runs every 5 s. Acknowledgements get one span per directive per ingest batch, not one per
rank: a 16,384-rank run acknowledges a directive in 16,384 records.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from opentelemetry.trace import Link
from sqlalchemy.engine import Connection, Engine

from monitor.observe.tracing import (
    ACKNOWLEDGEMENT,
    APPROVAL,
    PROPOSAL,
    DirectiveRef,
    IncidentRef,
    Tracing,
    incident_link,
)
from monitor.store import models

log = logging.getLogger("runhealth.tracing")

RUN = models.table_of(models.Run)
INCIDENTS = models.table_of(models.Incident)
DIRECTIVE = models.table_of(models.Directive)
AUDIT = models.table_of(models.AuditEntry)

# Audit actions by the stage span they become; an action not listed becomes "runhealth.<action>".
STAGE_OF_ACTION = {
    "proposed": PROPOSAL,
    "escalated": PROPOSAL,
    "proposal_superseded": PROPOSAL,
    "approved": APPROVAL,
    "rejected": APPROVAL,
}
# Traced from their own source instead: directives from their table (it holds the unaudited ones
# too), acknowledgements from the ingest batch (one span per directive, not per rank), incidents
# as the pinned span every other stage links to.
NOT_FROM_AUDIT = frozenset({"directive", "directive_reissued", "acknowledged", "incident_opened"})
MAX_TEXT = 512


def incident_ref(connection: Connection, incident_id: int) -> IncidentRef:
    """The reference a stage traced by hand (``Tracing.stage``) links its span with."""
    row = connection.execute(
        sa.select(RUN.c.name, INCIDENTS.c.opened_at)
        .join(RUN, RUN.c.id == INCIDENTS.c.run_id)
        .where(INCIDENTS.c.id == incident_id)
    ).one()
    return IncidentRef(row.name, incident_id, row.opened_at)


class StageSpans:
    def __init__(self, tracing: Tracing, engine: Engine) -> None:
        self._tracing = tracing
        self._engine = engine
        self._lock = threading.Lock()
        # The newest incident, audit entry and directive already traced (or there before tracing).
        self._seen: tuple[int, int, int] | None = None

    @contextmanager
    def following(self) -> Iterator[None]:
        """Run the body, then trace the stages it (or anyone since the last look) recorded."""
        if not self._tracing.enabled:
            yield
            return
        self._guarded(self._mark)
        try:
            yield
        finally:
            self._guarded(self._emit_new)

    def acknowledged(self, rows: Sequence[dict[str, Any]]) -> None:
        """One span per directive for a batch's new acknowledgements, linked to the directive's and
        its incident's spans; a child of the current (ingest) span."""
        if self._tracing.enabled and rows:
            self._guarded(lambda: self._acknowledged(rows))

    def _guarded(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception:  # tracing must never fail the ingest or the check it follows
            log.exception("tracing the pipeline's stages failed")

    def _mark(self) -> None:
        with self._lock:
            if self._seen is None:
                with self._engine.connect() as connection:
                    self._seen = (
                        _newest(connection, INCIDENTS.c.id),
                        _newest(connection, AUDIT.c.seq),
                        _newest(connection, DIRECTIVE.c.id),
                    )

    def _emit_new(self) -> None:
        with self._lock, self._engine.connect() as connection:
            if self._seen is not None:
                self._seen = (
                    self._incidents(connection, self._seen[0]),
                    self._audit(connection, self._seen[1]),
                    self._directives(connection, self._seen[2]),
                )

    def _incidents(self, connection: Connection, after: int) -> int:
        query = (
            sa.select(INCIDENTS, RUN.c.name.label("run"))
            .join(RUN, RUN.c.id == INCIDENTS.c.run_id)
            .where(INCIDENTS.c.id > after)
            .order_by(INCIDENTS.c.id)
        )
        for row in connection.execute(query).mappings():
            self._tracing.incident_opened(
                IncidentRef(row["run"], row["id"], row["opened_at"]),
                {
                    "runhealth.run": row["run"],
                    "runhealth.incident.id": row["id"],
                    "runhealth.incident.kind": row["kind"],
                    "runhealth.incident.severity": row["severity"],
                    "runhealth.incident.first_step": row["first_step"],
                    "runhealth.incident.scope": row["scope"] or "",
                },
            )
            after = row["id"]
        return after

    def _audit(self, connection: Connection, after: int) -> int:
        query = (
            sa.select(AUDIT, RUN.c.name.label("run"), INCIDENTS.c.opened_at.label("incident_opened_at"))
            .outerjoin(RUN, RUN.c.id == AUDIT.c.run_id)
            .outerjoin(INCIDENTS, INCIDENTS.c.id == AUDIT.c.incident_id)
            .where(AUDIT.c.seq > after)
            .order_by(AUDIT.c.seq)
        )
        for row in connection.execute(query).mappings():
            after = row["seq"]
            if row["action"] in NOT_FROM_AUDIT:
                continue
            incident = _incident_of(row)
            attributes = {
                "runhealth.run": row["run"] or "",
                "runhealth.action": row["action"],
                "runhealth.actor": row["actor"],
                "runhealth.subject": row["subject"],
                "runhealth.reason": (row["reason"] or "")[:MAX_TEXT],
                "runhealth.audit.seq": row["seq"],
                "runhealth.incident.id": row["incident_id"] or 0,
            }
            name = STAGE_OF_ACTION.get(row["action"], f"runhealth.{row['action']}")
            self._tracing.recorded(name, row["time"], incident, attributes)
        return after

    def _directives(self, connection: Connection, after: int) -> int:
        for row in _directive_rows(connection, DIRECTIVE.c.id > after):
            directive, incident = _refs(row)
            self._tracing.directive_created(
                directive,
                incident,
                {
                    "runhealth.run": row["run"],
                    "runhealth.directive.id": row["id"],
                    "runhealth.directive.kind": row["kind"],
                    "runhealth.directive.created_by": row["created_by"],
                    "runhealth.directive.act_at_step": row["act_at_step"]
                    if row["act_at_step"] is not None
                    else -1,
                    "runhealth.incident.id": row["incident_id"] or 0,
                },
            )
            after = row["id"]
        return after

    def _acknowledged(self, rows: Sequence[dict[str, Any]]) -> None:
        by_directive: dict[int, Counter[str]] = {}
        for row in rows:
            by_directive.setdefault(row["directive_id"], Counter())[row["status"]] += 1
        with self._engine.connect() as connection:
            found = list(_directive_rows(connection, DIRECTIVE.c.id.in_(list(by_directive))))
        for row in found:
            directive, incident = _refs(row)
            links = [Link(directive.context, {"runhealth.directive.id": directive.id})]
            links += [incident_link(incident)] if incident is not None else []
            statuses = by_directive[row["id"]]
            attributes = {
                "runhealth.run": row["run"],
                "runhealth.directive.id": row["id"],
                "runhealth.directive.kind": row["kind"],
                "runhealth.incident.id": row["incident_id"] or 0,
                "runhealth.ranks": sum(statuses.values()),
                **{f"runhealth.ranks.{status}": count for status, count in statuses.items()},
            }
            with self._tracing.span(ACKNOWLEDGEMENT, attributes, links):
                pass


def _newest(connection: Connection, key: sa.Column[Any]) -> int:
    return int(connection.execute(sa.select(sa.func.coalesce(sa.func.max(key), 0))).scalar_one())


def _directive_rows(connection: Connection, condition: Any) -> list[Any]:
    """Directives with their run's name and their incident's opening time (when they have one)."""
    query = (
        sa.select(DIRECTIVE, RUN.c.name.label("run"), INCIDENTS.c.opened_at.label("incident_opened_at"))
        .join(RUN, RUN.c.id == DIRECTIVE.c.run_id)
        .outerjoin(INCIDENTS, INCIDENTS.c.id == DIRECTIVE.c.incident_id)
        .where(condition)
        .order_by(DIRECTIVE.c.id)
    )
    return list(connection.execute(query).mappings())


def _incident_of(row: Any) -> IncidentRef | None:
    if row["incident_id"] is None or row["incident_opened_at"] is None or row["run"] is None:
        return None
    return IncidentRef(row["run"], row["incident_id"], row["incident_opened_at"])


def _refs(row: Any) -> tuple[DirectiveRef, IncidentRef | None]:
    return DirectiveRef(row["run"], row["id"], row["created_at"]), _incident_of(row)
