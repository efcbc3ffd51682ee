"""Automatic responses in the service: a hold while a proposal waits, and its release.

``policies.responses`` decides; this module carries it out and records it. A hold is a
directive to every rank of the incident's incarnation (``kind="hold"``): the ranks agree on it
like any directive and pause at one boundary, each acknowledging with the step it holds at. It
ends one of three ways, each an audit entry: the proposal is approved with a rollback (its
directive stops the held ranks where they are, so no release is sent), approved without one or
rejected (a ``release`` directive resumes every rank at one step), or ``hold_timeout_s`` passes
(the same release; the proposal stays pending). The ranks also release themselves a grace
period past the timeout when the service cannot be reached (``collectors.agent``).

A trainer that skips nonfinite updates itself (``HookConfig.nonfinite_response``) says so in
its run-start record; the incident's audit story records that its update was skipped, and while
every window of the incident was skipped on every rank no rollback is proposed for it
(``skipped_by_trainer``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.recovery import directives
from monitor.store import audit, models
from policies.directive_lifecycle import DirectiveStatus
from policies.responses import (
    SKIP_UPDATE,
    Release,
    Response,
    ResponseConfig,
    Situation,
    WindowSkips,
    releases_ranks,
    remedied_by_skip,
    respond,
)
from policies.types import Severity

DIRECTIVE = models.table_of(models.Directive)
INCARNATION = models.table_of(models.Incarnation)
SUMMARY = models.table_of(models.StepSummary)
AUDIT = models.table_of(models.AuditEntry)
FINDING = models.table_of(models.FindingRow)

HOLD, RELEASE = "hold", "release"
ACTOR = "policy:response"


def hold_if_configured(
    connection: Connection,
    incident: Any,
    proposal_id: int,
    pending: bool,
    auto_approved: bool,
    config: ResponseConfig,
    now: float,
) -> int | None:
    """The response to a proposal just stored: a hold directive when one was asked for;
    returns its id."""
    situation = Situation(
        incident_kind=incident["kind"],
        severity=Severity(incident["severity"]),
        proposal_pending=pending,
        auto_approved=auto_approved,
        run_live=_live(connection, incident["run_id"], incident["incarnation"]),
        held_before=_held_before(connection, incident["id"]),
    )
    decision = respond(situation, config)
    if decision.response is not Response.HOLD:
        return None
    hold_id = directives.create_directive(
        connection,
        incident["run_id"],
        HOLD,
        created_by=ACTOR,
        now=now,
        incarnation=incident["incarnation"],
        # The fault's step: the ranks are past it and hold at the first boundary they agree on.
        act_at_step=incident["last_step"],
        incident_id=incident["id"],
        payload={"proposal": proposal_id, "timeout_s": config.hold_timeout_s},
    )
    audit.append(
        connection,
        actor=ACTOR,
        action=HOLD,
        subject=f"directive:{hold_id}",
        now=now,
        run_id=incident["run_id"],
        incident_id=incident["id"],
        reason=decision.reason,
        details={"proposal": proposal_id, "timeout_s": config.hold_timeout_s, "kind": incident["kind"]},
    )
    return hold_id


def release_on_decision(
    connection: Connection, proposal: Any, approved: bool, rollback: bool, actor: str, now: float
) -> list[int]:
    """A decision on ``proposal``: every live hold of its incident ends (returns their ids)."""
    if approved:
        release = Release.APPROVED if rollback else Release.APPROVED_NO_ROLLBACK
    else:
        release = Release.REJECTED
    holds = _live_holds(connection, DIRECTIVE.c.incident_id == proposal["incident_id"])
    for hold in holds:
        _release(connection, hold, release, actor, now, proposal["id"])
    return [hold["id"] for hold in holds]


def expire_holds(connection: Connection, now: float, among: Collection[int] | None = None) -> list[int]:
    """Holds whose timeout passed on the service's clock (of the runs ``among``, when given):
    released (returns their ids)."""
    runs = sa.true() if among is None else DIRECTIVE.c.run_id.in_(sorted(among))
    expired = [
        hold
        for hold in _live_holds(connection, runs)
        if now - hold["created_at"] >= float(hold["payload"].get("timeout_s") or 0.0)
    ]
    for hold in expired:
        _release(connection, hold, Release.TIMEOUT, "engine", now, hold["payload"].get("proposal"))
    return [hold["id"] for hold in expired]


def note_trainer_response(connection: Connection, incident: Any, now: float) -> bool:
    """A nonfinite incident on a run whose trainer skips nonfinite updates itself: the skipped
    windows are recorded in the incident's story, once. True when an entry was written."""
    if incident["kind"] != "nonfinite" or _stated_response(connection, incident) != SKIP_UPDATE:
        return False
    skipped = connection.execute(
        sa.select(sa.func.count()).where(
            SUMMARY.c.run_id == incident["run_id"],
            SUMMARY.c.incarnation == incident["incarnation"],
            SUMMARY.c.step >= incident["first_step"],
            SUMMARY.c.step <= incident["last_step"],
            SUMMARY.c.skipped_ranks > 0,
        )
    ).scalar_one()
    if not skipped or _noted(connection, incident["id"]):
        return False
    audit.append(
        connection,
        actor="trainer",
        action=SKIP_UPDATE,
        subject=f"incident:{incident['id']}",
        now=now,
        run_id=incident["run_id"],
        incident_id=incident["id"],
        reason="HookConfig.nonfinite_response = skip_update: the nonfinite windows' updates were skipped",
        details={"skipped_windows": int(skipped), "first_step": incident["first_step"]},
    )
    return True


def skipped_by_trainer(connection: Connection, incident: Any) -> bool:
    """A nonfinite incident the trainer's ``skip_update`` already remedied: every window its
    findings name was skipped on every rank (``policies.responses.remedied_by_skip``)."""
    if incident["kind"] != "nonfinite":
        return False
    stated = _stated_response(connection, incident)
    if stated != SKIP_UPDATE:
        return False
    named = connection.execute(
        sa.select(FINDING.c.incarnation, FINDING.c.attempt)
        .where(FINDING.c.incident_id == incident["id"])
        .distinct()
    ).all()
    if not named or any(row.attempt is None for row in named):
        return False
    windows = []
    for incarnation, attempts in _by_incarnation(named).items():
        rows = connection.execute(
            sa.select(SUMMARY.c.ranks_reported, SUMMARY.c.skipped_ranks).where(
                SUMMARY.c.run_id == incident["run_id"],
                SUMMARY.c.incarnation == incarnation,
                SUMMARY.c.attempt.in_(attempts),
            )
        ).all()
        if len(rows) < len(attempts):
            return False  # a window not summarized: not known to be skipped
        windows += [WindowSkips(row.ranks_reported, row.skipped_ranks) for row in rows]
    return remedied_by_skip(stated, windows)


def _by_incarnation(named: Any) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for row in named:
        found.setdefault(row.incarnation, []).append(int(row.attempt))
    return found


def _release(
    connection: Connection, hold: Any, release: Release, actor: str, now: float, proposal_id: int | None
) -> None:
    release_id = None
    if releases_ranks(release):
        release_id = directives.create_directive(
            connection,
            hold["run_id"],
            RELEASE,
            created_by=actor,
            now=now,
            incarnation=hold["incarnation"],
            act_at_step=hold["act_at_step"],
            incident_id=hold["incident_id"],
            payload={"hold": hold["id"], "proposal": proposal_id, "reason": release.value},
        )
    released = {"reason": release.value, "at": now, "release_directive": release_id}
    connection.execute(
        DIRECTIVE.update()
        .where(DIRECTIVE.c.id == hold["id"])
        .values(payload={**hold["payload"], "released": released})
    )
    audit.append(
        connection,
        actor=actor,
        action="hold_released",
        subject=f"directive:{hold['id']}",
        now=now,
        run_id=hold["run_id"],
        incident_id=hold["incident_id"],
        reason=_why(release, proposal_id),
        details={"proposal": proposal_id, **released},
    )


def _why(release: Release, proposal_id: int | None) -> str:
    return {
        Release.APPROVED: f"proposal {proposal_id} approved: its rollback stops the held ranks",
        Release.APPROVED_NO_ROLLBACK: f"proposal {proposal_id} approved without a rollback: ranks resume",
        Release.REJECTED: f"proposal {proposal_id} rejected: ranks resume",
        Release.TIMEOUT: f"hold timed out with proposal {proposal_id} undecided: ranks resume",
    }[release]


def _live_holds(connection: Connection, where: Any) -> list[Any]:
    """Holds not yet released whose incarnation can still answer (a retired one cannot)."""
    rows = (
        connection.execute(
            sa.select(DIRECTIVE).where(
                DIRECTIVE.c.kind == HOLD,
                DIRECTIVE.c.status.in_((DirectiveStatus.PENDING.value, DirectiveStatus.DONE.value)),
                where,
            )
        )
        .mappings()
        .all()
    )
    return [row for row in rows if not row["payload"].get("released")]


def _held_before(connection: Connection, incident_id: int) -> bool:
    held = connection.execute(
        sa.select(DIRECTIVE.c.id)
        .where(DIRECTIVE.c.kind == HOLD, DIRECTIVE.c.incident_id == incident_id)
        .limit(1)
    ).first()
    return held is not None


def _live(connection: Connection, run_id: int, incarnation: str) -> bool:
    finished = connection.execute(
        sa.select(INCARNATION.c.finished_at).where(
            INCARNATION.c.run_id == run_id, INCARNATION.c.incarnation == incarnation
        )
    ).first()
    return finished is not None and finished.finished_at is None


def _stated_response(connection: Connection, incident: Any) -> str | None:
    """What the incarnation's hook said it does with a nonfinite window (its run-start config)."""
    config = connection.execute(
        sa.select(INCARNATION.c.config).where(
            INCARNATION.c.run_id == incident["run_id"], INCARNATION.c.incarnation == incident["incarnation"]
        )
    ).scalar()
    hook = config.get("runhealth_hook") if isinstance(config, dict) else None
    value = hook.get("nonfinite_response") if isinstance(hook, dict) else None
    return value if isinstance(value, str) else None


def _noted(connection: Connection, incident_id: int) -> bool:
    return (
        connection.execute(
            sa.select(AUDIT.c.seq)
            .where(AUDIT.c.action == SKIP_UPDATE, AUDIT.c.subject == f"incident:{incident_id}")
            .limit(1)
        ).first()
        is not None
    )
