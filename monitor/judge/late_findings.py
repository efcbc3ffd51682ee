"""Which findings of a window judged again with its late records are news.

A window judged without a late rank was judged against fewer peers. Judged again with the late
records, the late ranks' findings are new; so is a finding on a rank that was on time when that
fuller window names it for the first time, or more severely than it was named (the demo's bad
rank judged beside 2 peers instead of 3 was a warning 0.2% short of critical, so its hold was
never decided). A finding on an on-time rank already recorded at that severity or above is the
same evidence again, and is dropped rather than counted twice.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import models
from policies.types import Finding, Severity

FINDING = models.table_of(models.FindingRow)


def news(
    connection: Connection, run_id: int, found: Sequence[Finding], late_ranks: Collection[int]
) -> list[Finding]:
    """The findings of a window judged again with the records of ``late_ranks`` worth recording."""
    kept = [f for f in found if f.rank is None or f.rank in late_ranks]
    others = [f for f in found if f.rank is not None and f.rank not in late_ranks]
    if not others:
        return kept
    recorded = _recorded(connection, run_id, others)
    return kept + [f for f in others if f.severity.rank > recorded.get(_key(f), -1)]


def _key(finding: Finding) -> tuple[str, int | None, int, str, int | None]:
    return (finding.incarnation, finding.attempt, finding.step, finding.kind, finding.rank)


def _recorded(
    connection: Connection, run_id: int, findings: Sequence[Finding]
) -> dict[tuple[str, int | None, int, str, int | None], int]:
    """The highest severity already recorded for each finding's window, kind and rank."""
    steps = sorted({f.step for f in findings})
    rows = connection.execute(
        sa.select(
            FINDING.c.incarnation,
            FINDING.c.attempt,
            FINDING.c.step,
            FINDING.c.kind,
            FINDING.c.rank,
            FINDING.c.severity,
        ).where(FINDING.c.run_id == run_id, FINDING.c.step.in_(steps))
    )
    highest: dict[tuple[str, int | None, int, str, int | None], int] = {}
    for incarnation, attempt, step, kind, rank, severity in rows:
        key = (incarnation, attempt, step, kind, rank)
        highest[key] = max(highest.get(key, -1), Severity(severity).rank)
    return highest
