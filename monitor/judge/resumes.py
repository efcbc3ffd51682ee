"""Resume records against the checkpoint they claim and what the previous incarnation did next."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.judge.readings import resume_facts
from monitor.store import models
from policies.continuity import ContinuityConfig, Expected, resume_findings
from policies.types import Finding, Severity

CHECKPOINT = models.table_of(models.CheckpointEvent)
SUMMARY = models.table_of(models.StepSummary)
STEP = models.table_of(models.StepRecord)

# More ranks than this with the same problem are reported once, as a count.
MAX_NAMED_RANKS = 8


def judge_resumes(
    connection: Connection, run_id: int, rows: Sequence[dict[str, Any]], config: ContinuityConfig
) -> list[Finding]:
    findings: list[Finding] = []
    for row in rows:
        expected = _expected(connection, run_id, row)
        if expected is None:
            continue
        facts = resume_facts(row["incarnation"], row["rank"], expected.step, row["restored"])
        findings += resume_findings(facts, expected, config)
    return _aggregate(findings)


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
    return Expected(
        step=step,
        consumed=consumed,
        next_lr=after.lr if after is not None else None,
        next_sample_ids=next_ids,
    )


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
                    "ranks": len(group),
                    "first_ranks": sorted(f.rank for f in group if f.rank is not None)[:16],
                },
            )
        )
    return result
