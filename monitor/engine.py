"""The engine: judges each window once its ranks have reported, records findings, and
groups them into incidents.

Policies are pure (``policies.series``); this module feeds them in step order, keeps their
state per run in memory (rebuilt from the newest judged windows after a restart, never from
all of history), and persists what they find.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from monitor import models
from policies.incidents import extend, matching_incident, open_incident
from policies.series import SeriesConfig, SeriesState, observe_step
from policies.types import Finding, IncidentView, Severity, StepPoint

SUMMARY = models.table_of(models.StepSummary)
INCIDENT = models.table_of(models.Incident)
FINDING = models.table_of(models.FindingRow)
INCARNATION = models.table_of(models.Incarnation)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine decides a window is ready to judge.

    ``watermark_attempts``: a window is judged with the ranks it has once a window this many
    attempts later has arrived, so a dead rank cannot stall judgement (2: one window of
    slack for ranks that finish a step late, one more for the sender's batching).
    """

    series: SeriesConfig = field(default_factory=SeriesConfig)
    watermark_attempts: int = 2

    def __post_init__(self) -> None:
        if self.watermark_attempts < 1:
            raise ValueError("EngineConfig.watermark_attempts must be >= 1")


def point_from_summary(summary: dict[str, Any], restart: bool) -> StepPoint:
    tokens = summary["tokens"]
    loss_sum = summary["loss_sum"]
    if tokens and loss_sum is not None:
        loss: float | None = loss_sum / tokens  # the token-weighted mean over all ranks
    elif summary["reported_loss_count"]:
        loss = summary["reported_loss_sum"] / summary["reported_loss_count"]
    else:
        loss = None
    return StepPoint(
        step=summary["step"],
        loss=loss,
        grad_norm=summary["grad_norm"],
        lr=summary["lr"],
        tokens=tokens,
        loss_scale=summary["loss_scale"],
        skipped=summary["skipped_ranks"] > 0,
        incarnation=summary["incarnation"],
        attempt=summary["attempt"],
        restart=restart,
    )


@dataclass
class _RunState:
    series: SeriesState
    last_incarnation: str | None = None
    world_size: dict[str, int] = field(default_factory=dict)


class PolicyEngine:
    """Runs the policies over each run's windows as they become complete."""

    def __init__(self, engine: Engine, config: EngineConfig, clock: Callable[[], float]) -> None:
        self._engine = engine
        self._config = config
        self._clock = clock
        self._states: dict[int, _RunState] = {}
        self._lock = threading.Lock()

    def judge(self, run_id: int) -> list[int]:
        """Judge every ready window of one run; returns the incidents opened or updated."""
        with self._lock, self._engine.begin() as connection:
            state = self._states.get(run_id) or self._rebuild(connection, run_id)
            self._states[run_id] = state
            ready = self._ready(connection, run_id, state)
            touched: list[int] = []
            for summary in ready:
                restart = state.last_incarnation not in (None, summary["incarnation"])
                point = point_from_summary(summary, restart)
                state.last_incarnation = summary["incarnation"]
                state.series, findings = observe_step(state.series, point, self._config.series)
                touched.extend(self._record(connection, run_id, findings))
            if ready:
                connection.execute(
                    SUMMARY.update().where(SUMMARY.c.id.in_([s["id"] for s in ready])).values(judged=True)
                )
            return sorted(set(touched))

    def forget(self, run_id: int) -> None:
        self._states.pop(run_id, None)

    def _rebuild(self, connection: Connection, run_id: int) -> _RunState:
        depth = self._config.series.loss_spike.window
        rows = connection.execute(
            sa.select(SUMMARY)
            .where(SUMMARY.c.run_id == run_id, SUMMARY.c.judged.is_(True))
            .order_by(SUMMARY.c.id.desc())
            .limit(depth)
        ).mappings()
        state = _RunState(series=SeriesState.empty(self._config.series))
        for summary in reversed(list(rows)):
            restart = state.last_incarnation not in (None, summary["incarnation"])
            state.last_incarnation = summary["incarnation"]
            point = point_from_summary(dict(summary), restart)
            state.series, _ = observe_step(state.series, point, self._config.series)
        return state

    def _ready(self, connection: Connection, run_id: int, state: _RunState) -> list[dict[str, Any]]:
        pending = [
            dict(row)
            for row in connection.execute(
                sa.select(SUMMARY)
                .where(SUMMARY.c.run_id == run_id, SUMMARY.c.judged.is_(False))
                .order_by(SUMMARY.c.id)
            ).mappings()
        ]
        if not pending:
            return []
        by_incarnation: dict[str, list[dict[str, Any]]] = {}
        for summary in pending:
            by_incarnation.setdefault(summary["incarnation"], []).append(summary)
        self._learn_world_sizes(connection, run_id, state, by_incarnation)
        ready: list[dict[str, Any]] = []
        for incarnation, summaries in by_incarnation.items():
            summaries.sort(key=lambda s: s["attempt"])
            newest = summaries[-1]["attempt"]
            expected = state.world_size.get(incarnation, 1)
            for summary in summaries:
                complete = summary["ranks_reported"] >= expected
                overtaken = summary["attempt"] <= newest - self._config.watermark_attempts
                if not (complete or overtaken):
                    break  # judge in order: a later window waits for this one
                ready.append(summary)
        return ready

    def _learn_world_sizes(
        self,
        connection: Connection,
        run_id: int,
        state: _RunState,
        by_incarnation: dict[str, list[dict[str, Any]]],
    ) -> None:
        """World size from the run-start record; failing that, the most ranks yet seen."""
        unknown = [inc for inc in by_incarnation if inc not in state.world_size]
        declared = {}
        if unknown:
            declared = dict(
                connection.execute(
                    sa.select(INCARNATION.c.incarnation, INCARNATION.c.world_size).where(
                        INCARNATION.c.run_id == run_id,
                        INCARNATION.c.incarnation.in_(unknown),
                        INCARNATION.c.world_size.is_not(None),
                    )
                ).all()
            )
        for incarnation, summaries in by_incarnation.items():
            if incarnation in declared:
                state.world_size[incarnation] = declared[incarnation]
                continue
            seen = max(s["ranks_reported"] for s in summaries)
            state.world_size[incarnation] = max(state.world_size.get(incarnation, 1), seen)

    def _record(self, connection: Connection, run_id: int, findings: Sequence[Finding]) -> list[int]:
        touched = []
        for finding in findings:
            incident_id = self._attach(connection, run_id, finding)
            connection.execute(FINDING.insert(), finding_row(run_id, incident_id, finding, self._clock()))
            touched.append(incident_id)
        return touched

    def _attach(self, connection: Connection, run_id: int, finding: Finding) -> int:
        now = self._clock()
        open_rows = connection.execute(
            sa.select(INCIDENT).where(INCIDENT.c.run_id == run_id, INCIDENT.c.status == "open")
        ).mappings()
        views = {row["id"]: _view(row) for row in open_rows}
        match = matching_incident(finding, views.values(), self._config.series.grouping)
        if match is None:
            view = open_incident(0, finding)
            result = connection.execute(
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
                    "ranks": [] if finding.rank is None else [finding.rank],
                    "nodes": [],
                    "devices": [],
                    "finding_count": 1,
                    "opened_at": now,
                    "updated_at": now,
                    "closed_at": None,
                },
            )
            return int(result.scalar_one())
        grown = extend(match, finding)
        connection.execute(
            INCIDENT.update()
            .where(INCIDENT.c.id == match.key)
            .values(
                severity=grown.severity.value,
                first_step=grown.first_step,
                last_step=grown.last_step,
                finding_count=grown.finding_count,
                updated_at=now,
            )
        )
        return match.key


def _view(row: Any) -> IncidentView:
    return IncidentView(
        key=row["id"],
        kind=row["kind"],
        severity=Severity(row["severity"]),
        first_step=row["first_step"],
        last_step=row["last_step"],
        finding_count=row["finding_count"],
    )


def finding_row(run_id: int, incident_id: int | None, finding: Finding, now: float) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "incident_id": incident_id,
        "incarnation": finding.incarnation,
        "attempt": finding.attempt,
        "step": finding.step,
        "rank": finding.rank,
        "kind": finding.kind,
        "severity": finding.severity.value,
        "signal": finding.signal,
        "value": finding.value,
        "threshold": finding.threshold,
        "message": finding.message,
        "evidence": dict(finding.evidence),
        "created_at": now,
    }
