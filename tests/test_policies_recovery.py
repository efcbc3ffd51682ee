"""Recovery decisions: target selection (property-tested), diagnosis, retries, proposals."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.checkpoints import (
    CheckpointFacts,
    OpenIncident,
    TaintConfig,
    manifest_digest,
    rejected_reasons,
    rewind_target,
    superseded,
    unsafe_checkpoints,
)
from policies.diagnosis import Evidence, Verdict, diagnose
from policies.proposals import (
    ContinuationPolicy,
    DataAction,
    IncidentFacts,
    ProposalConfig,
    act_at_step,
    current_step,
    propose,
)
from policies.remedies import Remedy, incident_remedy, stated_remedy, with_remedy
from policies.retries import RetryConfig, RetryDecision, Rollback, may_roll_back
from policies.types import Finding, Severity

checkpoint_sets = st.lists(
    st.builds(
        CheckpointFacts,
        key=st.integers(0, 10_000),
        step=st.integers(0, 500),
        path=st.just("/ckpt"),
        valid=st.sampled_from([True, True, True, False, None]),
        time=st.floats(0, 1e6),
    ),
    max_size=30,
    unique_by=lambda c: c.key,
)


@settings(max_examples=400, deadline=None)
@given(
    checkpoints=checkpoint_sets,
    first_affected=st.integers(0, 600),
    nonfinite=st.lists(st.integers(0, 600), max_size=3),
    open_incidents=st.lists(
        st.builds(
            lambda kind, first, length: OpenIncident(kind, first, first + length),
            st.sampled_from(["spike", "level_shift", "amp"]),
            st.integers(0, 600),
            st.integers(0, 100),
        ),
        max_size=3,
    ),
)
def test_the_target_is_never_invalid_unsafe_or_late_and_is_the_newest_that_qualifies(
    checkpoints: list[CheckpointFacts],
    first_affected: int,
    nonfinite: list[int],
    open_incidents: list[OpenIncident],
) -> None:
    unsafe = unsafe_checkpoints(checkpoints, nonfinite, open_incidents)
    target = rewind_target(checkpoints, first_affected, unsafe)
    qualifying = [
        c for c in checkpoints if c.valid is True and c.key not in unsafe and c.step < first_affected
    ]
    if target is None:
        assert qualifying == []
        return
    assert target.valid is True
    assert target.key not in unsafe
    assert target.step < first_affected
    assert all(not nonfinite or target.step < min(nonfinite) for _ in [0])
    assert target.step == max(c.step for c in qualifying)


def test_unsafe_covers_nonfinite_and_open_incidents() -> None:
    checkpoints = [CheckpointFacts(k, s, "/c") for k, s in enumerate([100, 200, 300, 400])]
    unsafe = unsafe_checkpoints(checkpoints, [350], [OpenIncident("level_shift", 250, 260)])
    assert sorted(unsafe) == [2, 3]
    assert "nonfinite" in unsafe[3] and "open incident" in unsafe[2]


def test_an_open_spike_taints_the_checkpoints_within_its_reach_and_no_later_ones() -> None:
    # pytorch/examples' word language model: one grad-norm warning at step 17, never resolved,
    # made every later save unsafe, so a NaN at 110 found no target before step 105.
    checkpoints = [
        CheckpointFacts(k, s, "/model.pt", valid=True) for k, s in enumerate([10, 21, 67, 68, 105])
    ]
    spike = OpenIncident("spike", 17, 17)
    unsafe = unsafe_checkpoints(checkpoints, [], [spike])
    assert sorted(unsafe) == [1, 2]  # steps 21 and 67 (17 + 50); 10 is before it
    assert unsafe[1] == "at or after step 17, the first affected step of an open incident"
    assert rewind_target(checkpoints, 110, unsafe) == checkpoints[4]
    assert sorted(unsafe_checkpoints(checkpoints, [], [spike], TaintConfig(spike_reach=100))) == [1, 2, 3, 4]
    # A level shift (a spike that stayed up) and every other kind taint every later checkpoint.
    assert sorted(unsafe_checkpoints(checkpoints, [], [OpenIncident("level_shift", 17, 25)])) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="spike_reach"):
        TaintConfig(spike_reach=-1)


def test_a_path_saved_again_supersedes_its_older_versions_which_are_never_targets() -> None:
    # (key, path, time): /a saved at times 1, 3 and 2 (reported out of order), /b once.
    replaced = superseded([(1, "/a", 1.0), (2, "/b", 1.5), (3, "/a", 3.0), (4, "/a", 2.0)])
    assert replaced == {1: 3, 4: 3}
    older = CheckpointFacts(1, 100, "/a", valid=True, superseded_by=3)
    current = CheckpointFacts(3, 50, "/a", valid=True, time=3.0)
    assert rewind_target([older, current], 200, {}) == current
    assert rewind_target([older], 200, {}) is None
    assert rejected_reasons([older], 200, {}) == {1: "superseded by checkpoint 3: /a was saved again"}


def test_a_manifest_digest_is_its_content_however_it_was_written() -> None:
    files = [{"path": "b.pt", "size": 2, "sha256": "2" * 64}, {"path": "a.pt", "size": 1, "sha256": "1" * 64}]
    manifest = {"step": 5, "files": files}
    reordered = {"files": files[::-1], "consumed": None, "step": 5}
    assert manifest_digest(manifest) == manifest_digest(reordered)
    assert len(manifest_digest(manifest)) == 64 and manifest_digest(None) == ""
    assert manifest_digest({**manifest, "step": 6}) != manifest_digest(manifest)
    assert manifest_digest({**manifest, "files": files[:1]}) != manifest_digest(manifest)


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(st.tuples(st.integers(1, 4), st.floats(0, 86_400 * 3)), max_size=60),
    config=st.builds(
        RetryConfig,
        per_incident=st.integers(1, 4),
        per_window=st.integers(1, 6),
        window_s=st.floats(60, 86_400),
    ),
)
def test_retries_stay_bounded_under_any_sequence(
    events: list[tuple[int, float]], config: RetryConfig
) -> None:
    history: list[Rollback] = []
    for incident, now in sorted(events, key=lambda e: e[1]):
        if may_roll_back(history, incident, now, config).allowed:
            history.append(Rollback(incident, now))
    for incident in {r.incident for r in history}:
        assert sum(1 for r in history if r.incident == incident) <= config.per_incident
    for r in history:
        assert (
            sum(1 for o in history if o.time <= r.time and r.time - o.time < config.window_s)
            <= config.per_window
        )


def test_blame_follows_evidence_only() -> None:
    assert diagnose(Evidence(canary_mismatch=True, suspect_device="GPU-3")).verdict is Verdict.HARDWARE
    assert diagnose(Evidence(devices_differ=True)).verdict is Verdict.HARDWARE
    data = diagnose(Evidence(replay_reproduced=True, skip_cleared=True, suspect_batches=("b7",)))
    assert (data.verdict, data.batches) == (Verdict.DATA, ("b7",))
    assert diagnose(Evidence(replay_reproduced=True, skip_cleared=False)).verdict is Verdict.UNDETERMINED
    not_reproduced = diagnose(Evidence(replay_reproduced=False))
    assert not_reproduced.verdict is Verdict.UNDETERMINED and "not evidence against" in not_reproduced.reason
    assert diagnose(Evidence()).verdict is Verdict.UNDETERMINED


CHECKPOINTS = (
    CheckpointFacts(1, 100, "/c/100", valid=True),
    CheckpointFacts(2, 200, "/c/200", valid=True),
    CheckpointFacts(3, 300, "/c/300", valid=False, problems=("model.pt: sha256 differs",)),
    CheckpointFacts(4, 400, "/c/400", valid=True),
)
INCIDENT = IncidentFacts(
    key=9, kind="spike", first_step=350, last_step=352, current_step=420, batches=("b1", "b2")
)
ALLOWED = RetryDecision(True, "rollback 1 of 2 for this incident")


def test_a_data_diagnosis_rewinds_past_the_invalid_checkpoint_and_skips_the_batches() -> None:
    diagnosis = diagnose(Evidence(replay_reproduced=True, skip_cleared=True, suspect_batches=("b2",)))
    proposal = propose(INCIDENT, CHECKPOINTS, {}, diagnosis, ALLOWED, ProposalConfig())
    assert proposal is not None and proposal.action == "rollback"
    assert proposal.target == CHECKPOINTS[1]  # 300 is invalid, 400 is after the first affected step
    assert (proposal.data_action, proposal.skip_batches) == (DataAction.SKIP, ("b2",))
    assert proposal.quarantine_node is None and proposal.cost_steps == 220
    assert "sha256" in proposal.rejected_checkpoints[3]


def test_undetermined_quarantines_nothing_and_replays_unless_the_policy_says_skip() -> None:
    undetermined = diagnose(Evidence(replay_reproduced=False))
    proposal = propose(INCIDENT, CHECKPOINTS, {}, undetermined, ALLOWED, ProposalConfig())
    assert proposal is not None
    assert (proposal.data_action, proposal.quarantine_node, proposal.quarantine_device) == (
        DataAction.REPLAY,
        None,
        None,
    )
    skipping = propose(
        INCIDENT,
        CHECKPOINTS,
        {},
        undetermined,
        ALLOWED,
        ProposalConfig(undetermined=ContinuationPolicy.SKIP_WINDOW),
    )
    assert skipping is not None and skipping.skip_batches == ("b1", "b2")
    assert any("skip_window" in r for r in skipping.reasons)


def test_hardware_quarantines_the_device_and_past_the_bound_escalates() -> None:
    hardware = diagnose(Evidence(canary_mismatch=True, suspect_device="GPU-3", suspect_node="n1"))
    proposal = propose(INCIDENT, CHECKPOINTS, {}, hardware, ALLOWED, ProposalConfig())
    assert proposal is not None and (proposal.quarantine_node, proposal.quarantine_device) == ("n1", "GPU-3")
    denied = RetryDecision(False, "incident 9 was rolled back 2 times (bound 2): escalate")
    escalated = propose(INCIDENT, CHECKPOINTS, {}, hardware, denied, ProposalConfig())
    assert escalated is not None and escalated.action == "escalate" and escalated.target is None


def test_an_escalation_names_the_good_checkpoint_a_save_after_the_fault_wrote_over() -> None:
    """A trainer that saves to one path (nanoGPT's ``out/ckpt.pt``) saved NaN weights over the
    last good state: the escalation says so and how to keep it next time."""
    nan = IncidentFacts(key=4, kind="nonfinite", first_step=121, last_step=140, current_step=160)
    before = CheckpointFacts(key=1, step=100, path="model.pt", valid=True, superseded_by=2)
    after = CheckpointFacts(key=2, step=150, path="model.pt", valid=True)
    proposal = propose(
        nan, (before, after), {2: "nonfinite"}, diagnose(Evidence()), ALLOWED, ProposalConfig()
    )
    assert proposal is not None and proposal.action == "escalate"
    assert proposal.reasons[1] == (
        "the checkpoint of step 100 (model.pt) was saved over at step 150, after the fault: keep each "
        "checkpoint under its own name, or hold the ranks on a nonfinite "
        "(policies.response.nonfinite=hold) so nothing saves before the decision"
    )
    # Saved over before the fault: that is the trainer's rotation, not a lost good state.
    earlier = replace(after, step=110)
    quiet = propose(nan, (before, earlier), {}, diagnose(Evidence()), ALLOWED, ProposalConfig())
    assert quiet is not None and quiet.target == earlier
    assert not any("saved over" in r for r in quiet.reasons)
    # A kind without a service response is told only to keep its checkpoints apart.
    shift = replace(nan, kind="level_shift")
    shifted = propose(shift, (before, after), {}, diagnose(Evidence()), ALLOWED, ProposalConfig())
    assert shifted is not None and shifted.reasons[1].endswith("keep each checkpoint under its own name")


def test_an_escalation_says_whether_no_save_was_recorded_yet_or_why_each_was_refused() -> None:
    """At 3 AM "no valid checkpoint" is not enough: a save not recorded yet (its files are hashed
    first) is proposed again when it lands; refused ones are named with their reasons."""
    nan = IncidentFacts(key=4, kind="nonfinite", first_step=121, last_step=140, current_step=160)
    none_yet = propose(nan, (), {}, diagnose(Evidence()), ALLOWED, ProposalConfig())
    assert none_yet is not None and none_yet.action == "escalate"
    assert none_yet.reasons[1] == (
        "no checkpoint before step 121 is recorded yet: a save is recorded once its files are "
        "hashed, and this is proposed again when one lands"
    )
    unhashed = CheckpointFacts(key=1, step=80, path="snapshot.pt", valid=None)
    tampered = CheckpointFacts(
        key=2, step=100, path="c/100", valid=False, problems=("model.pt: sha256 differs",)
    )
    refused = propose(nan, (tampered, unhashed), {}, diagnose(Evidence()), ALLOWED, ProposalConfig())
    assert refused is not None and refused.reasons[1] == (
        "2 checkpoint(s) before step 121, none usable "
        "(step 80: not validated; step 100: invalid: model.pt: sha256 differs)"
    )


def test_no_rollback_for_kinds_it_cannot_help_and_auto_approve_is_opt_in() -> None:
    straggler = IncidentFacts(key=1, kind="straggler", first_step=10, last_step=10, current_step=12)
    assert propose(straggler, CHECKPOINTS, {}, diagnose(Evidence()), ALLOWED, ProposalConfig()) is None
    proposal = propose(INCIDENT, CHECKPOINTS, {}, diagnose(Evidence()), ALLOWED, ProposalConfig())
    assert proposal is not None and proposal.auto_approve is False
    auto = propose(
        INCIDENT,
        CHECKPOINTS,
        {},
        diagnose(Evidence()),
        ALLOWED,
        ProposalConfig(auto_approve=frozenset({"spike"})),
    )
    assert auto is not None and auto.auto_approve is True


def test_a_finding_whose_remedy_is_not_a_rollback_proposes_none() -> None:
    resume = IncidentFacts(key=2, kind="broken_resume", first_step=201, last_step=201, current_step=205)
    evidence = diagnose(Evidence())
    restored_by_hand = propose(resume, CHECKPOINTS, {}, evidence, ALLOWED, ProposalConfig())
    assert restored_by_hand is not None and restored_by_hand.action == "rollback"
    after_rollback = IncidentFacts(**{**resume.__dict__, "remedy": Remedy.FIX_RESTORE})
    assert propose(after_rollback, CHECKPOINTS, {}, evidence, ALLOWED, ProposalConfig()) is None
    # Escalation is no way around it either: nothing is proposed past the retry bound.
    denied = RetryDecision(False, "bound reached")
    assert propose(after_rollback, CHECKPOINTS, {}, evidence, denied, ProposalConfig()) is None


def test_an_incident_takes_its_kinds_remedy_unless_a_finding_says_a_rollback_did_not_fix_it() -> None:
    lost = Finding(1841, "optimizer_state_lost", Severity.CRITICAL, "param_states", 0.0, 12.0, "rank 0: lost")
    marked = with_remedy(lost, Remedy.FIX_RESTORE, "the resume of rollback proposal 3")
    assert marked.message.endswith("(the resume of rollback proposal 3)")
    assert stated_remedy(marked.evidence) is Remedy.FIX_RESTORE
    assert stated_remedy(lost.evidence) is None and stated_remedy({"remedy": "reboot"}) is None
    assert incident_remedy("broken_resume", [None, None]) is Remedy.ROLLBACK
    assert incident_remedy("broken_resume", [None, Remedy.FIX_RESTORE]) is Remedy.FIX_RESTORE
    assert incident_remedy("spike", [Remedy.ROLLBACK]) is Remedy.ROLLBACK
    assert incident_remedy("straggler", []) is Remedy.NONE


@pytest.mark.parametrize(
    ("highest", "step_time", "poll", "expected"),
    [(100, 1.0, 2.0, 106), (100, 0.02, 2.0, 302), (100, 0.0, 2.0, 102), (100, 60.0, 2.0, 102)],
)
def test_the_action_step_clears_the_polling_delay(
    highest: int, step_time: float, poll: float, expected: int
) -> None:
    assert act_at_step(highest, step_time, poll) == expected


@pytest.mark.parametrize(
    ("reported_at", "now", "step_time", "expected"),
    [
        (10.0, 11.0, 0.1, 110),  # a second since the newest window: ten steps on
        (10.0, 30.0, 0.1, 140),  # at most the records' lag (4 s): a paused run does not run ahead
        (10.0, 9.0, 0.1, 100),  # a rank's clock ahead of the service's: no step back
        (None, 11.0, 0.1, 100),
        (10.0, 11.0, 0.0, 100),  # no step time yet
    ],
)
def test_the_ranks_current_step_is_the_newest_reported_moved_on_by_the_time_since(
    reported_at: float | None, now: float, step_time: float, expected: int
) -> None:
    assert current_step(100, reported_at, now, step_time, max_lag_s=4.0) == expected
