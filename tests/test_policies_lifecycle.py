"""The proposal and directive lifecycles as pure transitions: every legal move, the refusals,
and what the acknowledgements make of a directive."""

from __future__ import annotations

import pytest

from policies import directive_lifecycle, proposal_lifecycle
from policies.directive_lifecycle import (
    Ack,
    AckStatus,
    Answered,
    DirectiveEffect,
    DirectiveStatus,
    IllegalDirectiveTransition,
    RankFailed,
    RankMissed,
    Retired,
    Withdrawn,
    settle_rollback,
    settle_simple,
)
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
    advance,
)

P = ProposalStatus
PLAIN = Approve(rollback=False, quarantine=False)

# Every legal (status, event) -> status of a proposal; everything else is refused.
LEGAL: dict[tuple[ProposalStatus, type[ProposalEvent]], ProposalStatus] = {
    (P.PENDING, Approve): P.APPROVED,
    (P.PENDING, Reject): P.REJECTED,
    (P.ESCALATED, Reject): P.REJECTED,
    (P.PENDING, Supersede): P.SUPERSEDED,
    (P.ESCALATED, Supersede): P.SUPERSEDED,
    (P.APPROVED, DirectiveIssued): P.EXECUTING,
    (P.EXECUTING, DirectiveIssued): P.EXECUTING,
    (P.EXECUTING, RollbackExecuted): P.DONE,
    (P.EXECUTING, RollbackFailed): P.FAILED,
}
EVENTS: tuple[ProposalEvent, ...] = (
    PLAIN,
    Reject(),
    Supersede(),
    DirectiveIssued(),
    RollbackExecuted(),
    RollbackFailed(),
)


@pytest.mark.parametrize("status", list(ProposalStatus))
@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_a_proposal_moves_only_along_its_lifecycle(status: ProposalStatus, event: ProposalEvent) -> None:
    target = LEGAL.get((status, type(event)))
    if target is None:
        with pytest.raises(IllegalProposalTransition, match=f"a {status} proposal cannot take"):
            advance(status, event)
    else:
        assert advance(status, event) == ProposalMove(target)
        assert status in proposal_lifecycle.sources(type(event))
        assert proposal_lifecycle.outcome(type(event)) is target


def test_the_refusal_names_what_the_event_needs() -> None:
    with pytest.raises(IllegalProposalTransition) as refused:
        advance("rejected", Approve(rollback=True, quarantine=False))
    assert str(refused.value) == "a rejected proposal cannot take Approve (it needs one of: pending)"
    assert (refused.value.status, type(refused.value.event)) == (P.REJECTED, Approve)


def test_an_unknown_status_is_an_error_not_a_move() -> None:
    with pytest.raises(ValueError, match="'lost' is not a valid ProposalStatus"):
        advance("lost", Reject())


@pytest.mark.parametrize(
    ("rollback", "quarantine", "effects"),
    [
        (True, False, (ProposalEffect.DELIVER_ROLLBACK,)),
        (False, True, (ProposalEffect.QUARANTINE,)),
        # The node is drained before the ranks are told to roll back away from it.
        (True, True, (ProposalEffect.QUARANTINE, ProposalEffect.DELIVER_ROLLBACK)),
        (False, False, ()),
    ],
)
def test_an_approval_asks_for_what_the_proposal_names(
    rollback: bool, quarantine: bool, effects: tuple[ProposalEffect, ...]
) -> None:
    move = advance(P.PENDING, Approve(rollback=rollback, quarantine=quarantine))
    assert move == ProposalMove(P.APPROVED, effects)


def test_a_new_proposal_opens_pending_unless_it_escalates() -> None:
    assert proposal_lifecycle.opened("rollback") is P.PENDING
    assert proposal_lifecycle.opened("quarantine") is P.PENDING
    assert proposal_lifecycle.opened("escalate") is P.ESCALATED


def test_the_status_groups_follow_the_moves() -> None:
    assert proposal_lifecycle.LIVE == (P.PENDING, P.ESCALATED, P.APPROVED, P.EXECUTING)
    assert proposal_lifecycle.AWAITING_DECISION == (P.PENDING, P.ESCALATED)
    assert proposal_lifecycle.ROLLBACK_DECIDED == (P.APPROVED, P.EXECUTING, P.DONE, P.FAILED)
    terminal = set(ProposalStatus) - set(proposal_lifecycle.LIVE)
    assert terminal == {P.REJECTED, P.SUPERSEDED, P.DONE, P.FAILED}
    for status in terminal:
        for event in EVENTS:
            with pytest.raises(IllegalProposalTransition):
                advance(status, event)


@pytest.mark.parametrize(
    ("event", "status", "effects"),
    [
        (Answered(rollback=True), DirectiveStatus.DONE, (DirectiveEffect.ROLLBACK_EXECUTED,)),
        (Answered(rollback=False), DirectiveStatus.DONE, ()),
        (RankFailed(), DirectiveStatus.FAILED, (DirectiveEffect.ROLLBACK_FAILED,)),
        (RankMissed(), DirectiveStatus.SUPERSEDED, (DirectiveEffect.REISSUE,)),
        (Withdrawn(), DirectiveStatus.SUPERSEDED, ()),
        (Retired(), DirectiveStatus.SUPERSEDED, ()),
    ],
)
def test_a_pending_directive_is_settled_once(
    event: directive_lifecycle.DirectiveEvent,
    status: DirectiveStatus,
    effects: tuple[DirectiveEffect, ...],
) -> None:
    assert directive_lifecycle.advance("pending", event) == directive_lifecycle.DirectiveMove(status, effects)
    assert directive_lifecycle.outcome(type(event)) is status
    for settled in set(DirectiveStatus) - {DirectiveStatus.PENDING}:
        with pytest.raises(IllegalDirectiveTransition, match=f"a {settled} directive cannot take"):
            directive_lifecycle.advance(settled, event)


def acks(*answers: tuple[int, str]) -> list[Ack]:
    return [Ack(rank, AckStatus(status)) for rank, status in answers]


def test_a_rollback_is_done_once_every_rank_of_the_world_answered_done() -> None:
    assert settle_rollback(acks((0, "done")), world=2) is None
    assert settle_rollback(acks((0, "done"), (0, "done")), world=2) is None  # one rank twice
    assert settle_rollback(acks((0, "done"), (1, "done")), world=2) == Answered(rollback=True)


def test_one_miss_reissues_a_rollback_before_anything_else_counts() -> None:
    """A rank past the step cannot act with the others: even with every rank answered, and a
    failure among them, the rollback goes out again at a later step."""
    answers = acks((0, "done"), (1, "failed"), (2, "missed"))
    assert settle_rollback(answers, world=3) == RankMissed()
    assert settle_rollback(acks((0, "failed")), world=3) == RankFailed()


def test_a_directive_without_a_workflow_waits_for_the_ranks_it_wants() -> None:
    assert settle_simple({0}, {0, 1}) is None
    assert settle_simple({0, 1, 2}, {0, 1}) == Answered(rollback=False)
    assert settle_simple({0}, ()) is None  # wanting no rank (an unknown world) settles nothing


def test_a_step_one_rank_missed_withdraws_a_directive_without_a_workflow() -> None:
    """The ranks that armed it in time would keep it armed, and the agreement would never again
    agree on any directive: withdrawn at the first miss, before the others answer."""
    assert settle_simple({3}, {0, 1, 2, 3}, missed=True) == Withdrawn()
    assert directive_lifecycle.advance("pending", Withdrawn()).status is DirectiveStatus.SUPERSEDED
