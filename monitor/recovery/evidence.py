"""Everything known about an incident's cause: replay verdicts and canary mismatches."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.recovery.replay_jobs import latest_evidence
from monitor.store import models
from policies.diagnosis import Evidence

FINDING = models.table_of(models.FindingRow)
STEP = models.table_of(models.StepRecord)

# Transient canary mismatches on one device that amount to hardware evidence: one can be a
# cosmic ray; a second on the same device is a marginal part (published SDC experience).
TRANSIENT_MISMATCHES_FOR_BLAME = 2


def incident_evidence(connection: Connection, incident: Any) -> Evidence:
    evidence = latest_evidence(connection, incident["id"])
    if evidence.canary_mismatch or evidence.devices_differ:
        return evidence
    blamed = _canary_blamed(connection, incident)
    if blamed is None:
        return evidence
    device, node, _why = blamed
    return replace(
        evidence, canary_mismatch=True, suspect_device=device, suspect_node=node, suspect_batches=()
    )


def _canary_blamed(connection: Connection, incident: Any) -> tuple[str | None, str | None, str] | None:
    """A device of this incident (its own for a canary incident; its ranks' devices otherwise)
    whose canary missed persistently, or transiently more than once. Where ranks have no
    device identity (the CPU), the node stands for it."""
    places = {(device, None) for device in incident["devices"] or []}
    places |= {(None, node) for node in incident["nodes"] or []} if not places else set()
    if incident["kind"] != "canary" and incident["ranks"]:
        rows = connection.execute(
            sa.select(STEP.c.device_uuid, STEP.c.node)
            .where(
                STEP.c.run_id == incident["run_id"],
                STEP.c.incarnation == incident["incarnation"],
                STEP.c.rank.in_(incident["ranks"]),
            )
            .distinct()
        ).all()
        places |= {(r.device_uuid, None if r.device_uuid else r.node) for r in rows}
    if not places:
        return None
    findings = connection.execute(
        sa.select(FINDING.c.device, FINDING.c.node, FINDING.c.evidence).where(
            FINDING.c.run_id == incident["run_id"], FINDING.c.kind == "canary_mismatch"
        )
    ).all()
    for device, node in sorted(places, key=str):
        mine = [
            f for f in findings if (f.device == device if device else (f.device is None and f.node == node))
        ]
        persistent = [f for f in mine if (f.evidence or {}).get("persistent")]
        if persistent or len(mine) >= TRANSIENT_MISMATCHES_FOR_BLAME:
            why = "persistent" if persistent else f"{len(mine)} transient"
            return device, mine[0].node, why
    return None
