"""Drill reports in the store: one row per drill run, listed by run name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import models
from policies.drills import Check, verdict

DRILL_REPORT = models.table_of(models.DrillReport)


@dataclass(frozen=True)
class DrillResult:
    """One drill's checks, with when it ran and where its logs and checkpoints are."""

    drill: str
    checks: tuple[Check, ...]
    started_at: float
    finished_at: float
    workdir: str

    @property
    def verdict(self) -> str:
        return verdict(self.checks)

    def document(self) -> dict[str, Any]:
        return {
            "drill": self.drill,
            "verdict": self.verdict,
            "checks": [check.document() for check in self.checks],
            "seconds": round(self.finished_at - self.started_at, 2),
            "workdir": self.workdir,
        }


def record(
    connection: Connection,
    run: str,
    result: DrillResult,
    command: str,
    settings: Mapping[str, Any],
    actor: str,
) -> int:
    inserted = connection.execute(
        DRILL_REPORT.insert().returning(DRILL_REPORT.c.id),
        {
            "run": run,
            "drill": result.drill,
            "verdict": result.verdict,
            "checks": [check.document() for check in result.checks],
            "command": command,
            "settings": dict(settings),
            "workdir": result.workdir,
            "started_at": result.started_at,
            "finished_at": result.finished_at,
            "created_by": actor,
        },
    )
    return int(inserted.scalar_one())


def list_reports(connection: Connection, run: str) -> Sequence[dict[str, Any]]:
    rows = connection.execute(
        sa.select(DRILL_REPORT).where(DRILL_REPORT.c.run == run).order_by(DRILL_REPORT.c.id)
    ).mappings()
    return [dict(row) for row in rows]
