"""monitor.recovery.responses: a hold issued with the proposal, ended by a decision or its
timeout, and a trainer's own skipped updates recorded; on a real store through the Service."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.config import ServiceConfig
from monitor.recovery.config import DecisionConfig
from monitor.recovery.decisions import list_proposals
from monitor.service import Service
from monitor.settings import service_config
from monitor.store import audit, models
from policies.responses import ResponseConfig
from policies.setting_error import ConfigError
from tests.support import ADMIN_TOKEN, INCARNATION, RunHandle, checkpoint, post, spiky_windows

DIRECTIVE = models.table_of(models.Directive)
NAN_AT = 41


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def held_service(store: Engine, clock: Clock, **responses: Any) -> Service:
    config = ServiceConfig(
        admin_token=ADMIN_TOKEN,
        decisions=DecisionConfig(responses=ResponseConfig(**responses)),
    )
    return Service(store, config, clock=clock)


def nan_windows(attempts: range, skipped: bool, step_of: Any) -> list[dict[str, Any]]:
    windows = spiky_windows(attempts)
    for window in windows:
        window["loss_sum"] = float("nan")
        window["skipped"] = skipped
        window["step"] = step_of(window["attempt"])
    return windows


def nan_run(
    service: Service,
    run: RunHandle,
    tmp_path: Path,
    *,
    skipped: bool = False,
    hook: dict[str, Any] | None = None,
) -> None:
    """Two ranks, a checkpoint at 20, a NaN loss from attempt 41 to 43 (skipped or not)."""
    config = {"runhealth_hook": hook} if hook else None
    post(
        service,
        run,
        [{"kind": "run_start", "incarnation": INCARNATION, "time": 100.0, "world_size": 2, "config": config}],
    )
    post(service, run, [checkpoint(tmp_path, 20), *spiky_windows(range(1, NAN_AT))])
    # A skipped update does not advance the step: the NaN windows stay at step 40.
    step_of = (lambda _a: NAN_AT - 1) if skipped else (lambda a: a)
    post(service, run, nan_windows(range(NAN_AT, NAN_AT + 3), skipped, step_of))
    later = spiky_windows(range(NAN_AT + 3, NAN_AT + 10))
    if skipped:
        for window in later:
            window["step"] -= 3
    post(service, run, later)


def directives_of(store: Engine, kind: str) -> list[dict[str, Any]]:
    with store.connect() as connection:
        rows = connection.execute(sa.select(DIRECTIVE).where(DIRECTIVE.c.kind == kind)).mappings()
        return [dict(row) for row in rows]


def story(store: Engine, incident: int) -> list[dict[str, Any]]:
    with store.connect() as connection:
        return list(audit.story(connection, incident))


def the_proposal(store: Engine, run: RunHandle) -> dict[str, Any]:
    with store.connect() as connection:
        proposals = list_proposals(connection, run.name)
    assert proposals, "no proposal"
    return proposals[-1]


def test_by_default_nothing_pauses_the_run(store: Engine, run: RunHandle, tmp_path: Path) -> None:
    nan_run(held_service(store, Clock()), run, tmp_path)
    assert the_proposal(store, run)["status"] == "pending"
    assert directives_of(store, "hold") == []


def test_a_hold_goes_out_with_the_proposal_and_is_in_the_incidents_story(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    nan_run(held_service(store, Clock(), nonfinite="hold", hold_timeout_s=120.0), run, tmp_path)
    proposal = the_proposal(store, run)
    (hold,) = directives_of(store, "hold")
    assert hold["incarnation"] == INCARNATION and hold["ranks"] is None  # every rank
    assert hold["payload"] == {"proposal": proposal["id"], "timeout_s": 120.0}
    assert hold["incident_id"] == proposal["incident"]
    entries = story(store, proposal["incident"])
    actions = [e["action"] for e in entries]
    assert actions.index("proposed") < actions.index("hold")
    held = next(e for e in entries if e["action"] == "hold")
    assert held["actor"] == "policy:response" and "policies.response.nonfinite = hold" in held["reason"]


def test_a_rejection_releases_every_rank_and_the_incident_is_not_held_again(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    service = held_service(store, Clock(), nonfinite="hold")
    nan_run(service, run, tmp_path)
    proposal = the_proposal(store, run)
    assert service.decisions.reject(proposal["id"], "alice", "a known bad shard").ok
    (hold,) = directives_of(store, "hold")
    (release,) = directives_of(store, "release")
    assert release["payload"] == {"hold": hold["id"], "proposal": proposal["id"], "reason": "rejected"}
    assert release["incarnation"] == INCARNATION and release["act_at_step"] == hold["act_at_step"]
    assert hold["payload"]["released"]["reason"] == "rejected"
    released = next(e for e in story(store, proposal["incident"]) if e["action"] == "hold_released")
    assert released["actor"] == "alice" and "rejected" in released["reason"]
    # The fault goes on; the next proposal for the same incident waits without a second hold.
    post(service, run, nan_windows(range(NAN_AT + 10, NAN_AT + 12), False, lambda a: a))
    post(service, run, spiky_windows(range(NAN_AT + 12, NAN_AT + 20)))
    assert len(directives_of(store, "hold")) == 1


def test_an_approved_rollback_ends_the_hold_with_its_own_directive(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    service = held_service(store, Clock(), nonfinite="hold")
    nan_run(service, run, tmp_path)
    proposal = the_proposal(store, run)
    assert proposal["action"] == "rollback"
    assert service.decisions.approve(proposal["id"], "alice", "roll back").ok
    assert directives_of(store, "release") == []  # held ranks act on the rollback where they are
    (rollback,) = directives_of(store, "rollback")
    (hold,) = directives_of(store, "hold")
    assert hold["payload"]["released"] == {"reason": "approved", "at": 1000.0, "release_directive": None}
    actions = [e["action"] for e in story(store, proposal["incident"])]
    assert actions.index("hold") < actions.index("approved") < actions.index("hold_released")
    assert rollback["payload"]["checkpoint_step"] == 20


def test_a_hold_times_out_on_the_services_clock_and_the_proposal_stays_pending(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    clock = Clock()
    service = held_service(store, clock, nonfinite="hold", hold_timeout_s=60.0)
    nan_run(service, run, tmp_path)
    clock.now += 59.0
    assert service.decisions.expire_holds() == []
    clock.now += 1.0
    (hold,) = directives_of(store, "hold")
    assert service.decisions.expire_holds() == [hold["id"]]
    assert service.decisions.expire_holds() == []  # released once
    (release,) = directives_of(store, "release")
    assert release["payload"]["reason"] == "timeout" and release["created_by"] == "engine"
    assert the_proposal(store, run)["status"] == "pending"


def test_a_spike_a_late_rank_makes_critical_is_held_then_and_once(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    """Rank 0 at step 40 against 2 peers is a warning: a pending rollback, no hold. Rank 3's records,
    late, make it critical against 3 peers: the configured hold goes out then, for the proposal
    still pending, and only once however often the incident is touched again."""
    clock = Clock()
    service = held_service(store, clock, spike="hold")
    start = {"kind": "run_start", "incarnation": INCARNATION, "time": 100.0, "world_size": 4}
    windows = spiky_windows(range(1, 46), ranks=4)
    at_40 = {0: (1, 6.0), 1: (10, 10.0), 2: (10, 25.0), 3: (10, 10.0)}  # (tokens, loss sum)
    for window in windows:
        if window["attempt"] == 40:
            window["tokens"], window["loss_sum"] = at_40[window["rank"]]
    post(service, run, [start, checkpoint(tmp_path, 20), *[w for w in windows if w["rank"] != 3]])
    clock.now += 60.0  # rank 3 given up on: its windows are judged without it
    service.judge_waiting()
    proposal = the_proposal(store, run)
    assert (proposal["action"], proposal["status"]) == ("rollback", "pending")
    assert directives_of(store, "hold") == []
    late = [w for w in windows if w["rank"] == 3]
    post(service, run, late)
    (hold,) = directives_of(store, "hold")
    assert hold["incident_id"] == proposal["incident"] and hold["payload"]["proposal"] == proposal["id"]
    assert the_proposal(store, run)["id"] == proposal["id"]  # the same proposal, not a new one
    post(service, run, late[-5:])
    service.judge_waiting()
    assert len(directives_of(store, "hold")) == 1


def test_a_nan_before_any_checkpoint_escalates_and_is_held_until_a_person_decides(
    store: Engine, run: RunHandle
) -> None:
    """No checkpoint yet (or its manifest still hashing): the proposal escalates. The run must not
    train on meanwhile, saving NaN weights over the checkpoint a rollback would need: the hold
    goes out with the escalation, and a rejection releases it."""
    service = held_service(store, Clock(), nonfinite="hold")
    post(service, run, [{"kind": "run_start", "incarnation": INCARNATION, "time": 100.0, "world_size": 2}])
    post(service, run, spiky_windows(range(1, NAN_AT)))
    post(service, run, nan_windows(range(NAN_AT, NAN_AT + 3), False, lambda a: a))
    post(service, run, spiky_windows(range(NAN_AT + 3, NAN_AT + 10)))
    proposal = the_proposal(store, run)
    assert (proposal["action"], proposal["status"]) == ("escalate", "escalated")
    (hold,) = directives_of(store, "hold")
    assert hold["payload"]["proposal"] == proposal["id"] and hold["incident_id"] == proposal["incident"]
    assert service.decisions.reject(proposal["id"], "alice", "no checkpoint: restart from scratch").ok
    (release,) = directives_of(store, "release")
    assert release["payload"]["hold"] == hold["id"] and release["payload"]["reason"] == "rejected"


def test_the_rollback_that_supersedes_a_held_escalation_keeps_the_hold_until_approved(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    service = held_service(store, Clock(), nonfinite="hold")
    post(service, run, [{"kind": "run_start", "incarnation": INCARNATION, "time": 100.0, "world_size": 2}])
    post(service, run, spiky_windows(range(1, NAN_AT)))
    post(service, run, nan_windows(range(NAN_AT, NAN_AT + 3), False, lambda a: a))
    escalated = the_proposal(store, run)
    post(service, run, [checkpoint(tmp_path, 20)])  # its manifest lands after the NaN was judged
    rollback = the_proposal(store, run)
    assert (rollback["action"], rollback["status"], rollback["target"]["step"]) == ("rollback", "pending", 20)
    assert rollback["id"] != escalated["id"] and rollback["incident"] == escalated["incident"]
    (hold,) = directives_of(store, "hold")
    assert directives_of(store, "release") == []  # superseding did not let the ranks go
    assert service.decisions.approve(rollback["id"], "alice", "roll back").ok
    (held,) = directives_of(store, "hold")
    assert held["id"] == hold["id"] and held["payload"]["released"]["reason"] == "approved"
    assert directives_of(store, "release") == []  # the rollback's own directive stops the held ranks


def test_a_finished_incarnation_is_not_held(store: Engine, run: RunHandle, tmp_path: Path) -> None:
    service = held_service(store, Clock(), nonfinite="hold")
    post(service, run, [{"kind": "run_start", "incarnation": INCARNATION, "time": 100.0, "world_size": 2}])
    post(
        service, run, [{"kind": "run_finish", "incarnation": INCARNATION, "time": 150.0, "status": "failed"}]
    )
    post(service, run, [checkpoint(tmp_path, 20), *spiky_windows(range(1, NAN_AT))])
    post(service, run, nan_windows(range(NAN_AT, NAN_AT + 3), False, lambda a: a))
    post(service, run, spiky_windows(range(NAN_AT + 3, NAN_AT + 10)))
    assert the_proposal(store, run)["status"] == "pending"
    assert directives_of(store, "hold") == []


def nonfinite_incident(store: Engine) -> int:
    with store.connect() as connection:
        return int(
            connection.execute(sa.text("SELECT id FROM incidents WHERE kind = 'nonfinite'")).scalar_one()
        )


def nonfinite_proposals(store: Engine, run: RunHandle) -> list[dict[str, Any]]:
    with store.connect() as connection:
        proposals = list_proposals(connection, run.name)
    return [p for p in proposals if p["evidence"]["incident"]["kind"] == "nonfinite"]


@pytest.mark.parametrize("stated", ["skip_update", "none"])
def test_a_trainers_own_skipped_updates_are_recorded_once_and_need_no_rollback(
    store: Engine, run: RunHandle, tmp_path: Path, stated: str
) -> None:
    service = held_service(store, Clock(), nonfinite="hold")
    nan_run(service, run, tmp_path, skipped=True, hook={"nonfinite_response": stated})
    post(service, run, spiky_windows(range(NAN_AT + 10, NAN_AT + 14)))  # touches it again
    incident = nonfinite_incident(store)
    skips = [e for e in story(store, incident) if e["action"] == "skip_update"]
    if stated == "none":  # skipped by something the trainer did not name: judged as before
        assert skips == [] and [p["action"] for p in nonfinite_proposals(store, run)] == ["rollback"]
        return
    (entry,) = skips
    assert entry["actor"] == "trainer" and entry["details"]["skipped_windows"] == 3
    # The weights are as before the NaN windows: nothing to rewind, nothing to hold for.
    assert nonfinite_proposals(store, run) == [] and directives_of(store, "hold") == []


def test_a_nan_window_the_trainer_did_not_skip_still_proposes_a_rollback(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    service = held_service(store, Clock())
    nan_run(service, run, tmp_path, skipped=True, hook={"nonfinite_response": "skip_update"})
    assert nonfinite_proposals(store, run) == []
    # Later one NaN window is updated (another optimizer, say): its weights may be NaN now.
    post(service, run, nan_windows(range(NAN_AT + 10, NAN_AT + 11), False, lambda a: a - 3))
    post(service, run, spiky_windows(range(NAN_AT + 11, NAN_AT + 20)))
    (proposal,) = nonfinite_proposals(store, run)
    assert proposal["action"] == "rollback" and proposal["target"]["step"] == 20


def test_the_response_is_a_service_setting_under_policies() -> None:
    config = service_config(
        {
            "RUNHEALTH_POLICIES__RESPONSE__NONFINITE": "hold",
            "RUNHEALTH_POLICIES__RESPONSE__HOLD_TIMEOUT_S": "90",
        }
    )
    assert config.decisions.responses == ResponseConfig(nonfinite="hold", hold_timeout_s=90.0)
    with pytest.raises(ConfigError, match="RUNHEALTH_POLICIES__RESPONSE__SPIKE"):
        service_config({"RUNHEALTH_POLICIES__RESPONSE__SPIKE": "skip_update"})
