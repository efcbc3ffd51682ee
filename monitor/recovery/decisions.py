"""The decision workflow: an incident becomes a recovery only through a recorded decision.

propose -> (operator or auto-approve policy) approve | reject -> directive at one step ->
every rank acknowledges -> the resume is checked against the chosen checkpoint. Each move is
an audit entry with who, when, why and the evidence. The decision logic itself is pure
(``policies.proposals``, ``policies.diagnosis``, ``policies.retries``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from monitor.judge.incidents import close_incident
from monitor.judge.resumes import FAILED, VERIFIED, resume_verified, rollback_awaiting, started_by_rollback
from monitor.recovery import checkpoints, directives, responses
from monitor.recovery.config import DecisionConfig
from monitor.recovery.evidence import incident_evidence
from monitor.recovery.quarantine import quarantine
from monitor.store import audit, models, queries
from monitor.store.queries import list_proposals, proposal_view  # the reads: callers still find them here
from policies import directive_lifecycle, proposal_lifecycle
from policies.diagnosis import Verdict, diagnose
from policies.directive_lifecycle import Ack, AckStatus, DirectiveEffect, DirectiveEvent
from policies.proposal_lifecycle import (
    Approve,
    DirectiveIssued,
    IllegalProposalTransition,
    ProposalEffect,
    ProposalEvent,
    ProposalMove,
    ProposalStatus,
    Reject,
    RollbackExecuted,
    RollbackFailed,
    Supersede,
)
from policies.proposals import IncidentFacts, Proposal, propose
from policies.remedies import Remedy, incident_remedy, stated_remedy
from policies.responses import Response
from policies.retries import Rollback, may_roll_back

PROPOSAL = models.table_of(models.Proposal)
INCIDENT = models.table_of(models.Incident)
SUMMARY = models.table_of(models.StepSummary)
STEP = models.table_of(models.StepRecord)
DIRECTIVE = models.table_of(models.Directive)
ACK = models.table_of(models.DirectiveAck)
INCARNATION = models.table_of(models.Incarnation)
FINDING = models.table_of(models.FindingRow)
RUN = models.table_of(models.Run)
RESUME = models.table_of(models.ResumeEvent)

# How many windows' batch ids a skip proposal may name.
MAX_SKIP_WINDOWS = 8

# Findings on a resume that fail its continuity check (a note on the data order does not).
RESUME_PROBLEMS = (
    "schedule_restarted",
    "data_cursor_reset",
    "data_cursor_mismatch",
    "optimizer_state_lost",
    "broken_resume",
)


# What an operator may do to a proposal, by the name the API and the CLI use.
DECISION_VERBS = ("approve", "reject")


class InvalidDecision(ValueError):
    """A decision refused before the proposal is looked at (no reason for a rejection)."""


@dataclass(frozen=True)
class Outcome:
    ok: bool
    message: str
    proposal: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        """The answer to a decision, the same from the API and from the CLI on the store."""
        return {"ok": self.ok, "message": self.message, "proposal": self.proposal}


def local_decider(name: str | None) -> str:
    """Who a decision made with the service's admin token, or on the store itself, is recorded
    as: no operator token vouches for it, so the name (the CLI's OS user) is marked local."""
    return f"local:{name or 'admin'}"


class Decisions:
    def __init__(self, engine: Engine, config: DecisionConfig, clock: Callable[[], float]) -> None:
        self._engine = engine
        self._config = config
        self._clock = clock
        self._lock = threading.Lock()

    # --- proposing -------------------------------------------------------------------------

    def consider(self, run_id: int, incident_ids: Sequence[int]) -> list[int]:
        """Propose a recovery for each touched incident that needs one and has none live."""
        created = []
        with self._lock, self._engine.begin() as connection:
            for incident_id in incident_ids:
                proposal_id = self._consider(connection, run_id, incident_id, actor="engine")
                if proposal_id is not None:
                    created.append(proposal_id)
        for proposal_id in created:
            self._auto_approve(proposal_id)
        return created

    def repropose(self, connection: Connection, run_id: int, incident_id: int, actor: str) -> int | None:
        """New evidence (a replay verdict, a canary): supersede a pending proposal with a fresh
        one, when the evidence changes the diagnosis."""
        now = self._clock()
        incident = (
            connection.execute(sa.select(INCIDENT).where(INCIDENT.c.id == incident_id)).mappings().first()
        )
        live = (
            connection.execute(
                sa.select(PROPOSAL.c.verdict).where(
                    PROPOSAL.c.incident_id == incident_id,
                    PROPOSAL.c.status.in_(_values(proposal_lifecycle.AWAITING_DECISION)),
                )
            )
            .scalars()
            .all()
        )
        if incident is not None and live:
            verdict = diagnose(incident_evidence(connection, incident)).verdict.value
            if all(v == verdict for v in live):
                return None  # nothing new to decide on
        stale = (
            connection.execute(
                PROPOSAL.update()
                .where(
                    PROPOSAL.c.incident_id == incident_id,
                    PROPOSAL.c.status.in_(_values(proposal_lifecycle.sources(Supersede))),
                )
                .values(
                    status=proposal_lifecycle.outcome(Supersede).value,
                    decided_at=now,
                    decided_by=actor,
                    decision_reason="new evidence",
                )
                .returning(PROPOSAL.c.id)
            )
            .scalars()
            .all()
        )
        for proposal_id in stale:
            audit.append(
                connection,
                actor=actor,
                action="proposal_superseded",
                subject=f"proposal:{proposal_id}",
                now=now,
                run_id=run_id,
                incident_id=incident_id,
                reason="new evidence",
            )
        return self._consider(connection, run_id, incident_id, actor=actor)

    def reconsider_ranks(self, run_id: int, ranks: Sequence[int]) -> list[int]:
        """Hardware evidence on these ranks' devices: re-propose their open incidents, and
        propose for the canary incidents themselves."""
        proposals = []
        with self._lock, self._engine.begin() as connection:
            incidents = connection.execute(
                sa.select(INCIDENT.c.id, INCIDENT.c.ranks, INCIDENT.c.kind).where(
                    INCIDENT.c.run_id == run_id, INCIDENT.c.status == "open"
                )
            ).all()
            for incident in incidents:
                if set(incident.ranks or []) & set(ranks):
                    proposal_id = self.repropose(connection, run_id, incident.id, actor="engine")
                    if proposal_id is not None:
                        proposals.append(proposal_id)
        return proposals

    def checkpoints_recorded(self, run_id: int, rows: Sequence[Mapping[str, Any]]) -> list[int]:
        """Checkpoints just recorded, each with its manifest (built off the training thread, it can
        land after the incident it could recover): an incident whose proposal awaits a decision
        having found no valid checkpoint, or only an older one, is decided again, once, when one
        of them precedes its first affected step. Only a newer target replaces the proposal (the
        old one superseded, saying by which checkpoint); anything else leaves it as it is."""
        steps = [int(row["step"]) for row in rows if row.get("manifest")]
        if not steps:
            return []
        created = []
        with self._lock, self._engine.begin() as connection:
            for awaiting in self._awaiting_older_target(connection, run_id, min(steps), max(steps)):
                proposal_id = self._retarget_to_newer(connection, run_id, awaiting)
                if proposal_id is not None:
                    created.append(proposal_id)
        for proposal_id in created:
            self._auto_approve(proposal_id)
        return created

    def _awaiting_older_target(
        self, connection: Connection, run_id: int, lowest_step: int, highest_step: int
    ) -> list[Any]:
        """Undecided proposals of open incidents that checkpoints at steps ``lowest_step`` to
        ``highest_step`` could improve: one precedes their first affected step, and they name no
        target or an older one (``_retarget_to_newer`` decides)."""
        return list(
            connection.execute(
                sa.select(PROPOSAL)
                .join(INCIDENT, INCIDENT.c.id == PROPOSAL.c.incident_id)
                .where(
                    PROPOSAL.c.run_id == run_id,
                    PROPOSAL.c.status.in_(_values(proposal_lifecycle.AWAITING_DECISION)),
                    INCIDENT.c.status == "open",
                    INCIDENT.c.first_step > lowest_step,
                    sa.or_(PROPOSAL.c.target_step.is_(None), PROPOSAL.c.target_step < highest_step),
                )
                .order_by(PROPOSAL.c.id)
            ).mappings()
        )

    def _retarget_to_newer(self, connection: Connection, run_id: int, awaiting: Any) -> int | None:
        """Supersede ``awaiting`` by a fresh proposal when the policies now rewind to a newer
        checkpoint than it did (or to one, where it found none); returns the fresh one's id."""
        incident = (
            connection.execute(sa.select(INCIDENT).where(INCIDENT.c.id == awaiting["incident_id"]))
            .mappings()
            .one()
        )
        now = self._clock()
        proposal = self._proposal(connection, run_id, incident, now)
        if proposal is None or proposal.target is None or proposal.action != "rollback":
            return None  # a rollback is still not what it gets (retries spent, no remedy)
        if awaiting["target_step"] is not None and proposal.target.step <= awaiting["target_step"]:
            return None  # the new checkpoint is not the better target: nothing to decide again
        reason = (
            f"checkpoint {proposal.target.key} at step {proposal.target.step} recorded with its "
            f"manifest: a rollback target before step {incident['first_step']}"
        )
        was = "escalation" if awaiting["status"] == ProposalStatus.ESCALATED.value else "proposal"
        if not _supersede(connection, awaiting["id"], proposal_lifecycle.sources(Supersede), reason, now):
            return None
        fresh = self._store(connection, run_id, incident, proposal, "engine", now)
        audit.append(
            connection,
            actor="engine",
            action="proposal_superseded",
            subject=f"proposal:{awaiting['id']}",
            now=now,
            run_id=run_id,
            incident_id=incident["id"],
            reason=f"{reason}; the {was} is replaced by proposal {fresh}",
            details={"replaced_by": fresh, "was": awaiting["status"], "target_step": awaiting["target_step"]},
        )
        return fresh

    def _consider(self, connection: Connection, run_id: int, incident_id: int, actor: str) -> int | None:
        incident = (
            connection.execute(sa.select(INCIDENT).where(INCIDENT.c.id == incident_id)).mappings().first()
        )
        if incident is None or incident["status"] != "open" or incident["severity"] == "info":
            return None
        responses.note_trainer_response(connection, incident, self._clock())
        live = connection.execute(
            sa.select(PROPOSAL.c.id, PROPOSAL.c.status).where(
                PROPOSAL.c.incident_id == incident_id,
                PROPOSAL.c.status.in_(_values(proposal_lifecycle.LIVE)),
            )
        ).first()
        if live is not None:
            self._hold_if_upgraded(connection, incident, live)
            return None
        now = self._clock()
        proposal = self._proposal(connection, run_id, incident, now)
        if proposal is None:
            return None
        return self._store(connection, run_id, incident, proposal, actor, now)

    def _hold_if_upgraded(self, connection: Connection, incident: Any, live: Any) -> None:
        """An incident that became critical after its proposal was made (a late rank's records
        judged with its window) gets the response a critical one is configured to get, while its
        proposal still waits for a person; ``respond`` holds an incident once at most."""
        responses_config = self._config.responses
        if incident["severity"] != "critical" or responses_config.for_kind(incident["kind"]) is Response.NONE:
            return
        if live.status not in proposal_lifecycle.AWAITING_DECISION:
            return
        responses.hold_if_configured(
            connection, incident, live.id, True, False, responses_config, self._clock()
        )

    def _proposal(self, connection: Connection, run_id: int, incident: Any, now: float) -> Proposal | None:
        """What the policies propose for an open incident now (nothing stored)."""
        # The target's files are read again right before it is chosen (confirmed_facts).
        known, unsafe = checkpoints.confirmed_facts(connection, run_id, incident["first_step"], now)
        # The incident being recovered makes its own later checkpoints unsafe (it is open).
        facts = IncidentFacts(
            key=incident["id"],
            kind=incident["kind"],
            first_step=incident["first_step"],
            last_step=incident["last_step"],
            current_step=self._highest_step(connection, run_id),
            batches=self._batches(connection, run_id, incident),
            remedy=self._remedy(connection, incident),
        )
        diagnosis = diagnose(incident_evidence(connection, incident))
        if incident["kind"] == "canary" and diagnosis.verdict is not Verdict.HARDWARE:
            return None  # one transient mismatch: the next canary round decides
        retry = may_roll_back(self._rollbacks(connection, run_id), incident["id"], now, self._config.retries)
        return propose(facts, known, unsafe, diagnosis, retry, self._config.proposals)

    def _store(
        self, connection: Connection, run_id: int, incident: Any, proposal: Proposal, actor: str, now: float
    ) -> int:
        status = proposal_lifecycle.opened(proposal.action)
        evidence = {
            "reasons": list(proposal.reasons),
            "diagnosis": {"verdict": proposal.diagnosis.verdict.value, "reason": proposal.diagnosis.reason},
            "rejected_checkpoints": {str(k): v for k, v in proposal.rejected_checkpoints.items()},
            "incident": {
                "kind": incident["kind"],
                "first_step": incident["first_step"],
                "last_step": incident["last_step"],
                "summary": incident["summary"],
                "ranks": incident["ranks"],
                "nodes": incident["nodes"],
                "devices": incident["devices"],
            },
            "auto_approve": proposal.auto_approve,
        }
        proposal_id = int(
            connection.execute(
                PROPOSAL.insert().returning(PROPOSAL.c.id),
                {
                    "run_id": run_id,
                    "incident_id": incident["id"],
                    "action": proposal.action,
                    "status": status.value,
                    "checkpoint_id": proposal.target.key if proposal.target else None,
                    "target_step": proposal.target.step if proposal.target else None,
                    "target_path": proposal.target.path if proposal.target else None,
                    "data_action": proposal.data_action.value,
                    "skip_batches": list(proposal.skip_batches),
                    "quarantine_node": proposal.quarantine_node,
                    "quarantine_device": proposal.quarantine_device,
                    "verdict": proposal.diagnosis.verdict.value,
                    "cost_steps": proposal.cost_steps,
                    "evidence": evidence,
                    "created_at": now,
                },
            ).scalar_one()
        )
        action = "escalated" if status is ProposalStatus.ESCALATED else "proposed"
        audit.append(
            connection,
            actor=actor,
            action=action,
            subject=f"proposal:{proposal_id}",
            now=now,
            run_id=run_id,
            incident_id=incident["id"],
            reason="; ".join(proposal.reasons),
            details={"proposal": view_of(connection, proposal_id)},
        )
        pending = status in proposal_lifecycle.AWAITING_DECISION  # an escalation waits for a person too
        responses.hold_if_configured(
            connection, incident, proposal_id, pending, proposal.auto_approve, self._config.responses, now
        )
        return proposal_id

    def _auto_approve(self, proposal_id: int) -> None:
        with self._engine.connect() as connection:
            row = connection.execute(
                sa.select(PROPOSAL.c.evidence, PROPOSAL.c.status).where(PROPOSAL.c.id == proposal_id)
            ).first()
        if row is not None and row.status == ProposalStatus.PENDING and row.evidence.get("auto_approve"):
            self.approve(proposal_id, "policy:auto-approve", "auto-approve policy for this incident kind")

    def _rollbacks(self, connection: Connection, run_id: int) -> list[Rollback]:
        rows = connection.execute(
            sa.select(PROPOSAL.c.incident_id, PROPOSAL.c.decided_at).where(
                PROPOSAL.c.run_id == run_id,
                PROPOSAL.c.action == "rollback",
                PROPOSAL.c.status.in_(_values(proposal_lifecycle.ROLLBACK_DECIDED)),
            )
        ).all()
        return [Rollback(r.incident_id, r.decided_at or 0.0) for r in rows]

    def _remedy(self, connection: Connection, incident: Any) -> Remedy:
        """What the incident's findings say remedies it: a finding that a rollback's own
        restore raised says it is not another rollback, and so is a broken resume of the
        incarnation a rollback started, whatever found it (the resume record, or the series
        checks of its first windows)."""
        evidence = connection.execute(
            sa.select(FINDING.c.evidence).where(FINDING.c.incident_id == incident["id"])
        ).scalars()
        stated = [stated_remedy(e) for e in evidence]
        if incident["kind"] == "broken_resume" and started_by_rollback(
            connection, incident["run_id"], incident["incarnation"]
        ):
            stated.append(Remedy.FIX_RESTORE)
        if responses.skipped_by_trainer(connection, incident):
            stated.append(Remedy.NONE)  # the trainer skipped every window's update itself
        return incident_remedy(incident["kind"], stated)

    def _highest_step(self, connection: Connection, run_id: int) -> int:
        return int(
            connection.execute(
                sa.select(sa.func.max(SUMMARY.c.step)).where(SUMMARY.c.run_id == run_id)
            ).scalar()
            or 0
        )

    def _batches(self, connection: Connection, run_id: int, incident: Any) -> tuple[str, ...]:
        rows = connection.execute(
            sa.select(STEP.c.sample_ids).where(
                STEP.c.run_id == run_id,
                STEP.c.incarnation == incident["incarnation"],
                STEP.c.step >= incident["first_step"],
                STEP.c.step <= min(incident["last_step"], incident["first_step"] + MAX_SKIP_WINDOWS - 1),
            )
        ).scalars()
        return tuple(dict.fromkeys(str(i) for ids in rows for i in (ids or [])))

    # --- deciding --------------------------------------------------------------------------

    def decide(self, verb: str, proposal_id: int, operator: str, reason: str | None) -> Outcome:
        """An operator's decision by its verb: what the API route and the CLI on the store call."""
        if verb not in DECISION_VERBS:
            raise InvalidDecision(f"no action {verb!r} on proposals (approve or reject)")
        if verb == "approve":
            return self.approve(proposal_id, operator, reason)
        if not (reason or "").strip():
            raise InvalidDecision("a rejection needs a reason")
        return self.reject(proposal_id, operator, reason or "")

    def approve(self, proposal_id: int, operator: str, reason: str | None) -> Outcome:
        now = self._clock()
        with self._lock, self._engine.begin() as connection:
            retargeted = self._retarget(connection, proposal_id, now)
            if retargeted is not None:
                return retargeted
            decided = self._decide(connection, proposal_id, _approval, operator, reason, now)
            if decided is None:
                return self._lost(connection, proposal_id, "approve")
            row, move = decided
            for effect in move.effects:
                if effect is ProposalEffect.QUARANTINE:
                    self._quarantine(connection, row, operator, now)
                elif effect is ProposalEffect.DELIVER_ROLLBACK:
                    self._deliver(connection, row, operator, now)
            rollback = ProposalEffect.DELIVER_ROLLBACK in move.effects
            responses.release_on_decision(connection, row, True, rollback, operator, now)
            return Outcome(
                True, f"proposal {proposal_id} approved by {operator}", view_of(connection, proposal_id)
            )

    def _retarget(self, connection: Connection, proposal_id: int, now: float) -> Outcome | None:
        """A rollback's checkpoint is checked again as it becomes the target (the path saved
        again since the proposal, or its files changed): if it no longer is the checkpoint it
        was, the proposal is superseded by a fresh one and this approval refused, naming it."""
        row = connection.execute(sa.select(PROPOSAL).where(PROPOSAL.c.id == proposal_id)).mappings().first()
        awaiting = _values(proposal_lifecycle.AWAITING_DECISION)
        if row is None or row["checkpoint_id"] is None or row["status"] not in awaiting:
            return None
        problem = checkpoints.target_problem(connection, row["run_id"], row["checkpoint_id"], now)
        if problem is None:
            return None
        if not _supersede(connection, proposal_id, proposal_lifecycle.AWAITING_DECISION, problem, now):
            return None  # decided meanwhile: the decision below says how
        audit.append(
            connection,
            actor="engine",
            action="proposal_superseded",
            subject=f"proposal:{proposal_id}",
            now=now,
            run_id=row["run_id"],
            incident_id=row["incident_id"],
            reason=problem,
        )
        fresh = self._consider(connection, row["run_id"], row["incident_id"], actor="engine")
        instead = f"proposal {fresh} replaces it" if fresh is not None else "no new proposal was made"
        return Outcome(
            False,
            f"proposal {proposal_id} was not approved: its target {problem}; {instead}",
            view_of(connection, fresh if fresh is not None else proposal_id),
        )

    def reject(self, proposal_id: int, operator: str, reason: str) -> Outcome:
        now = self._clock()
        with self._lock, self._engine.begin() as connection:
            decided = self._decide(connection, proposal_id, lambda _row: Reject(), operator, reason, now)
            if decided is None:
                return self._lost(connection, proposal_id, "reject")
            responses.release_on_decision(connection, decided[0], False, False, operator, now)
            return Outcome(
                True, f"proposal {proposal_id} rejected by {operator}", view_of(connection, proposal_id)
            )

    def _decide(
        self,
        connection: Connection,
        proposal_id: int,
        event_of: Callable[[sa.RowMapping], ProposalEvent],
        operator: str,
        reason: str | None,
        now: float,
    ) -> tuple[sa.RowMapping, ProposalMove] | None:
        """Move the proposal by the operator's event and audit it; None when the lifecycle
        refuses the event in the proposal's status, or another decision got there first (the
        update guarded by the event's source statuses is what makes one win)."""
        current = (
            connection.execute(sa.select(PROPOSAL).where(PROPOSAL.c.id == proposal_id)).mappings().first()
        )
        if current is None:
            return None
        event = event_of(current)
        try:
            move = proposal_lifecycle.advance(current["status"], event)
        except IllegalProposalTransition:
            return None
        won = (
            connection.execute(
                PROPOSAL.update()
                .where(
                    PROPOSAL.c.id == proposal_id,
                    PROPOSAL.c.status.in_(_values(proposal_lifecycle.sources(type(event)))),
                )
                .values(status=move.status.value, decided_by=operator, decided_at=now, decision_reason=reason)
            ).rowcount
            == 1
        )
        if not won:
            return None
        row = connection.execute(sa.select(PROPOSAL).where(PROPOSAL.c.id == proposal_id)).mappings().one()
        audit.append(
            connection,
            actor=operator,
            action=move.status.value,
            subject=f"proposal:{proposal_id}",
            now=now,
            run_id=row["run_id"],
            incident_id=row["incident_id"],
            reason=reason,
        )
        return row, move

    def _lost(self, connection: Connection, proposal_id: int, verb: str) -> Outcome:
        row = connection.execute(sa.select(PROPOSAL).where(PROPOSAL.c.id == proposal_id)).mappings().first()
        if row is None:
            return Outcome(False, f"no proposal {proposal_id}")
        who = f" by {row['decided_by']}" if row["decided_by"] else ""
        return Outcome(
            False,
            f"cannot {verb} proposal {proposal_id}: it is already {row['status']}{who}"
            + _live_instead(connection, row),
            view_of(connection, proposal_id),
        )

    def _quarantine(self, connection: Connection, row: Any, actor: str, now: float) -> None:
        run = connection.execute(sa.select(RUN.c.name).where(RUN.c.id == row["run_id"])).scalar_one()
        result = quarantine(
            connection,
            self._config.actions,
            run_id=row["run_id"],
            run=run,
            proposal_id=row["id"],
            node=row["quarantine_node"],
            device=row["quarantine_device"],
            reason=f"runhealth incident {row['incident_id']}: {row['evidence']['diagnosis']['reason']}",
            now=now,
        )
        audit.append(
            connection,
            actor=actor,
            action="quarantine",
            subject=f"proposal:{row['id']}",
            now=now,
            run_id=row["run_id"],
            incident_id=row["incident_id"],
            details=result,
        )

    def _deliver(
        self, connection: Connection, row: Any, actor: str, now: float, after_step: int | None = None
    ) -> int:
        """A rollback directive that names the step at which every rank acts."""
        # Refused before anything is written: only an approved or executing proposal is carried out.
        move = proposal_lifecycle.advance(row["status"], DirectiveIssued())
        step = directives.directive_step(
            connection, row["run_id"], self._config.poll_interval_s, self._config.margin, after_step or 0, now
        )
        avoid = [d for d in (row["quarantine_device"],) if d]
        directive_id = directives.create_directive(
            connection,
            row["run_id"],
            "rollback",
            created_by=actor,
            now=now,
            act_at_step=step,
            incident_id=row["incident_id"],
            payload={
                "proposal": row["id"],
                "checkpoint_path": row["target_path"],
                "checkpoint_step": row["target_step"],
                # The trainer's resume continues its consumed-example count from here.
                "checkpoint_consumed": self._consumed_at(connection, row["checkpoint_id"]),
                "skip_batches": row["skip_batches"],
                "avoid_devices": avoid,
                "avoid_nodes": [n for n in (row["quarantine_node"],) if n],
            },
        )
        connection.execute(
            PROPOSAL.update()
            .where(
                PROPOSAL.c.id == row["id"],
                PROPOSAL.c.status.in_(_values(proposal_lifecycle.sources(DirectiveIssued))),
            )
            .values(status=move.status.value, directive_id=directive_id)
        )
        audit.append(
            connection,
            actor=actor,
            action="directive",
            subject=f"directive:{directive_id}",
            now=now,
            run_id=row["run_id"],
            incident_id=row["incident_id"],
            details={"kind": "rollback", "act_at_step": step, "proposal": row["id"]},
        )
        return directive_id

    def _consumed_at(self, connection: Connection, checkpoint_id: int | None) -> int | None:
        """The consumed-example count the checkpoint recorded (None: unknown, or no target)."""
        if checkpoint_id is None:
            return None
        consumed = connection.execute(
            sa.select(checkpoints.CHECKPOINT.c.consumed).where(checkpoints.CHECKPOINT.c.id == checkpoint_id)
        ).scalar()
        return None if consumed is None else int(consumed)

    def expire_holds(self, among: Collection[int] | None = None) -> list[int]:
        """Holds whose timeout passed with their proposal undecided: released (the scheduler);
        only those of the runs ``among``, when given."""
        with self._lock, self._engine.begin() as connection:
            return responses.expire_holds(connection, self._clock(), among)

    # --- executing -------------------------------------------------------------------------

    def acknowledged(self, run_id: int, rows: Sequence[dict[str, Any]]) -> None:
        """Directive acknowledgements: all ranks done -> executed; a miss -> reissued later."""
        if not rows:
            return
        now = self._clock()
        with self._lock, self._engine.begin() as connection:
            for directive_id in sorted({r["directive_id"] for r in rows}):
                self._settle(
                    connection,
                    run_id,
                    directive_id,
                    [r for r in rows if r["directive_id"] == directive_id],
                    now,
                )

    def _settle(
        self, connection: Connection, run_id: int, directive_id: int, rows: list[dict[str, Any]], now: float
    ) -> None:
        directive = (
            connection.execute(sa.select(DIRECTIVE).where(DIRECTIVE.c.id == directive_id)).mappings().one()
        )
        for row in rows:
            audit.append(
                connection,
                actor=f"rank:{row['rank']}",
                action="acknowledged",
                subject=f"directive:{directive_id}",
                now=now,
                run_id=run_id,
                incident_id=directive["incident_id"],
                details={
                    "status": row["status"],
                    "step": row["step"],
                    "incarnation": row["incarnation"],
                    "detail": row["detail"],
                },
            )
        if directive["status"] not in directive_lifecycle.OPEN:
            return
        acks = connection.execute(
            sa.select(ACK.c.rank, ACK.c.status, ACK.c.step).where(ACK.c.directive_id == directive_id)
        ).all()
        event = self._settlement(connection, run_id, directive, acks)
        if event is None:
            return
        move = directive_lifecycle.advance(directive["status"], event)
        connection.execute(
            DIRECTIVE.update()
            .where(DIRECTIVE.c.id == directive_id, DIRECTIVE.c.status.in_(_values(directive_lifecycle.OPEN)))
            .values(status=move.status.value)
        )
        proposal_id = directive["payload"].get("proposal")
        for effect in move.effects:
            if effect is DirectiveEffect.REISSUE:
                self._reissue(connection, directive, proposal_id, max(a.step or 0 for a in acks), now)
            else:
                self._finish(connection, directive, proposal_id, effect, now)

    def _settlement(
        self, connection: Connection, run_id: int, directive: Any, acks: Sequence[Any]
    ) -> DirectiveEvent | None:
        """What the acknowledgements so far make of the directive. A directive without a
        workflow behind it (stack dumps, canaries) wants every rank it named, or every rank."""
        if directive["kind"] == "rollback":
            answers = [Ack(a.rank, AckStatus(a.status)) for a in acks]
            return directive_lifecycle.settle_rollback(answers, self._world(connection, run_id, acks))
        wanted = directive["ranks"] or range(self._world(connection, run_id, []))
        missed = any(a.status == AckStatus.MISSED for a in acks)
        return directive_lifecycle.settle_simple({a.rank for a in acks}, wanted, missed)

    def _all_resumed(self, connection: Connection, run_id: int, incarnation: str) -> bool:
        """Every rank of the new incarnation has said what it restored (resume records arrive in
        several batches)."""
        resumed = connection.execute(
            sa.select(sa.func.count())
            .select_from(RESUME)
            .where(RESUME.c.run_id == run_id, RESUME.c.incarnation == incarnation)
        ).scalar_one()
        world = connection.execute(
            sa.select(INCARNATION.c.world_size).where(
                INCARNATION.c.run_id == run_id, INCARNATION.c.incarnation == incarnation
            )
        ).scalar()
        return bool(resumed >= (world or 1))

    def _world(self, connection: Connection, run_id: int, acks: Sequence[Any]) -> int:
        return queries.newest_world_size(connection, run_id) or len(acks)

    def _reissue(
        self, connection: Connection, directive: Any, proposal_id: int | None, past: int, now: float
    ) -> None:
        row = connection.execute(sa.select(PROPOSAL).where(PROPOSAL.c.id == proposal_id)).mappings().one()
        try:
            new_id = self._deliver(connection, row, "engine", now, after_step=past)
        except IllegalProposalTransition:
            return  # the proposal was settled another way meanwhile: nothing left to carry out
        audit.append(
            connection,
            actor="engine",
            action="directive_reissued",
            subject=f"directive:{directive['id']}",
            now=now,
            run_id=directive["run_id"],
            incident_id=directive["incident_id"],
            reason=f"a rank was already past step {directive['act_at_step']}",
            details={"replaced_by": new_id},
        )

    def _finish(
        self,
        connection: Connection,
        directive: Any,
        proposal_id: int | None,
        effect: DirectiveEffect,
        now: float,
    ) -> None:
        """The rollback's proposal executed or failed with its directive. Executed, its resume
        is verified at once when every rank's resume record came before the last answer."""
        executed = effect is DirectiveEffect.ROLLBACK_EXECUTED
        if proposal_id is not None:
            self._move_proposal(connection, proposal_id, RollbackExecuted() if executed else RollbackFailed())
        audit.append(
            connection,
            actor="engine",
            action=effect.value,
            subject=f"proposal:{proposal_id}",
            now=now,
            run_id=directive["run_id"],
            incident_id=directive["incident_id"],
        )
        if executed and proposal_id is not None:
            self._verify_resume(connection, directive["run_id"], proposal_id, now)

    def _move_proposal(self, connection: Connection, proposal_id: int, event: ProposalEvent) -> None:
        """Persist an engine-driven move; a proposal the lifecycle says cannot take it (it was
        settled another way meanwhile) is left as it is."""
        status = connection.execute(sa.select(PROPOSAL.c.status).where(PROPOSAL.c.id == proposal_id)).scalar()
        if status is None:
            return
        try:
            move = proposal_lifecycle.advance(status, event)
        except IllegalProposalTransition:
            return
        connection.execute(
            PROPOSAL.update()
            .where(
                PROPOSAL.c.id == proposal_id,
                PROPOSAL.c.status.in_(_values(proposal_lifecycle.sources(type(event)))),
            )
            .values(status=move.status.value)
        )

    def resumed(self, run_id: int, rows: Sequence[dict[str, Any]]) -> None:
        """After an executed rollback, the resume's continuity verdict; a clean resume resolves
        the incident."""
        if not rows:
            return
        now = self._clock()
        with self._lock, self._engine.begin() as connection:
            claimed = {
                p["id"] for row in rows if (p := rollback_awaiting(connection, run_id, row)) is not None
            }
            for proposal_id in sorted(claimed):
                self._verify_resume(connection, run_id, proposal_id, now)

    def _verify_resume(self, connection: Connection, run_id: int, proposal_id: int, now: float) -> None:
        """Judge the resume a carried-out rollback led to, once: when the proposal is done (every
        rank answered) and every rank of the new incarnation said what it restored, whichever
        came last. Clean, the incident is resolved."""
        done = connection.execute(sa.select(PROPOSAL).where(PROPOSAL.c.id == proposal_id)).mappings().first()
        if (
            done is None
            or done["status"] != ProposalStatus.DONE.value
            or resume_verified(connection, proposal_id)
        ):
            return
        incarnation = self._resumed_incarnation(connection, run_id, done)
        if incarnation is None or not self._all_resumed(connection, run_id, incarnation):
            return
        problems = connection.execute(
            sa.select(FINDING.c.kind, FINDING.c.message).where(
                FINDING.c.run_id == run_id,
                FINDING.c.incarnation == incarnation,
                FINDING.c.kind.in_(RESUME_PROBLEMS),
            )
        ).all()
        verdict = "failed" if problems else "passed"
        resumed = connection.execute(
            sa.select(sa.func.count())
            .select_from(RESUME)
            .where(RESUME.c.run_id == run_id, RESUME.c.incarnation == incarnation)
        ).scalar_one()
        audit.append(
            connection,
            actor="engine",
            action=FAILED if problems else VERIFIED,
            subject=f"proposal:{done['id']}",
            now=now,
            run_id=run_id,
            incident_id=done["incident_id"],
            reason=f"continuity {verdict} against {done['target_path']} (step {done['target_step']})",
            details={
                "verdict": verdict,
                "incarnation": incarnation,
                "ranks": resumed,
                "problems": [p.message for p in problems[:8]],
            },
        )
        if problems:
            return
        close_incident(connection, done["incident_id"], now)
        audit.append(
            connection,
            actor="engine",
            action="incident_resolved",
            subject=f"incident:{done['incident_id']}",
            now=now,
            run_id=run_id,
            incident_id=done["incident_id"],
            reason="rolled back and resumed with continuity verified",
        )

    def _resumed_incarnation(self, connection: Connection, run_id: int, proposal: Any) -> str | None:
        """The incarnation that resumed from the rollback's checkpoint after its approval."""
        return connection.execute(
            sa.select(RESUME.c.incarnation)
            .where(
                RESUME.c.run_id == run_id,
                RESUME.c.received_at >= proposal["decided_at"],
                sa.or_(
                    RESUME.c.checkpoint_path == proposal["target_path"],
                    RESUME.c.checkpoint_step == proposal["target_step"],
                ),
            )
            .order_by(RESUME.c.id.desc())
            .limit(1)
        ).scalar()


def _approval(row: sa.RowMapping) -> Approve:
    return Approve(
        rollback=row["action"] == "rollback",
        quarantine=bool(row["quarantine_node"] or row["quarantine_device"]),
    )


def _supersede(
    connection: Connection, proposal_id: int, sources: Iterable[StrEnum], reason: str, now: float
) -> bool:
    """The engine supersedes one proposal, if it is still in one of ``sources`` (a decision
    that came meanwhile stands)."""
    return (
        connection.execute(
            PROPOSAL.update()
            .where(PROPOSAL.c.id == proposal_id, PROPOSAL.c.status.in_(_values(sources)))
            .values(
                status=proposal_lifecycle.outcome(Supersede).value,
                decided_at=now,
                decided_by="engine",
                decision_reason=reason,
            )
        ).rowcount
        == 1
    )


def _live_instead(connection: Connection, row: sa.RowMapping) -> str:
    """For a superseded proposal, the incident's proposal that awaits a decision now: the hold
    a trainer logs names the proposal it was sent with, and an escalation that a checkpoint's
    record superseded keeps its hold under the rollback that replaced it."""
    if row["status"] != ProposalStatus.SUPERSEDED.value:
        return ""
    live = connection.execute(
        sa.select(PROPOSAL.c.id, PROPOSAL.c.action)
        .where(
            PROPOSAL.c.incident_id == row["incident_id"],
            PROPOSAL.c.status.in_(_values(proposal_lifecycle.AWAITING_DECISION)),
        )
        .order_by(PROPOSAL.c.id.desc())
    ).first()
    return "" if live is None else f"; proposal {live.id} ({live.action}) replaces it"


def _values(statuses: Iterable[StrEnum]) -> list[str]:
    """Statuses as the plain strings the store binds."""
    return [status.value for status in statuses]


def view_of(connection: Connection, proposal_id: int) -> dict[str, Any]:
    row = (
        connection.execute(
            sa.select(PROPOSAL, RUN.c.name.label("run"))
            .join(RUN, RUN.c.id == PROPOSAL.c.run_id)
            .where(PROPOSAL.c.id == proposal_id)
        )
        .mappings()
        .one()
    )
    return proposal_view(row)


__all__ = [
    "DECISION_VERBS",
    "DecisionConfig",
    "Decisions",
    "InvalidDecision",
    "Outcome",
    "list_proposals",
    "local_decider",
    "view_of",
]
