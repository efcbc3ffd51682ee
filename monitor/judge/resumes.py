"""Resume records against the checkpoint they claim and what the previous incarnation did next.

A resume that is the restore of an approved rollback is known as such (``rollback_awaiting``):
what its check finds, the rollback's own restore did, so it proposes no other rollback. A resume
whose data position nothing can check gets one note per incarnation, however many ranks and
batches its records came in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.judge.readings import resume_facts
from monitor.store import models
from policies.continuity import ContinuityConfig, Expected, ResumeFacts, data_order_note, resume_findings
from policies.proposal_lifecycle import ProposalStatus
from policies.types import Finding, Severity

CHECKPOINT = models.table_of(models.CheckpointEvent)
SUMMARY = models.table_of(models.StepSummary)
STEP = models.table_of(models.StepRecord)
RESUME = models.table_of(models.ResumeEvent)
PROPOSAL = models.table_of(models.Proposal)
FINDING = models.table_of(models.FindingRow)
AUDIT = models.table_of(models.AuditEntry)

# A rollback is carried out from its approval (the directive goes out) until every rank said done.
CARRIED_OUT = (ProposalStatus.EXECUTING.value, ProposalStatus.DONE.value)
VERIFIED = "resume_verified"
FAILED = "resume_failed"
"""The audit actions of a rollback's resume check: passed, or failed (an operator reading the
log at 3 AM must not read "verified" over a resume that lost its state)."""
NOTE_KIND = "data_order_not_reproducible"

# More ranks than this with the same problem are reported once, as a count.
MAX_NAMED_RANKS = 8


def judge_resumes(
    connection: Connection, run_id: int, rows: Sequence[dict[str, Any]], config: ContinuityConfig
) -> list[Finding]:
    findings: list[Finding] = []
    resumes: dict[tuple[str, int], list[ResumeFacts]] = {}
    for row in rows:
        expected = _expected(connection, run_id, row)
        if expected is None:
            continue
        facts = resume_facts(row["incarnation"], row["rank"], expected.step, row["restored"])
        findings += resume_findings(facts, expected, config)
        resumes.setdefault((row["incarnation"], expected.step), []).append(facts)
    return _aggregate(findings) + _notes(connection, run_id, resumes)


def rollback_awaiting(
    connection: Connection, run_id: int, row: dict[str, Any], *, verified: bool = False
) -> Any:
    """The approved rollback whose restore this resume record is, or None: one carried out to
    the checkpoint the record names (its path or its step), approved before the record arrived,
    whose resume was not verified yet (``verified``: or was)."""
    targets = []
    if row.get("checkpoint_path"):
        targets.append(PROPOSAL.c.target_path == row["checkpoint_path"])
    if row.get("checkpoint_step") is not None:
        targets.append(PROPOSAL.c.target_step == row["checkpoint_step"])
    if not targets:
        return None
    candidates = connection.execute(
        sa.select(PROPOSAL)
        .where(
            PROPOSAL.c.run_id == run_id,
            PROPOSAL.c.action == "rollback",
            PROPOSAL.c.status.in_(CARRIED_OUT),
            PROPOSAL.c.decided_at <= row["received_at"],
            sa.or_(*targets),
        )
        .order_by(PROPOSAL.c.id.desc())
    ).mappings()
    return next((p for p in candidates if verified or not resume_verified(connection, p["id"])), None)


def started_by_rollback(connection: Connection, run_id: int, incarnation: str) -> bool:
    """Whether this incarnation is the restore of an approved rollback: what its restart lost,
    the rollback's own restore lost."""
    rows = connection.execute(
        sa.select(RESUME.c.checkpoint_path, RESUME.c.checkpoint_step, RESUME.c.received_at).where(
            RESUME.c.run_id == run_id, RESUME.c.incarnation == incarnation
        )
    ).mappings()
    return any(rollback_awaiting(connection, run_id, dict(row), verified=True) is not None for row in rows)


def resume_verified(connection: Connection, proposal_id: int) -> bool:
    """Whether the resume after this rollback was judged (passed or failed) already."""
    entry = connection.execute(
        sa.select(AUDIT.c.seq)
        .where(AUDIT.c.action.in_((VERIFIED, FAILED)), AUDIT.c.subject == f"proposal:{proposal_id}")
        .limit(1)
    ).first()
    return entry is not None


def _notes(
    connection: Connection, run_id: int, resumes: dict[tuple[str, int], list[ResumeFacts]]
) -> list[Finding]:
    """One note per incarnation whose data position cannot be checked (its resume records may
    come in several batches: a note stored already is not repeated)."""
    notes = []
    for (incarnation, step), facts in resumes.items():
        noted = connection.execute(
            sa.select(FINDING.c.id)
            .where(
                FINDING.c.run_id == run_id, FINDING.c.incarnation == incarnation, FINDING.c.kind == NOTE_KIND
            )
            .limit(1)
        ).first()
        note = None if noted is not None else data_order_note(facts, step)
        if note is not None:
            notes.append(note)
    return notes


def _checkpoint(connection: Connection, run_id: int, row: dict[str, Any]) -> Any:
    query = sa.select(CHECKPOINT).where(CHECKPOINT.c.run_id == run_id)
    if row.get("checkpoint_path"):
        query = query.where(CHECKPOINT.c.path == row["checkpoint_path"])
    elif row.get("checkpoint_step") is not None:
        query = query.where(CHECKPOINT.c.step == row["checkpoint_step"])
    else:
        return None
    return connection.execute(query.order_by(CHECKPOINT.c.id.desc()).limit(1)).mappings().first()


def _expected(connection: Connection, run_id: int, row: dict[str, Any]) -> Expected | None:
    checkpoint = _checkpoint(connection, run_id, row)
    step = checkpoint["step"] if checkpoint is not None else row.get("checkpoint_step")
    if step is None:
        return None
    after = connection.execute(
        sa.select(SUMMARY.c.incarnation, SUMMARY.c.attempt, SUMMARY.c.lr)
        .where(
            SUMMARY.c.run_id == run_id,
            SUMMARY.c.incarnation != row["incarnation"],
            SUMMARY.c.step == step + 1,
        )
        .order_by(SUMMARY.c.id)
        .limit(1)
    ).first()
    next_ids = None
    if after is not None:
        ids = connection.execute(
            sa.select(STEP.c.sample_ids).where(
                STEP.c.run_id == run_id,
                STEP.c.incarnation == after.incarnation,
                STEP.c.attempt == after.attempt,
                STEP.c.rank == row["rank"],
            )
        ).scalar()
        next_ids = tuple(ids) if ids else None
    consumed = checkpoint["consumed"] if checkpoint is not None else None
    rollback = rollback_awaiting(connection, run_id, row)
    return Expected(
        step=step,
        consumed=consumed,
        next_lr=after.lr if after is not None else None,
        next_sample_ids=next_ids,
        data_state_digest=_earlier_data_state(connection, run_id, row, step),
        after_rollback=rollback["id"] if rollback is not None else None,
    )


def _earlier_data_state(connection: Connection, run_id: int, row: dict[str, Any], step: int) -> str | None:
    """The data-state digest this rank restored the last time it resumed from this checkpoint
    (same path and step): one checkpoint restores one data state."""
    earlier = connection.execute(
        sa.select(RESUME.c.incarnation, RESUME.c.restored)
        .where(
            RESUME.c.run_id == run_id,
            RESUME.c.rank == row["rank"],
            RESUME.c.incarnation != row["incarnation"],
            RESUME.c.checkpoint_path == row.get("checkpoint_path"),
            RESUME.c.checkpoint_step == step,
        )
        .order_by(RESUME.c.id.desc())
    )
    digests = (
        resume_facts(i, row["rank"], step, restored or {}).data_state_digest for i, restored in earlier
    )
    return next((digest for digest in digests if digest is not None), None)


def _aggregate(findings: list[Finding]) -> list[Finding]:
    by_kind: dict[str, list[Finding]] = {}
    for finding in findings:
        by_kind.setdefault(finding.kind, []).append(finding)
    result: list[Finding] = []
    for kind, group in by_kind.items():
        if len(group) <= MAX_NAMED_RANKS:
            result += group
            continue
        first = group[0]
        result.append(
            Finding(
                step=first.step,
                kind=kind,
                severity=Severity.CRITICAL,
                signal=first.signal,
                value=first.value,
                threshold=first.threshold,
                incarnation=first.incarnation,
                message=f"{len(group)} ranks: {first.message.split(': ', 1)[-1]}",
                evidence={
                    **first.evidence,
                    "ranks": len(group),
                    "first_ranks": sorted(f.rank for f in group if f.rank is not None)[:16],
                },
            )
        )
    return result
