"""policies.responses: which automatic response a proposal gets, and what ends a hold."""

from __future__ import annotations

import dataclasses

import pytest

from policies.responses import (
    Release,
    Response,
    ResponseConfig,
    Situation,
    WindowSkips,
    releases_ranks,
    remedied_by_skip,
    respond,
)
from policies.types import Severity

HOLD_NONFINITE = ResponseConfig(nonfinite="hold")
WAITING = Situation(
    incident_kind="nonfinite",
    severity=Severity.CRITICAL,
    proposal_pending=True,
    auto_approved=False,
    run_live=True,
)


def test_nothing_is_done_automatically_by_default() -> None:
    config = ResponseConfig()
    assert all(config.for_kind(kind) is Response.NONE for kind in ResponseConfig.kinds())
    assert respond(WAITING, config).response is Response.NONE


def test_a_configured_kind_is_held_while_its_proposal_waits_for_a_person() -> None:
    decision = respond(WAITING, HOLD_NONFINITE)
    assert decision.response is Response.HOLD
    assert "policies.response.nonfinite = hold" in decision.reason and "10 min" in decision.reason


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"incident_kind": "spike"}, "no automatic response for spike"),
        ({"severity": Severity.WARNING}, "warning incident is not held"),
        ({"auto_approved": True}, "no decision to wait for"),
        ({"proposal_pending": False}, "no decision to wait for"),
        ({"run_live": False}, "no rank to hold"),
        ({"held_before": True}, "held once already"),
    ],
)
def test_no_hold_without_a_decision_to_wait_for_or_ranks_to_pause(
    change: dict[str, object], why: str
) -> None:
    decision = respond(dataclasses.replace(WAITING, **change), HOLD_NONFINITE)  # type: ignore[arg-type]
    assert decision.response is Response.NONE
    assert why in decision.reason


def test_a_kind_that_cannot_be_configured_gets_none() -> None:
    held_everything = ResponseConfig(**{kind: "hold" for kind in ResponseConfig.kinds()})  # type: ignore[arg-type]
    assert held_everything.for_kind("straggler") is Response.NONE
    assert (
        respond(dataclasses.replace(WAITING, incident_kind="hang"), held_everything).response is Response.NONE
    )


@pytest.mark.parametrize(
    "bad",
    [{"nonfinite": "skip_update"}, {"spike": "pause"}, {"hold_timeout_s": 0.0}, {"hold_timeout_s": -5.0}],
)
def test_a_value_that_cannot_be_used_is_refused_naming_the_field(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ResponseConfig(**bad)  # type: ignore[arg-type]


def test_only_an_approved_rollback_ends_a_hold_without_a_release_directive() -> None:
    assert not releases_ranks(Release.APPROVED)
    assert all(releases_ranks(r) for r in (Release.APPROVED_NO_ROLLBACK, Release.REJECTED, Release.TIMEOUT))


def test_a_skip_remedies_an_incident_only_when_the_trainer_skipped_every_window_everywhere() -> None:
    everywhere = [WindowSkips(4, 4), WindowSkips(4, 4)]
    assert remedied_by_skip("skip_update", everywhere)
    assert not remedied_by_skip("none", everywhere)  # a GradScaler's skip is judged as before
    assert not remedied_by_skip(None, everywhere)
    assert not remedied_by_skip("skip_update", [WindowSkips(4, 4), WindowSkips(4, 3)])  # one rank updated
    assert not remedied_by_skip("skip_update", [WindowSkips(4, 4), WindowSkips(4, 0)])
    assert not remedied_by_skip("skip_update", [])
