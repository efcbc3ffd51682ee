"""A recovery proposal's lifecycle: its statuses, the events that move it, and what each
move asks the service to do.

::

    pending --approve--> approved --directive issued--> executing --rollback executed--> done
       |                                                   |  ^  \\--rollback failed---> failed
       |                                                   \\--/ directive reissued
       +--reject--> rejected
       +--supersede (new evidence)--> superseded
    escalated --reject--> rejected, --supersede--> superseded

A proposal opens pending, or escalated when it asks for a person (``action == "escalate"``):
an escalated one is never approved into an action. An approved quarantine-only proposal
stays approved (there is no directive to carry it out). The store persists the new status with
an UPDATE guarded by ``sources(event)``, so of two concurrent decisions exactly one wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ProposalStatus(StrEnum):
    PENDING = "pending"
    """Waiting for an operator (or the auto-approve policy)."""
    ESCALATED = "escalated"
    """Needs a person's judgement; it names no action to approve."""
    APPROVED = "approved"
    REJECTED = "rejected"
    SUPERSEDED = "superseded"
    """Replaced by a fresh proposal when new evidence changed the diagnosis."""
    EXECUTING = "executing"
    """Its rollback directive is out; the ranks have not all answered."""
    DONE = "done"
    FAILED = "failed"


class ProposalEffect(StrEnum):
    QUARANTINE = "quarantine"
    """Drain the named node or device through the configured action."""
    DELIVER_ROLLBACK = "deliver_rollback"
    """Issue the rollback directive naming the step at which every rank acts."""


@dataclass(frozen=True)
class Approve:
    rollback: bool
    """The proposal rewinds to a checkpoint: a directive must carry it out."""
    quarantine: bool
    """The proposal names a node or device to drain."""


@dataclass(frozen=True)
class Reject:
    pass


@dataclass(frozen=True)
class Supersede:
    pass


@dataclass(frozen=True)
class DirectiveIssued:
    """A rollback directive went out for the proposal (the first one, or a reissue after a
    rank had already passed the step the previous one named)."""


@dataclass(frozen=True)
class RollbackExecuted:
    pass


@dataclass(frozen=True)
class RollbackFailed:
    pass


ProposalEvent = Approve | Reject | Supersede | DirectiveIssued | RollbackExecuted | RollbackFailed

_AWAITING = frozenset({ProposalStatus.PENDING, ProposalStatus.ESCALATED})

# Each event: the statuses it may happen in, and the status it leads to.
_MOVES: dict[type[ProposalEvent], tuple[frozenset[ProposalStatus], ProposalStatus]] = {
    Approve: (frozenset({ProposalStatus.PENDING}), ProposalStatus.APPROVED),
    Reject: (_AWAITING, ProposalStatus.REJECTED),
    Supersede: (_AWAITING, ProposalStatus.SUPERSEDED),
    DirectiveIssued: (
        frozenset({ProposalStatus.APPROVED, ProposalStatus.EXECUTING}),
        ProposalStatus.EXECUTING,
    ),
    RollbackExecuted: (frozenset({ProposalStatus.EXECUTING}), ProposalStatus.DONE),
    RollbackFailed: (frozenset({ProposalStatus.EXECUTING}), ProposalStatus.FAILED),
}


def _in_order(statuses: frozenset[ProposalStatus]) -> tuple[ProposalStatus, ...]:
    return tuple(status for status in ProposalStatus if status in statuses)


LIVE = _in_order(frozenset(status for allowed, _ in _MOVES.values() for status in allowed))
"""Statuses something can still happen to: an incident with a live proposal gets no other."""
AWAITING_DECISION = _in_order(_AWAITING)
ROLLBACK_DECIDED = _in_order(
    frozenset({ProposalStatus.APPROVED, ProposalStatus.EXECUTING, ProposalStatus.DONE, ProposalStatus.FAILED})
)
"""An approved rollback proposal in any of these counts against the retry budget."""


class IllegalProposalTransition(ValueError):
    def __init__(self, status: ProposalStatus, event: ProposalEvent) -> None:
        allowed = ", ".join(sorted(sources(type(event)))) or "nothing"
        super().__init__(
            f"a {status} proposal cannot take {type(event).__name__} (it needs one of: {allowed})"
        )
        self.status = status
        self.event = event


@dataclass(frozen=True)
class ProposalMove:
    status: ProposalStatus
    effects: tuple[ProposalEffect, ...] = ()


def opened(action: str) -> ProposalStatus:
    """The status a new proposal starts in."""
    return ProposalStatus.ESCALATED if action == "escalate" else ProposalStatus.PENDING


def advance(status: ProposalStatus | str, event: ProposalEvent) -> ProposalMove:
    """(status, event) -> (new status, effects); ``IllegalProposalTransition`` when the event
    cannot happen to a proposal in that status."""
    current = ProposalStatus(status)
    allowed, target = _MOVES[type(event)]
    if current not in allowed:
        raise IllegalProposalTransition(current, event)
    return ProposalMove(target, _effects(event))


def sources(event: type[ProposalEvent]) -> tuple[ProposalStatus, ...]:
    """The statuses ``event`` may happen in, in declaration order: the guard of the UPDATE
    that persists it."""
    return _in_order(_MOVES[event][0])


def outcome(event: type[ProposalEvent]) -> ProposalStatus:
    """The status ``event`` leads to from any of its ``sources``."""
    return _MOVES[event][1]


def _effects(event: ProposalEvent) -> tuple[ProposalEffect, ...]:
    if not isinstance(event, Approve):
        return ()
    wanted = (
        (event.quarantine, ProposalEffect.QUARANTINE),
        (event.rollback, ProposalEffect.DELIVER_ROLLBACK),
    )
    return tuple(effect for flag, effect in wanted if flag)
