"""The decision workflow end to end on a real store and a real HTTP service."""

import json
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.api.server import BackgroundServer
from monitor.config import ServiceConfig
from monitor.recovery.config import ActionConfig, DecisionConfig
from monitor.recovery.decisions import list_proposals
from monitor.service import Service
from monitor.store import audit, models, queries
from monitor.store.operators import add_operator, revoke_operator
from policies.proposals import ProposalConfig
from policies.retries import RetryConfig
from tests.support import (
    ADMIN_TOKEN,
    INCARNATION,
    RunHandle,
    both_backends,
    checkpoint,
    cli_result,
    post,
    spiky_windows,
)

NEW_INCARNATION = "00000000-0000-4000-8000-0000000000bb"


def spiked_run(service: Service, run: RunHandle, tmp_path: Path) -> dict[str, Any]:
    """A 2-rank run with checkpoints at 20, 40 (tampered) and 70, and a loss spike at 65."""
    post(service, run, [{"kind": "run_start", "incarnation": INCARNATION, "time": 100.0, "world_size": 2}])
    post(
        service,
        run,
        [checkpoint(tmp_path, 20), checkpoint(tmp_path, 40, tamper=True), *spiky_windows(range(1, 65))],
    )
    post(service, run, [*spiky_windows(range(65, 75), spike=65), checkpoint(tmp_path, 70)])
    with service.engine.connect() as connection:
        (proposal,) = list_proposals(connection, run.name)
    return proposal


def test_the_proposal_rewinds_to_the_newest_valid_checkpoint_before_the_spike(
    service: Service, run: RunHandle, tmp_path: Path
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    assert (proposal["status"], proposal["action"], proposal["verdict"]) == (
        "pending",
        "rollback",
        "undetermined",
    )
    assert proposal["target"]["step"] == 20  # 40 fails its sha256, 70 is after the spike
    assert proposal["cost_steps"] == 74 - 20
    assert proposal["quarantine"] == {"node": None, "device": None}
    rejected = proposal["evidence"]["rejected_checkpoints"]
    assert any("sha256" in why for why in rejected.values())
    assert any("not before the first affected step" in why for why in rejected.values())


def test_a_checkpoint_recorded_after_the_incident_replaces_its_escalation_once(
    service: Service, run: RunHandle, tmp_path: Path
) -> None:
    """The manifest of the save at step 60 lands after the spike at 65 was decided (it is built
    off the training thread): the escalation is superseded by a rollback to 60, once."""
    post(service, run, [{"kind": "run_start", "incarnation": INCARNATION, "time": 100.0, "world_size": 2}])
    post(service, run, spiky_windows(range(1, 75), spike=65))
    with service.engine.connect() as connection:
        (escalated,) = list_proposals(connection, run.name)
    assert (escalated["action"], escalated["status"]) == ("escalate", "escalated")
    assert "no valid, finite checkpoint before step 65" in escalated["evidence"]["reasons"][0]
    assert "no checkpoint before step 65 is recorded yet" in escalated["evidence"]["reasons"][1]

    landed = checkpoint(tmp_path, 60)
    post(service, run, [landed])
    post(service, run, [landed])  # sent again: a duplicate, nothing to decide again
    post(service, run, [checkpoint(tmp_path, 70)])  # after the spike: no target
    with service.engine.connect() as connection:
        replaced, fresh = list_proposals(connection, run.name)
        story = audit.story(connection, fresh["incident"])
    assert (replaced["id"], replaced["status"]) == (escalated["id"], "superseded")
    assert (fresh["action"], fresh["status"], fresh["target"]["step"]) == ("rollback", "pending", 60)
    (superseded,) = [e for e in story if e["action"] == "proposal_superseded"]
    assert superseded["subject"] == f"proposal:{escalated['id']}"
    assert "checkpoint" in superseded["reason"] and "step 60" in superseded["reason"]
    assert f"the escalation is replaced by proposal {fresh['id']}" in superseded["reason"]
    assert [e["action"] for e in story].count("proposed") == 1


def test_a_newer_checkpoint_retargets_a_pending_proposal_and_an_older_or_invalid_one_does_not(
    service: Service, run: RunHandle, tmp_path: Path
) -> None:
    proposal = spiked_run(service, run, tmp_path)  # rewinds to 20 (40 is tampered)
    post(service, run, [checkpoint(tmp_path, 50, tamper=True)])  # invalid: no better target
    post(service, run, [checkpoint(tmp_path, 10)])  # older than the target
    with service.engine.connect() as connection:
        assert [p["id"] for p in list_proposals(connection, run.name)] == [proposal["id"]]
    post(service, run, [checkpoint(tmp_path, 60)])
    with service.engine.connect() as connection:
        old, fresh = list_proposals(connection, run.name)
    assert (old["status"], old["target"]["step"]) == ("superseded", 20)
    assert (fresh["status"], fresh["target"]["step"], fresh["cost_steps"]) == ("pending", 60, 74 - 60)
    assert "step 60" in old["reason"]


@pytest.fixture
def served(service: Service) -> Any:
    with BackgroundServer(service) as server:
        yield server


def operator(store: Engine, name: str) -> str:
    with store.begin() as connection:
        return add_operator(connection, name, actor="tests", now=1.0)


def test_an_operator_approves_from_the_cli_and_every_rank_gets_one_step(
    service: Service,
    store: Engine,
    run: RunHandle,
    tmp_path: Path,
    served: BackgroundServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    token = operator(store, "alice")
    code, out, _ = cli_result(
        capsys,
        "approve",
        str(proposal["id"]),
        "--reason",
        "spike at 65",
        "--url",
        served.url,
        "--token",
        token,
        "--json",
    )
    assert code == 0, out
    approved = json.loads(out)["proposal"]
    assert (approved["status"], approved["decided_by"]) == ("executing", "alice")
    response = httpx.get(
        f"{served.url}/v1/runs/{run.name}/directives",
        params={"incarnation": INCARNATION, "rank": 1},
        headers=run.headers,
    )
    (directive,) = [d for d in response.json()["directives"] if d["kind"] == "rollback"]
    assert directive["act_at_step"] > 74
    assert directive["payload"]["checkpoint_step"] == 20
    assert directive["payload"]["checkpoint_consumed"] == 8 * 20  # the checkpoint's count
    with store.connect() as connection:
        actions = [e["action"] for e in audit.story(connection, approved["incident"])]
    assert actions == ["incident_opened", "proposed", "approved", "directive"]
    assert audit.story  # the story is in order by construction (sequence numbers)


def test_unknown_and_revoked_tokens_cannot_approve(
    service: Service,
    store: Engine,
    run: RunHandle,
    tmp_path: Path,
    served: BackgroundServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    code, _, err = cli_result(
        capsys, "approve", str(proposal["id"]), "--url", served.url, "--token", "rh_op_nobody"
    )
    assert code == 2 and "operator token" in err
    token = operator(store, "bob")
    with store.begin() as connection:
        revoke_operator(connection, "bob", actor="tests", now=2.0, reason="left the team")
    code, _, err = cli_result(capsys, "approve", str(proposal["id"]), "--url", served.url, "--token", token)
    assert code == 2 and "refused" in err
    with store.connect() as connection:
        assert list_proposals(connection, run.name)[0]["status"] == "pending"


@both_backends
def test_two_concurrent_approvals_one_wins_the_other_is_told_why(
    service: Service, store: Engine, run: RunHandle, tmp_path: Path, served: BackgroundServer
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    tokens = [operator(store, "alice"), operator(store, "carol")]
    barrier, answers = threading.Barrier(2), []

    def approve(token: str) -> None:
        barrier.wait()
        answers.append(
            httpx.post(
                f"{served.url}/v1/proposals/{proposal['id']}/approve",
                json={"reason": "go"},
                headers={"Authorization": f"Bearer {token}"},
                timeout=30,
            )
        )

    threads = [threading.Thread(target=approve, args=(t,)) for t in tokens]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(a.status_code for a in answers) == [200, 409]
    loser = next(a for a in answers if a.status_code == 409).json()
    assert "already executing by" in loser["message"]
    with store.connect() as connection:
        assert audit.verify(connection).ok
        approvals = [e for e in audit.story(connection, proposal["incident"]) if e["action"] == "approved"]
    assert len(approvals) == 1


def test_a_rejection_needs_a_reason_and_is_recorded(
    service: Service,
    store: Engine,
    run: RunHandle,
    tmp_path: Path,
    served: BackgroundServer,
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    headers = {"Authorization": f"Bearer {operator(store, 'dave')}"}
    assert (
        httpx.post(f"{served.url}/v1/proposals/{proposal['id']}/reject", json={}, headers=headers).status_code
        == 422
    )
    done = httpx.post(
        f"{served.url}/v1/proposals/{proposal['id']}/reject",
        json={"reason": "known bad shard"},
        headers=headers,
    )
    assert done.status_code == 200 and done.json()["proposal"]["status"] == "rejected"


def ack(directive: int, rank: int, status: str, step: int) -> dict[str, Any]:
    return {
        "kind": "directive_ack",
        "directive_id": directive,
        "incarnation": INCARNATION,
        "rank": rank,
        "time": 500.0,
        "status": status,
        "step": step,
    }


def test_a_missed_step_is_reissued_then_all_done_and_a_clean_resume_resolves(
    service: Service, store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    outcome = service.decisions.approve(proposal["id"], "alice", "go")
    first = outcome.proposal["directive"]
    post(service, run, [ack(first, 0, "done", 80), ack(first, 1, "missed", 95)])
    with store.connect() as connection:
        current = list_proposals(connection, run.name)[0]
    second = current["directive"]
    assert second != first and current["status"] == "executing"
    post(service, run, [ack(second, 0, "done", 105), ack(second, 1, "done", 105)])
    with store.connect() as connection:
        assert list_proposals(connection, run.name)[0]["status"] == "done"
    restored = {
        "optimizer_step": 20,
        "exp_avg_norm": 0.1,
        "exp_avg_sq_norm": 0.01,
        "lr": 1e-3,
        "scheduler_last_epoch": 20,
        "consumed": 160,
    }
    post(
        service,
        run,
        [{"kind": "run_start", "incarnation": NEW_INCARNATION, "time": 600.0, "world_size": 2}]
        + [
            {
                "kind": "resume",
                "incarnation": NEW_INCARNATION,
                "rank": r,
                "time": 600.0,
                "checkpoint_path": str(tmp_path / "ckpt-20"),
                "restored": {**restored, "first_sample_ids": [f"b21-{r}"]},
            }
            for r in range(2)
        ],
    )
    with store.connect() as connection:
        incident = queries.get_incident(connection, proposal["incident"])
    assert incident["status"] == "resolved"
    actions = [e["action"] for e in incident["story"]]
    assert actions[-2:] == ["resume_verified", "incident_resolved"]
    assert "directive_reissued" in actions


def resumes(tmp_path: Path, step: int, **restored: Any) -> list[dict[str, Any]]:
    """The new incarnation's start and both ranks' resume records from ``ckpt-STEP``, what they
    restored faithful unless ``restored`` says otherwise; the first batches drawn at random."""
    faithful = {
        "optimizer": {"param_states": 6, "trainable_params": 6, "optimizer_step_max": step, "lr": [1e-3]},
        "exp_avg_norm": 0.1,
        "exp_avg_sq_norm": 0.01,
        "scheduler_last_epoch": step,
        "consumed": 8 * step,
    }
    return [{"kind": "run_start", "incarnation": NEW_INCARNATION, "time": 600.0, "world_size": 2}] + [
        {
            "kind": "resume",
            "incarnation": NEW_INCARNATION,
            "rank": r,
            "time": 600.0,
            "checkpoint_path": str(tmp_path / f"ckpt-{step}"),
            "restored": {**faithful, **restored, "first_sample_ids": [f"random-{r}-{step * 31 % 17}"]},
        }
        for r in range(2)
    ]


def findings_of(store: Engine, run: RunHandle) -> list[dict[str, Any]]:
    with store.connect() as connection:
        table = models.table_of(models.FindingRow)
        rows = connection.execute(sa.select(table).where(table.c.run_id == run.id).order_by(table.c.id))
        return [dict(row) for row in rows.mappings()]


def test_a_rollback_whose_resume_verifies_resolves_its_incident_whatever_arrives_first(
    service: Service, store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    directive = service.decisions.approve(proposal["id"], "alice", "go").proposal["directive"]
    post(service, run, [ack(directive, 0, "done", 80)])
    # Every rank's resume record comes before the last rank's answer.
    post(service, run, resumes(tmp_path, 20))
    with store.connect() as connection:
        assert queries.get_incident(connection, proposal["incident"])["status"] == "open"
    post(service, run, [ack(directive, 1, "done", 80)])
    with store.connect() as connection:
        incident = queries.get_incident(connection, proposal["incident"])
        (done,) = list_proposals(connection, run.name)
    assert (incident["status"], done["status"]) == ("resolved", "done")
    story = incident["story"]
    assert [e["action"] for e in story][-2:] == ["resume_verified", "incident_resolved"]
    assert story[-2]["details"]["verdict"] == "passed" and story[-2]["details"]["ranks"] == 2
    # The first batches drawn at random after the restart are one note, not a failed check.
    after = [f for f in findings_of(store, run) if f["incarnation"] == NEW_INCARNATION]
    assert [(f["kind"], f["severity"]) for f in after] == [("data_order_not_reproducible", "info")]


def test_a_resume_check_failing_after_a_rollback_proposes_no_second_rollback(
    service: Service, store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    directive = service.decisions.approve(proposal["id"], "alice", "go").proposal["directive"]
    post(service, run, [ack(directive, 0, "done", 80), ack(directive, 1, "done", 80)])
    # The rollback's own restore loses the optimizer's state (the learning rate is intact).
    lost = {"param_states": 0, "trainable_params": 6, "lr": [1e-3]}
    post(service, run, resumes(tmp_path, 20, optimizer=lost))
    with store.connect() as connection:
        spike = queries.get_incident(connection, proposal["incident"])
        proposals = list_proposals(connection, run.name)
        broken = connection.execute(
            sa.select(models.Incident.id, models.Incident.status, models.Incident.severity).where(
                models.Incident.run_id == run.id, models.Incident.kind == "broken_resume"
            )
        ).all()
    assert spike["status"] == "open"
    assert spike["story"][-1]["action"] == "resume_failed"
    assert spike["story"][-1]["details"]["verdict"] == "failed"
    (incident,) = broken
    assert (incident.status, incident.severity) == ("open", "critical")
    lost_state = [f for f in findings_of(store, run) if f["kind"] == "optimizer_state_lost"]
    assert len(lost_state) == 2 and all(f["evidence"]["remedy"] == "fix_restore" for f in lost_state)
    assert "rollback proposal" in lost_state[0]["message"]
    assert [p["id"] for p in proposals] == [proposal["id"]]  # none for the broken resume
    # More evidence on it later still proposes nothing: no loop.
    post(service, run, spiky_windows(range(21, 30), incarnation=NEW_INCARNATION))
    assert service.decisions.consider(run.id, [incident.id]) == []
    with store.connect() as connection:
        assert [p["id"] for p in list_proposals(connection, run.name)] == [proposal["id"]]


def test_a_broken_resume_the_series_finds_after_a_rollback_proposes_no_rollback(
    service: Service, store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    post(service, run, [{"kind": "run_start", "incarnation": INCARNATION, "time": 100.0, "world_size": 2}])
    warming = [{**w, "lr": 1e-5} if w["attempt"] == 1 else w for w in spiky_windows(range(1, 65))]
    post(service, run, [checkpoint(tmp_path, 20), *warming])
    post(service, run, spiky_windows(range(65, 75), spike=65))
    with store.connect() as connection:
        (proposal,) = list_proposals(connection, run.name)
    directive = service.decisions.approve(proposal["id"], "alice", "go").proposal["directive"]
    post(service, run, [ack(directive, 0, "done", 80), ack(directive, 1, "done", 80), *resumes(tmp_path, 20)])
    with store.connect() as connection:
        assert queries.get_incident(connection, proposal["incident"])["status"] == "resolved"
    # The resume record was faithful, but the rollback's restore built a fresh scheduler: its
    # windows are back at the warm-up learning rate, which the series check finds.
    restarted = [{**w, "lr": 1e-5} for w in spiky_windows(range(21, 30), incarnation=NEW_INCARNATION)]
    post(service, run, restarted)
    with store.connect() as connection:
        broken = connection.execute(
            sa.select(models.Incident.id, models.Incident.status).where(
                models.Incident.run_id == run.id, models.Incident.kind == "broken_resume"
            )
        ).all()
        assert [p["id"] for p in list_proposals(connection, run.name)] == [proposal["id"]]
    (incident,) = broken
    assert incident.status == "open"
    kinds = {f["kind"] for f in findings_of(store, run) if f["incident_id"] == incident.id}
    assert kinds == {"schedule_restarted"}


def test_the_same_broken_resume_by_hand_is_rolled_back(
    service: Service, store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    post(service, run, [{"kind": "run_start", "incarnation": INCARNATION, "time": 100.0, "world_size": 2}])
    post(service, run, [checkpoint(tmp_path, 20), *spiky_windows(range(1, 40))])
    post(service, run, resumes(tmp_path, 20, optimizer={"param_states": 0, "trainable_params": 6}))
    with store.connect() as connection:
        (proposal,) = list_proposals(connection, run.name)
    assert (proposal["action"], proposal["target"]["step"]) == ("rollback", 20)
    assert proposal["evidence"]["incident"]["kind"] == "broken_resume"


def test_retries_are_bounded_per_incident(store: Engine, run: RunHandle, tmp_path: Path) -> None:
    config = ServiceConfig(
        admin_token=ADMIN_TOKEN, decisions=DecisionConfig(retries=RetryConfig(per_incident=1))
    )
    service = Service(store, config)
    proposal = spiked_run(service, run, tmp_path)
    service.decisions.approve(proposal["id"], "alice", "first try")
    with store.begin() as connection:  # the rollback ran; the same fault comes back
        connection.execute(sa.update(models.Proposal).values(status="done"))
    post(service, run, spiky_windows(range(75, 78), spike=76))
    with store.connect() as connection:
        newest = list_proposals(connection, run.name)[-1]
    assert (newest["action"], newest["status"]) == ("escalate", "escalated")
    assert "escalate" in newest["evidence"]["reasons"][0]


def test_auto_approve_is_opt_in_per_kind_and_hardware_quarantine_runs_its_command(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    config = ServiceConfig(
        admin_token=ADMIN_TOKEN,
        decisions=DecisionConfig(
            proposals=ProposalConfig(auto_approve=frozenset({"spike"})),
            actions=ActionConfig(command=f"{sys.executable} -c \"print('drain {{node}}')\"", live=True),
        ),
    )
    service = Service(store, config)
    proposal = spiked_run(service, run, tmp_path)
    with store.connect() as connection:
        current = list_proposals(connection, run.name)[0]
    assert (current["status"], current["decided_by"]) == ("executing", "policy:auto-approve")
    assert proposal["quarantine"]["node"] is None  # undetermined never quarantines
    with store.connect() as connection:
        assert connection.execute(sa.select(sa.func.count()).select_from(models.Action)).scalar_one() == 0


def test_a_replay_that_blames_the_data_reproposes_skipping_the_batch(
    service: Service, store: Engine, run: RunHandle, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    script = tmp_path / "replay.py"
    script.write_text(
        "import json, sys\n"
        "spec = json.load(open(sys.argv[1]))\n"
        "assert spec['checkpoint']['step'] == 20 and spec['first_affected_step'] == 65\n"
        "json.dump({'reproduced': True, 'skip_cleared': True, 'batches': spec['suspect_batches']}, open(sys.argv[2], 'w'))\n"
    )
    db = str(store.url.database)
    code, out, err = cli_result(
        capsys,
        "replay",
        str(proposal["incident"]),
        "--db",
        db,
        "--json",
        "--command",
        f"{sys.executable} {script} {{spec}} {{result}}",
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["verdict"] == "data"
    with store.connect() as connection:
        old, new = list_proposals(connection, run.name)
    assert old["status"] == "superseded"
    assert (new["verdict"], new["data_action"], new["skip_batches"]) == ("data", "skip", ["b65-0", "b65-1"])


def tamper(store: Engine, statement: str) -> None:
    with store.begin() as connection:
        connection.execute(sa.text(statement))


@pytest.mark.parametrize(
    ("statement", "broken"),
    [
        ("UPDATE audit_log SET reason = 'nothing to see' WHERE seq = 3", 3),
        ("DELETE FROM audit_log WHERE seq = 2", 3),
        ("UPDATE audit_log SET seq = CASE seq WHEN 2 THEN 3 WHEN 3 THEN 2 END WHERE seq IN (2, 3)", 2),
    ],
)
def test_audit_verify_catches_an_edit_a_deletion_and_a_swap(
    service: Service,
    store: Engine,
    run: RunHandle,
    tmp_path: Path,
    statement: str,
    broken: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    service.decisions.approve(
        proposal["id"], "alice", "go"
    )  # four entries: opened, proposed, approved, directive
    code, out, _ = cli_result(capsys, "audit", "verify", "--db", str(store.url.database), "--json")
    assert code == 0 and json.loads(out)["entries"] == 4
    if "CASE" in statement:  # prev_hash is unique: swap through a free value
        tamper(store, "UPDATE audit_log SET seq = 1000 WHERE seq = 2")
        tamper(store, "UPDATE audit_log SET seq = 2 WHERE seq = 3")
        tamper(store, "UPDATE audit_log SET seq = 3 WHERE seq = 1000")
    else:
        tamper(store, statement)
    code, out, _ = cli_result(capsys, "audit", "verify", "--db", str(store.url.database), "--json")
    document = json.loads(out)
    assert code == 1 and document["ok"] is False and document["broken_seq"] == broken


@both_backends
def test_a_conflict_no_other_writer_explains_is_reported_at_once(store: Engine) -> None:
    """A lost race is retried on the new tail as often as other writers win; a conflict on a
    tail that did not move (here a stray row already claiming the tail's hash) is not a race."""
    with store.begin() as connection:
        audit.append(connection, actor="a", action="note", subject="test:0", now=0.0)
        tail = connection.execute(sa.select(audit.AUDIT)).mappings().one()
        stray = {**tail, "seq": -1, "subject": "stray", "prev_hash": tail["hash"]}
        connection.execute(audit.AUDIT.insert(), stray)
    with store.begin() as connection, pytest.raises(RuntimeError, match="no other writer took it"):
        audit.append(connection, actor="a", action="note", subject="test:1", now=1.0)


@both_backends
def test_concurrent_appends_never_fork_the_chain(store: Engine) -> None:
    barrier = threading.Barrier(4)

    def writer(n: int) -> None:
        barrier.wait()
        for i in range(10):
            with store.begin() as connection:
                audit.append(
                    connection, actor=f"writer-{n}", action="note", subject=f"test:{i}", now=float(i)
                )

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with store.connect() as connection:
        checked = audit.verify(connection)
    assert checked.ok and checked.entries == 40
