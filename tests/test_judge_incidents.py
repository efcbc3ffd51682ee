"""Findings into stored incidents (monitor/judge/incidents.py): the windows a carried-out
rollback abandoned, judged late, open no incident."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.judge.incidents import ACK, FINDING, INCIDENT, PROPOSAL, IncidentRecorder
from monitor.recovery.directives import create_directive
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


def rolled_back(
    store: Engine, status: str, incident_status: str = "resolved", acknowledged: bool = True
) -> tuple[int, int]:
    """A run whose NaN at step 71 (incarnation OLD) was answered by a rollback to step 40 whose
    ranks acknowledged stopping at step 144 (unless not ``acknowledged``)."""
    run = make_run(store, "tail")
    incident: dict[str, Any] = {
        "run_id": run.id, "kind": "nonfinite", "severity": "critical", "status": incident_status,
        "first_step": 71, "last_step": 140, "incarnation": OLD, "summary": "loss is nan at step 71",
        "ranks": [1], "nodes": [], "devices": [], "finding_count": 3, "detected_step": 71,
        "scope": None, "opened_at": 1.0, "updated_at": 2.0, "closed_at": 2.0,
    }  # fmt: skip
    with store.begin() as connection:
        incident_id = connection.execute(INCIDENT.insert().returning(INCIDENT.c.id), incident).scalar_one()
        directive = create_directive(
            connection,
            run.id,
            "rollback",
            created_by="tests",
            now=1.5,
            act_at_step=144,
            incident_id=incident_id,
        )
        connection.execute(
            PROPOSAL.insert(),
            {
                "run_id": run.id, "incident_id": incident_id, "action": "rollback", "status": status,
                "target_step": 40, "target_path": "/out/ckpt.pt", "data_action": "replay",
                "skip_batches": [], "verdict": "undetermined", "evidence": {}, "created_at": 1.5,
                "directive_id": directive,
            },
        )  # fmt: skip
        for rank in range(2 if acknowledged else 0):
            connection.execute(
                ACK.insert(),
                {
                    "run_id": run.id, "directive_id": directive, "incarnation": OLD, "rank": rank,
                    "status": "done", "step": 144, "detail": None, "time": 1.6, "received_at": 1.6,
                    "content_hash": f"ack-{rank}",
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


def test_a_rollback_no_rank_acknowledged_leaves_the_tail_to_the_usual_rules(store: Engine) -> None:
    """No acknowledgement, no known stop: what comes later in the incarnation is judged as ever
    (a fault that comes back counts against the incident's retries)."""
    run_id, _ = rolled_back(store, "done", acknowledged=False)
    assert len(record(store, run_id, nan_at(144))) == 1
    assert len(incidents(store)) == 2


def test_before_the_resume_verified_the_tail_does_not_touch_the_incident(store: Engine) -> None:
    """Touched, the incident would be handed to the decision workflow again, which proposed a
    second recovery for it (an escalation, the rollback's checkpoint superseded meanwhile)."""
    run_id, handled = rolled_back(store, "executing", incident_status="open")
    assert record(store, run_id, nan_at(144)) == []
    assert len(incidents(store)) == 1 and incidents(store)[0]["last_step"] == 140
    assert [f["incident_id"] for f in findings(store)] == [handled]


def test_past_the_acknowledged_stop_the_incarnation_is_judged_as_ever(store: Engine) -> None:
    run_id, _ = rolled_back(store, "done")
    assert len(record(store, run_id, nan_at(145))) == 1


def loss_finding(step: int, kind: str, message: str) -> Finding:
    return Finding(
        step=step,
        kind=kind,
        severity=Severity.CRITICAL,
        signal="loss",
        value=11.0,
        threshold=3.0,
        message=message,
        incarnation=NEW,
    )


def test_a_spike_refined_into_a_broken_resume_is_summarised_by_the_finding_that_refined_it(
    store: Engine,
) -> None:
    """The operator reads the summary first: an incident that became a broken resume must not
    still say 'the loss spiked'. A later spike joining it does not change the summary back."""
    run_id = make_run(store, "refined").id
    record(store, run_id, loss_finding(301, "loss_spike", "loss 11.0 at step 301 is above 3.0"))
    record(
        store,
        run_id,
        loss_finding(302, "broken_resume", "after the restart at step 301 the weights were lost"),
    )
    record(store, run_id, loss_finding(303, "loss_spike", "loss 11.0 at step 303 is above 3.0"))
    (incident,) = incidents(store)
    assert incident["kind"] == "broken_resume"
    assert incident["summary"] == "after the restart at step 301 the weights were lost"
