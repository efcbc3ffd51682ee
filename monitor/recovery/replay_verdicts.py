"""``runhealth replay INCIDENT``: run the replay job, record its verdict, re-propose."""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.recovery import checkpoints
from monitor.recovery.config import DecisionConfig
from monitor.recovery.decisions import Decisions
from monitor.recovery.replay_jobs import ReplayError, record_replay, registered_command, run_replay
from monitor.store import audit, models
from policies.checkpoints import rewind_target

INCIDENT = models.table_of(models.Incident)
RUN = models.table_of(models.Run)
STEP = models.table_of(models.StepRecord)


def replay_spec(engine: Engine, incident_id: int) -> tuple[int, dict[str, Any]]:
    """What the replay job gets: where to start, which span, the suspect batches and devices."""
    with engine.begin() as connection:
        incident = (
            connection.execute(sa.select(INCIDENT).where(INCIDENT.c.id == incident_id)).mappings().first()
        )
        if incident is None:
            raise ReplayError(f"no incident {incident_id}")
        run_id = incident["run_id"]
        known, unsafe = checkpoints.confirmed_facts(connection, run_id, incident["first_step"], time.time())
        target = rewind_target(known, incident["first_step"], unsafe)
        suspects = connection.execute(
            sa.select(STEP.c.rank, STEP.c.sample_ids, STEP.c.device_uuid, STEP.c.node).where(
                STEP.c.run_id == run_id,
                STEP.c.incarnation == incident["incarnation"],
                STEP.c.step == incident["first_step"],
            )
        ).all()
    ranks = set(incident["ranks"]) or {s.rank for s in suspects}
    spec = {
        "incident": incident_id,
        "kind": incident["kind"],
        "checkpoint": {"path": target.path, "step": target.step} if target else None,
        "first_affected_step": incident["first_step"],
        "last_step": incident["last_step"],
        "suspect_ranks": sorted(ranks),
        "suspect_batches": sorted(
            {str(i) for s in suspects if s.rank in ranks for i in (s.sample_ids or [])}
        ),
        "suspect_devices": [
            {"rank": s.rank, "device": s.device_uuid, "node": s.node} for s in suspects if s.rank in ranks
        ],
    }
    return run_id, spec


def replay_incident(
    engine: Engine,
    incident_id: int,
    command: str | None,
    timeout_s: float,
    actor: str,
    decision_config: DecisionConfig,
) -> dict[str, Any]:
    """Run the replay and record its verdict; ``decision_config`` is the service's workflow settings
    (retries, quarantine), handed in by the caller that read them."""
    run_id, spec = replay_spec(engine, incident_id)
    with engine.connect() as connection:
        command = command or registered_command(connection, run_id)
    if not command:
        raise ReplayError(
            "no replay entry point: pass --command, or register replay_command in the run-start config"
        )
    started = time.time()
    try:
        result, output = run_replay(command, spec, timeout_s)
    except ReplayError as exc:
        result, output = None, str(exc)
    decisions = Decisions(engine, decision_config, time.time)
    with engine.begin() as connection:
        diagnosis = record_replay(
            connection, run_id, incident_id, command, spec, result, output, started, time.time()
        )
        verdict = diagnosis.verdict.value if diagnosis else "failed"
        reason = diagnosis.reason if diagnosis else output[-300:]
        audit.append(
            connection,
            actor=actor,
            action="replay_verdict",
            subject=f"incident:{incident_id}",
            now=time.time(),
            run_id=run_id,
            incident_id=incident_id,
            reason=reason,
            details={"verdict": verdict, "evidence": result, "spec": spec},
        )
        proposal = decisions.repropose(connection, run_id, incident_id, actor) if diagnosis else None
    return {
        "incident": incident_id,
        "verdict": verdict,
        "reason": reason,
        "evidence": result,
        "proposal": proposal,
    }
