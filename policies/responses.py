"""Automatic responses: what is done about a critical fault before a person decides.

A proposal waits for an operator; meanwhile the run trains on, and a nonfinite window that
trained on has put NaN into every weight (the run this was built from trained 177-293 steps on a
NaN before an approved rollback stopped it, and saved a checkpoint of NaN weights). Per incident
kind the user may ask for an automatic response:

- ``none`` (the default): nothing happens before the decision.
- ``hold`` (configured on the service, ``policies.response.<kind>``): the service issues a hold
  directive with the proposal; every rank pauses at the next agreed directive boundary until
  the proposal is decided (approved: its rollback stops the held ranks where they are;
  rejected: they resume together) or ``hold_timeout_s`` passes.
- ``skip_update`` (configured on the trainer, ``HookConfig.nonfinite_response``, for
  ``nonfinite`` only): the optimizer step of a nonfinite window is skipped on the device, as
  OLMo-core's ``SkipStepOptimizer`` does; no round trip to the service is needed. An incident
  whose every window was skipped that way on every rank left the model state as it was, so a
  rollback has nothing to undo (``remedied_by_skip``).

Each response is an audit-log entry (``monitor/recovery/responses.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Literal

from policies.types import Severity

ServiceResponse = Literal["none", "hold"]


class Response(StrEnum):
    NONE = "none"
    HOLD = "hold"


@dataclass(frozen=True)
class ResponseConfig:
    """The service's automatic response per incident kind (``none`` or ``hold``).

    Every kind defaults to ``none``: pausing a whole job is the user's choice to make (the
    reference text asks that recovery "follows the configured policy"). The kinds are those
    whose incidents propose a rollback; a hang already stopped the ranks, and a straggler or a
    link incident proposes none.

    ``hold_timeout_s`` 600: ten minutes, PyTorch's default collective timeout for NCCL: a job
    is already built to survive a stall of that length, and it is long enough for a paged
    operator to read the proposal. A hold idles every accelerator of the job for as long as it
    lasts, so it is bounded: past it the service releases the ranks and the proposal stays
    pending.
    """

    nonfinite: ServiceResponse = "none"
    spike: ServiceResponse = "none"
    amp: ServiceResponse = "none"
    broken_resume: ServiceResponse = "none"
    canary: ServiceResponse = "none"
    device: ServiceResponse = "none"
    hold_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for kind in self.kinds():
            value = getattr(self, kind)
            if value not in tuple(Response):
                raise ValueError(f"ResponseConfig.{kind} must be one of none, hold; got {value!r}")
        if not self.hold_timeout_s > 0:
            raise ValueError(f"ResponseConfig.hold_timeout_s must be > 0, got {self.hold_timeout_s}")

    @classmethod
    def kinds(cls) -> tuple[str, ...]:
        """The incident kinds a response can be configured for."""
        return tuple(item.name for item in fields(cls) if item.name != "hold_timeout_s")

    def for_kind(self, kind: str) -> Response:
        return Response(getattr(self, kind)) if kind in self.kinds() else Response.NONE


@dataclass(frozen=True)
class Situation:
    """What the response is decided on: the incident and the proposal just made for it."""

    incident_kind: str
    severity: Severity
    proposal_pending: bool
    """The proposal waits for a person: pending, or escalated. An escalation names nothing to
    approve yet, but the run must not train on meanwhile: a NaN judged before its checkpoint's
    manifest landed escalates "no valid checkpoint", and a trainer that saves over one file
    (nanoGPT, the DDP tutorial) then writes the NaN weights over the checkpoint a rollback would
    need, before the rollback that supersedes the escalation can be proposed."""
    auto_approved: bool
    """The auto-approve policy decides it at once: there is nothing to wait for."""
    run_live: bool
    """The incident's incarnation has not finished: there are ranks to pause."""
    held_before: bool = False
    """The incident was held once already (its proposal was then rejected, or timed out, or
    superseded): the operator had the chance to decide with the ranks paused."""


@dataclass(frozen=True)
class Decision:
    response: Response
    reason: str


def respond(situation: Situation, config: ResponseConfig) -> Decision:
    """The automatic response to a proposal just made: a hold only where it was asked for, for
    a critical incident whose proposal waits for a person, on a run still training, once per
    incident (a fault that goes on after a rejection would otherwise pause the run again at
    every new proposal)."""
    configured = config.for_kind(situation.incident_kind)
    if configured is Response.NONE:
        return Decision(Response.NONE, f"no automatic response for {situation.incident_kind}")
    if situation.severity is not Severity.CRITICAL:
        return Decision(Response.NONE, f"a {situation.severity} incident is not held")
    if situation.auto_approved or not situation.proposal_pending:
        return Decision(Response.NONE, "no decision to wait for")
    if not situation.run_live:
        return Decision(Response.NONE, "the incarnation has finished: no rank to hold")
    if situation.held_before:
        return Decision(Response.NONE, "this incident was held once already")
    minutes = config.hold_timeout_s / 60
    return Decision(
        Response.HOLD,
        f"policies.response.{situation.incident_kind} = hold: every rank pauses at the next agreed "
        f"boundary until the proposal is decided or {minutes:g} min pass",
    )


class Release(StrEnum):
    """Why a hold ended."""

    APPROVED = "approved"
    """Approved with a rollback: its directive stops the held ranks where they are."""
    APPROVED_NO_ROLLBACK = "approved_no_rollback"
    REJECTED = "rejected"
    TIMEOUT = "timeout"


def releases_ranks(release: Release) -> bool:
    """Whether the ranks are sent a release directive: not for an approved rollback, whose
    own directive ends the hold (held ranks act on it at once, at the step they hold at)."""
    return release is not Release.APPROVED


SKIP_UPDATE = "skip_update"


@dataclass(frozen=True)
class WindowSkips:
    """One window of an incident: how many ranks reported it and how many skipped its update."""

    ranks_reported: int
    skipped_ranks: int


def remedied_by_skip(stated_response: str | None, windows: Sequence[WindowSkips]) -> bool:
    """Whether the trainer's own ``skip_update`` already remedied an incident: it said it skips
    nonfinite updates, and every window the incident's findings name was skipped on every rank.
    One window that some rank updated may have written NaN into the weights: then a rollback is
    the remedy again."""
    return (
        stated_response == SKIP_UPDATE
        and bool(windows)
        and all(w.ranks_reported > 0 and w.skipped_ranks >= w.ranks_reported for w in windows)
    )
