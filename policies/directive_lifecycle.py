"""A directive's lifecycle, and what the ranks' acknowledgements make of it.

::

    pending --answered--> done        (a rollback: its proposal is executed)
       +----rank failed--> failed     (a rollback: its proposal failed)
       +----rank missed--> superseded (a rollback: reissued after the step the ranks passed;
                                       any other: withdrawn, its armed copies disarmed)
       +----retired------> superseded (its incarnation restarted: its ranks are gone)

Each rank answers a directive once, ``done``, ``missed`` (it was already past the step the
directive named) or ``failed``. A rollback is settled by its acknowledgements in that order of
precedence: one miss means the ranks would not act together, so it is reissued; else one
failure fails it; else it is done once every rank of the world answered. A directive without a
workflow behind it (a stack dump, a canary) is done once every rank it named answered, however,
unless a rank missed its step: then the ranks can never act on it together, and it is
withdrawn. Left pending, the ranks that armed it in time would keep it armed, and the
directive agreement (every rank's oldest armed id) would never again agree on anything: a
scheduled canary missed by one slow-starting rank blocked every later hold and rollback.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from enum import StrEnum


class DirectiveStatus(StrEnum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    SUPERSEDED = "superseded"


class AckStatus(StrEnum):
    DONE = "done"
    MISSED = "missed"
    """The rank was already past the directive's step: it cannot act with the others."""
    FAILED = "failed"


class DirectiveEffect(StrEnum):
    ROLLBACK_EXECUTED = "rollback_executed"
    """The proposal behind the rollback is done."""
    ROLLBACK_FAILED = "rollback_failed"
    REISSUE = "reissue"
    """Deliver the proposal's rollback again, at a step after the one a rank passed."""


@dataclass(frozen=True)
class Answered:
    rollback: bool
    """A rollback directive: its proposal is executed now."""


@dataclass(frozen=True)
class RankFailed:
    """A rank could not carry out a rollback."""


@dataclass(frozen=True)
class RankMissed:
    """A rank was already past a rollback's step."""


@dataclass(frozen=True)
class Withdrawn:
    """A rank was already past the step of a directive without a workflow (a canary): it is
    withdrawn, not reissued (a scheduled canary's next round comes on its own)."""


@dataclass(frozen=True)
class Retired:
    """A newer incarnation of the run started; this one's ranks can never answer."""


DirectiveEvent = Answered | RankFailed | RankMissed | Withdrawn | Retired

_TARGETS: dict[type[DirectiveEvent], DirectiveStatus] = {
    Answered: DirectiveStatus.DONE,
    RankFailed: DirectiveStatus.FAILED,
    RankMissed: DirectiveStatus.SUPERSEDED,
    Withdrawn: DirectiveStatus.SUPERSEDED,
    Retired: DirectiveStatus.SUPERSEDED,
}
OPEN = (DirectiveStatus.PENDING,)
"""Every event happens to a pending directive only: each settles it for good."""


class IllegalDirectiveTransition(ValueError):
    def __init__(self, status: DirectiveStatus, event: DirectiveEvent) -> None:
        super().__init__(f"a {status} directive cannot take {type(event).__name__}: it is settled")
        self.status = status
        self.event = event


@dataclass(frozen=True)
class DirectiveMove:
    status: DirectiveStatus
    effects: tuple[DirectiveEffect, ...] = ()


def advance(status: DirectiveStatus | str, event: DirectiveEvent) -> DirectiveMove:
    """(status, event) -> (new status, effects); ``IllegalDirectiveTransition`` for a
    directive already settled."""
    current = DirectiveStatus(status)
    if current not in OPEN:
        raise IllegalDirectiveTransition(current, event)
    return DirectiveMove(_TARGETS[type(event)], _effects(event))


def outcome(event: type[DirectiveEvent]) -> DirectiveStatus:
    return _TARGETS[event]


def _effects(event: DirectiveEvent) -> tuple[DirectiveEffect, ...]:
    if isinstance(event, Answered):
        return (DirectiveEffect.ROLLBACK_EXECUTED,) if event.rollback else ()
    if isinstance(event, RankFailed):
        return (DirectiveEffect.ROLLBACK_FAILED,)
    if isinstance(event, RankMissed):
        return (DirectiveEffect.REISSUE,)
    return ()


@dataclass(frozen=True)
class Ack:
    rank: int
    status: AckStatus


def settle_rollback(acks: Iterable[Ack], world: int) -> DirectiveEvent | None:
    """What a rollback's acknowledgements so far amount to; None while ranks are still to
    answer. ``world``: the ranks that must answer (the run's newest declared world size)."""
    answers = list(acks)
    statuses = {ack.status for ack in answers}
    if AckStatus.MISSED in statuses:
        return RankMissed()
    if AckStatus.FAILED in statuses:
        return RankFailed()
    if len({ack.rank for ack in answers}) >= world:
        return Answered(rollback=True)
    return None


def settle_simple(
    answered: Collection[int], wanted: Collection[int], missed: bool = False
) -> DirectiveEvent | None:
    """A directive without a workflow: answered once every rank it wants did, whatever each
    said (a rank that failed to dump its stacks is no reason to ask it again); withdrawn once
    one rank ``missed`` its step."""
    if missed:
        return Withdrawn()
    if wanted and set(wanted) <= set(answered):
        return Answered(rollback=False)
    return None
