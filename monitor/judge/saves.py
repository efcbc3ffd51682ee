"""Published checkpoints judged as saves: the preemption budget (``policies.preemption``) and
the asynchronous save's ordering rules (``policies.async_checkpoints``), when a checkpoint
record with the hook's save timings arrives.

The budget's terms come from the store: ``T_window`` from the step records of the saving
incarnation's newest windows (each window's time is its slowest rank's phases: data wait,
forward, backward and optimizer, wall time where the hook measured it), ``T_save`` from the
run's newest checkpoint records that carry a measured save. A budget that does not fit is one
``preemption_budget`` incident while it stays so (recorded once, not at every save), resolved
by the first save after which it fits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import models
from policies import async_checkpoints as saves
from policies.preemption import KIND, Budget, PreemptionConfig, budget_finding, budget_fits, preemption_budget
from policies.types import Finding

CHECKPOINT = models.table_of(models.CheckpointEvent)
STEP = models.table_of(models.StepRecord)
INCIDENT = models.table_of(models.Incident)


def _phase(wall: str, device: str) -> sa.ColumnElement[float]:
    """A phase's time: the wall time where the hook took it beside a CPU time, else its one."""
    return sa.func.coalesce(STEP.c[wall], STEP.c[device], 0.0)


def window_seconds(connection: Connection, run_id: int, incarnation: str, windows: int) -> list[float]:
    """The incarnation's newest ``windows`` windows' times, oldest first: each window's slowest
    rank (the window ends when its last rank is done). Windows the hook timed no phase of are
    left out. Reads the newest attempts through the step records' unique key."""
    newest = connection.execute(
        sa.select(sa.func.max(STEP.c.attempt)).where(
            STEP.c.run_id == run_id, STEP.c.incarnation == incarnation
        )
    ).scalar()
    if newest is None:
        return []
    total = (
        sa.func.coalesce(STEP.c.data_wait_s, 0.0)
        + _phase("forward_wall_s", "forward_s")
        + _phase("backward_wall_s", "backward_s")
        + _phase("optimizer_wall_s", "optimizer_s")
    )
    rows = connection.execute(
        sa.select(STEP.c.attempt, sa.func.max(total))
        .where(
            STEP.c.run_id == run_id,
            STEP.c.incarnation == incarnation,
            STEP.c.attempt > newest - windows,
            sa.or_(STEP.c.forward_s.is_not(None), STEP.c.forward_wall_s.is_not(None)),
        )
        .group_by(STEP.c.attempt)
        .order_by(STEP.c.attempt)
    ).all()
    return [float(seconds) for _, seconds in rows if seconds is not None]


def save_seconds(connection: Connection, run_id: int, saves_wanted: int) -> list[float]:
    """The run's newest measured saves (``rh.checkpoint_saving`` to ``checkpoint_saved``), oldest
    first."""
    rows = connection.execute(
        sa.select(CHECKPOINT.c.metrics)
        .where(CHECKPOINT.c.run_id == run_id, CHECKPOINT.c.metrics.is_not(None))
        .order_by(CHECKPOINT.c.time.desc(), CHECKPOINT.c.id.desc())
        .limit(20 * saves_wanted)  # records without a timing (a user's eval metrics) among them
    ).scalars()
    found = [measured_save(metrics) for metrics in rows]
    return [s for s in found if s is not None][:saves_wanted][::-1]


def measured_save(metrics: Mapping[str, Any] | None) -> float | None:
    value = (metrics or {}).get(saves.SAVE_S)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def run_budget(
    connection: Connection, run_id: int, incarnation: str, config: PreemptionConfig
) -> Budget | None:
    """The budget from the run's newest saves and the incarnation's newest windows (None without
    a configured warning, a measured save or a timed window)."""
    if config.warning_s is None:
        return None
    found = save_seconds(connection, run_id, config.recent_saves)
    if not found:
        return None
    return preemption_budget(
        window_seconds(connection, run_id, incarnation, config.recent_windows), found, config
    )


def judge_budget(
    connection: Connection, run_id: int, row: Mapping[str, Any], config: PreemptionConfig
) -> tuple[Budget | None, list[Finding]]:
    """After a measured save: a finding when the budget does not fit and no incident says so
    yet; the note that resolves the open one when it fits again."""
    budget = run_budget(connection, run_id, row["incarnation"], config)
    if budget is None:
        return None, []
    open_incident = connection.execute(
        sa.select(INCIDENT.c.id).where(
            INCIDENT.c.run_id == run_id, INCIDENT.c.kind == KIND, INCIDENT.c.status == "open"
        )
    ).first()
    finding = budget_finding(budget, row["step"], row["incarnation"])
    if finding is not None:
        return budget, [] if open_incident is not None else [finding]
    return budget, [budget_fits(budget, row["step"], row["incarnation"])] if open_incident is not None else []


def previous_checkpoint(
    connection: Connection, run_id: int, row: Mapping[str, Any]
) -> tuple[str, int] | None:
    """The recovery point before this one: the newest checkpoint recorded with a manifest before
    it, at another path, or at the same path (an overwrite in place)."""
    found = connection.execute(
        sa.select(CHECKPOINT.c.path, CHECKPOINT.c.step)
        .where(
            CHECKPOINT.c.run_id == run_id,
            CHECKPOINT.c.time < row["time"],
            CHECKPOINT.c.manifest.is_not(None),
        )
        .order_by(CHECKPOINT.c.time.desc(), CHECKPOINT.c.id.desc())
        .limit(1)
    ).first()
    return None if found is None else (found.path, found.step)


def save_facts(connection: Connection, run_id: int, row: Mapping[str, Any]) -> saves.SaveFacts:
    metrics, tags = row.get("metrics") or {}, row.get("tags") or []
    updates = metrics.get(saves.UPDATES_BEFORE_STAGED)
    staging = metrics.get(saves.STAGING_S)
    deleted = saves.PREVIOUS_DELETED_TAG in tags
    previous = previous_checkpoint(connection, run_id, row) if deleted else None
    return saves.SaveFacts(
        step=row["step"],
        path=row["path"],
        incarnation=row["incarnation"],
        updates_before_staged=int(updates) if isinstance(updates, int | float) else 0,
        staging_s=float(staging) if isinstance(staging, int | float) else None,
        previous_deleted=deleted,
        previous_path=previous[0] if previous else None,
        previous_step=previous[1] if previous else None,
    )


def judge_saves(
    connection: Connection, run_id: int, rows: Sequence[Mapping[str, Any]], config: PreemptionConfig
) -> tuple[Budget | None, list[Finding]]:
    """The new checkpoint records a hook timed: their ordering findings, and the budget after
    the newest of them (with its finding or note)."""
    findings: list[Finding] = []
    budget: Budget | None = None
    timed = sorted(
        (row for row in rows if measured_save(row.get("metrics")) is not None), key=lambda r: r["time"]
    )
    for row in timed:
        findings += saves.save_findings(save_facts(connection, run_id, row))
    if timed:
        budget, found = judge_budget(connection, run_id, timed[-1], config)
        findings += found
    return budget, findings
