"""Findings into stored incidents (monitor/judge/incidents.py): the windows a carried-out
rollback abandoned, judged late, open no incident."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.judge.incidents import FINDING, INCIDENT, PROPOSAL, IncidentRecorder
from policies.incidents import GroupingConfig
from policies.types import Finding, Severity
from tests.support import make_run

OLD, NEW = "old-incarnation", "new-incarnation"


def nan_at(step: int, incarnation: str = OLD, rank: int = 0) -> Finding:
    return Finding(
        step=step,
        kind="nonfinite",
        severity=Severity.CRITICAL,
        signal="loss",
        value=float("nan"),
        threshold=None,
        message=f"rank {rank}: loss is nan at step {step}",
        incarnation=incarnation,
        rank=rank,
    )


def rolled_back(store: Engine, status: str, incident_status: str = "resolved") -> tuple[int, int]:
    """A run whose NaN at step 71 (incarnation OLD) was answered by a rollback to step 40."""
    run = make_run(store, "tail")
    incident: dict[str, Any] = {
        "run_id": run.id, "kind": "nonfinite", "severity": "critical", "status": incident_status,
        "first_step": 71, "last_step": 140, "incarnation": OLD, "summary": "loss is nan at step 71",
        "ranks": [1], "nodes": [], "devices": [], "finding_count": 3, "detected_step": 71,
        "scope": None, "opened_at": 1.0, "updated_at": 2.0, "closed_at": 2.0,
    }  # fmt: skip
    with store.begin() as connection:
        incident_id = connection.execute(INCIDENT.insert().returning(INCIDENT.c.id), incident).scalar_one()
        connection.execute(
            PROPOSAL.insert(),
            {
                "run_id": run.id, "incident_id": incident_id, "action": "rollback", "status": status,
                "target_step": 40, "target_path": "/out/ckpt.pt", "data_action": "replay",
                "skip_batches": [], "verdict": "undetermined", "evidence": {}, "created_at": 1.5,
            },
        )  # fmt: skip
    return run.id, incident_id


def record(store: Engine, run_id: int, *findings: Finding) -> list[int]:
    recorder = IncidentRecorder(GroupingConfig(), lambda: 10.0)
    with store.begin() as connection:
        return recorder.record(connection, run_id, list(findings), detected_step=None)


def incidents(store: Engine) -> list[dict[str, Any]]:
    with store.connect() as connection:
        return [dict(r) for r in connection.execute(sa.select(INCIDENT).order_by(INCIDENT.c.id)).mappings()]


def findings(store: Engine) -> list[dict[str, Any]]:
    with store.connect() as connection:
        return [dict(r) for r in connection.execute(sa.select(FINDING).order_by(FINDING.c.id)).mappings()]


def test_the_abandoned_tail_judged_after_the_resolution_opens_nothing(store: Engine) -> None:
    run_id, handled = rolled_back(store, "done")
    touched = record(store, run_id, nan_at(143), nan_at(144, rank=2))
    assert touched == []  # nothing for the decision workflow to propose again
    assert [i["id"] for i in incidents(store)] == [handled] and incidents(store)[0]["status"] == "resolved"
    assert [f["incident_id"] for f in findings(store)] == [handled, handled]  # kept as evidence


def test_a_fault_after_the_resume_is_a_new_incident(store: Engine) -> None:
    run_id, handled = rolled_back(store, "done")
    assert len(record(store, run_id, nan_at(45, incarnation=NEW))) == 1
    assert [(i["incarnation"], i["first_step"]) for i in incidents(store) if i["id"] != handled] == [
        (NEW, 45)
    ]


def test_a_fault_before_the_checkpoint_is_not_in_the_abandoned_windows(store: Engine) -> None:
    run_id, handled = rolled_back(store, "done")
    assert len(record(store, run_id, nan_at(30))) == 1
    assert [(i["incarnation"], i["first_step"]) for i in incidents(store) if i["id"] != handled] == [
        (OLD, 30)
    ]


def test_a_rollback_not_carried_out_leaves_the_tail_to_the_usual_rules(store: Engine) -> None:
    run_id, _ = rolled_back(store, "pending")
    assert len(record(store, run_id, nan_at(144))) == 1
    assert len(incidents(store)) == 2


def test_while_the_incident_is_open_its_tail_still_grows_it(store: Engine) -> None:
    run_id, handled = rolled_back(store, "executing", incident_status="open")
    assert record(store, run_id, nan_at(150)) == [handled]
    assert incidents(store)[0]["last_step"] == 150 and len(incidents(store)) == 1
