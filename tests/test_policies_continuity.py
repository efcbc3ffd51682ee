import math
import statistics

import pytest

from monitor.judge.readings import resume_facts
from policies.continuity import (
    NOT_REPRODUCIBLE,
    ContinuityConfig,
    ContinuityState,
    Expected,
    ResumeFacts,
    after_findings,
    data_order_note,
    observe_continuity,
    replay_allowance,
    resume_findings,
)
from policies.remedies import Remedy, stated_remedy
from policies.types import Finding, Severity, StepPoint

CONFIG = ContinuityConfig()


def trained_run() -> ContinuityState:
    state = ContinuityState()
    for step in range(1, 200):
        loss = 10.0 if step <= 5 else 3.0
        lr = 1e-5 if step == 1 else 1e-3
        state, found = observe_continuity(
            state, StepPoint(step=step, loss=loss, lr=lr, consumed=64 * step), 3.0, CONFIG
        )
        assert found == ()
    return state


def restart(loss: float = 3.01, lr: float = 1e-3, consumed: int = 64 * 180, step: int = 180) -> list[str]:
    point = StepPoint(step=step, loss=loss, lr=lr, consumed=consumed, restart=True)
    return [f.kind for f in observe_continuity(trained_run(), point, 3.0, CONFIG)[1]]


def test_a_clean_resume_raises_nothing() -> None:
    assert restart() == []


def test_loss_back_toward_untrained_is_a_broken_resume() -> None:
    assert restart(loss=6.6) == ["broken_resume"]  # 51% of the way from 3.0 to 10.0
    assert restart(loss=6.4) == []  # 49%: a bad spike, not lost weights


def test_the_broken_resume_says_how_far_back_the_loss_went_or_that_it_went_past_the_start() -> None:
    def message(loss: float) -> str:
        point = StepPoint(step=180, loss=loss, lr=1e-3, consumed=64 * 180, restart=True)
        (finding,) = observe_continuity(trained_run(), point, 3.0, CONFIG)[1]
        return finding.message

    assert "80% of the way back from 3 to the untrained 10: the weights" in message(8.6)
    # A fresh model can start above the run's first logged windows (they had learned a little).
    assert "loss is 12.5, above the run's first logged level 10 (its trailing median before the restart: 3): the weights" in message(
        12.5
    )


def test_learning_rate_back_at_warm_up_is_a_restarted_schedule() -> None:
    assert restart(lr=1e-5) == ["schedule_restarted"]
    assert restart(lr=5e-4) == []  # half: a legitimate rollback within decay


def test_data_cursor_back_at_zero_while_step_kept() -> None:
    assert restart(consumed=0) == ["data_cursor_reset"]
    assert restart(consumed=64 * 90, step=90) == []  # a rollback moves both together


def test_a_loss_that_is_zero_from_the_start_is_judged_without_dividing_by_zero() -> None:
    state = ContinuityState()
    for step in range(1, 50):
        state, _ = observe_continuity(state, StepPoint(step=step, loss=0.0, lr=1e-3), 0.0, CONFIG)
    point = StepPoint(step=30, loss=0.0, lr=1e-3, restart=True)
    assert observe_continuity(state, point, 0.0, CONFIG)[1] == ()


def test_no_history_no_judgement() -> None:
    point = StepPoint(step=5, loss=10.0, lr=1e-5, restart=True)
    assert observe_continuity(ContinuityState(), point, None, CONFIG)[1] == ()


def facts(**restored: object) -> ResumeFacts:
    base = {
        "optimizer_step": 1840,
        "exp_avg_norm": 0.3,
        "exp_avg_sq_norm": 0.01,
        "lr": 1e-3,
        "scheduler_last_epoch": 1840,
        "consumed": 117_760,
        "first_sample_ids": [500, 501],
        "data": {"deterministic": True},
    }
    return resume_facts("inc-2", 0, 1840, {**base, **restored})


EXPECTED = Expected(step=1840, consumed=117_760, next_lr=1e-3, next_sample_ids=(500, 501, 502))


def test_a_faithful_resume_record_passes() -> None:
    assert resume_findings(facts(), EXPECTED, CONFIG) == ()


@pytest.mark.parametrize(
    ("restored", "kind"),
    [
        ({"optimizer_step": 0}, "optimizer_state_lost"),
        ({"exp_avg_sq_norm": 0.0}, "optimizer_state_lost"),
        ({"scheduler_last_epoch": 0}, "schedule_restarted"),
        ({"lr": 1e-5}, "schedule_restarted"),
        ({"consumed": 0}, "data_cursor_reset"),
        ({"consumed": 117_000}, "data_cursor_mismatch"),
        ({"first_sample_ids": [0, 1]}, "data_cursor_mismatch"),
    ],
)
def test_each_lost_piece_of_state_is_named(restored: dict, kind: str) -> None:
    (finding,) = resume_findings(facts(**restored), EXPECTED, CONFIG)
    assert finding.kind == kind
    assert finding.rank == 0
    assert finding.step == 1841


def test_sample_ids_are_compared_only_when_the_data_order_is_declared_deterministic() -> None:
    drawn_at_random = facts(first_sample_ids=[7031, 912], data={"deterministic": False})
    assert resume_findings(drawn_at_random, EXPECTED, CONFIG) == ()
    assert [f.kind for f in resume_findings(facts(first_sample_ids=[7031, 912]), EXPECTED, CONFIG)] == [
        "data_cursor_mismatch"
    ]
    # The cursor is what the trainer restores, random draws or not.
    assert [f.kind for f in resume_findings(facts(consumed=0, data={}), EXPECTED, CONFIG)] == [
        "data_cursor_reset"
    ]


def test_lost_optimizer_state_is_found_with_the_learning_rate_intact() -> None:
    # A fresh AdamW: no state at all, so no step counter and no moments to norm; the LR (from
    # the restored scheduler) is right.
    fresh = facts(optimizer={"param_states": 0, "trainable_params": 12, "lr": [1e-3]})
    fresh = ResumeFacts(
        **{**fresh.__dict__, "optimizer_step": None, "exp_avg_norm": None, "exp_avg_sq_norm": None}
    )
    (finding,) = resume_findings(fresh, EXPECTED, CONFIG)
    assert (finding.kind, finding.signal, finding.value, finding.threshold) == (
        "optimizer_state_lost",
        "param_states",
        0.0,
        12.0,
    )
    assert "12 trainable parameters" in finding.message and finding.severity is Severity.CRITICAL
    partial = facts(optimizer={"param_states": 9, "trainable_params": 12})
    assert [f.signal for f in resume_findings(partial, EXPECTED, CONFIG)] == ["param_states"]
    whole = facts(optimizer={"param_states": 12, "trainable_params": 12})
    assert resume_findings(whole, EXPECTED, CONFIG) == ()
    lenient = ContinuityConfig(param_state_fraction=0.7)
    assert resume_findings(partial, EXPECTED, lenient) == ()
    # A checkpoint at step 0 has no state to lose.
    assert resume_findings(fresh, Expected(step=0), CONFIG) == ()


def test_a_restored_data_state_is_compared_with_an_earlier_restore_of_the_checkpoint() -> None:
    restored = facts(data={"state_digest": "a" * 64}, first_sample_ids=[9, 9])
    assert restored.data_position_checkable and not restored.deterministic_data
    same = Expected(step=1840, consumed=117_760, data_state_digest="a" * 64, next_sample_ids=(1, 2))
    assert resume_findings(restored, same, CONFIG) == ()
    (finding,) = resume_findings(
        restored, Expected(**{**same.__dict__, "data_state_digest": "b" * 64}), CONFIG
    )
    assert (finding.kind, finding.signal) == ("data_cursor_mismatch", "data_state")


def test_what_the_resume_of_a_rollback_finds_says_a_rollback_is_not_its_remedy() -> None:
    lost = facts(scheduler_last_epoch=0)
    (by_hand,) = resume_findings(lost, EXPECTED, CONFIG)
    assert stated_remedy(by_hand.evidence) is None  # the kind's rule: a rollback restores again
    (after,) = resume_findings(lost, Expected(**{**EXPECTED.__dict__, "after_rollback": 7}), CONFIG)
    assert stated_remedy(after.evidence) is Remedy.FIX_RESTORE
    assert "rollback proposal 7" in after.message and after.kind == "schedule_restarted"


def test_a_resume_whose_data_position_nothing_can_check_gets_one_note() -> None:
    random_draws = [facts(data={}) for _ in range(4)]
    random_draws = [ResumeFacts(**{**f.__dict__, "rank": r}) for r, f in enumerate(random_draws)]
    note = data_order_note(random_draws, 1840)
    assert note is not None
    assert (note.kind, note.severity, note.message, note.step) == (
        "data_order_not_reproducible",
        Severity.INFO,
        NOT_REPRODUCIBLE,
        1841,
    )
    assert note.evidence["ranks"] == 4 and note.evidence["cursor_checked"] is True
    assert data_order_note([facts()], 1840) is None  # declared deterministic
    assert data_order_note([facts(data={"state_digest": "c" * 64})], 1840) is None


def test_lr_within_tolerance_continues() -> None:
    assert resume_findings(facts(lr=1e-3 * 1.005), EXPECTED, CONFIG) == ()


def test_the_hooks_nested_resume_record_is_read() -> None:
    restored = {
        "optimizer": {
            "lr": [1e-3],
            "optimizer_step_max": 1840.0,
            "exp_avg_norm": 0.3,
            "exp_avg_sq_norm": 0.01,
        },
        "scheduler": {"last_epoch": 1840, "last_lr": [1e-3]},
        "consumed": 117_760,
        "first_sample_ids": [500, 501],
        "data": {"deterministic": True, "state_digest": "d" * 64},
    }
    facts = resume_facts("inc-2", 0, 1840, restored)
    assert (facts.optimizer_step, facts.lr, facts.scheduler_last_epoch, facts.exp_avg_sq_norm) == (
        1840.0,
        1e-3,
        1840,
        0.01,
    )
    assert (facts.deterministic_data, facts.data_state_digest) == (True, "d" * 64)
    assert resume_findings(facts, EXPECTED, CONFIG) == ()
    lost = {**restored, "optimizer": {**restored["optimizer"], "exp_avg_sq_norm": 0.0}}
    assert [f.kind for f in resume_findings(resume_facts("i", 0, 1840, lost), EXPECTED, CONFIG)] == [
        "optimizer_state_lost"
    ]


# The replayed-step rule: a restart onto steps the run had logged, against what it logged there.


def curve(step: int) -> float:
    """A training loss with noise that is a function of the step: a replay of the same batches
    from the same state logs exactly the same values."""
    return 3.0 + 2.0 * math.exp(-step / 150) + 0.05 * math.sin(step * 12.9898)


def trained_to(
    last: int,
    state: ContinuityState | None = None,
    first: int = 1,
    restart_noise: float = 0.0,
    resumed: bool = True,
    **kw: float,
) -> tuple[ContinuityState, list[Finding]]:
    """Steps ``first``..``last`` of ``curve`` (times ``scale``, plus ``shift``); from a given
    state a restart at ``first`` (unless not ``resumed``), with the run's step noise
    ``restart_noise``."""
    scale, shift = kw.get("scale", 1.0), kw.get("shift", 0.0)
    state = state or ContinuityState()
    found: list[Finding] = []
    for step in range(first, last + 1):
        restart = resumed and step == first and state.previous is not None
        point = StepPoint(step=step, loss=curve(step) * scale + shift, lr=1e-3, restart=restart)
        state, new = observe_continuity(state, point, 3.2, CONFIG, noise=restart_noise if restart else 0.0)
        found += new
    return state, found


def broken_at(found: list[Finding]) -> list[int]:
    return [f.step for f in found if f.kind == "broken_resume"]


NOISE = 0.05
"""A ``step_mad``: its threshold (``replay_allowance``) is above the 3% floor at a loss near 3."""


def test_a_replay_of_the_same_values_is_quiet() -> None:
    state, _ = trained_to(600)
    assert broken_at(trained_to(800, state, first=400, restart_noise=NOISE)[1]) == []


@pytest.mark.parametrize(("units", "named"), [(3.4, False), (3.6, True), (-3.4, False), (-3.6, True)])
def test_a_replay_shifted_by_k_noise_units_is_broken_just_above_the_threshold(
    units: float, named: bool
) -> None:
    """The median of the first 5 replayed windows against the same steps as first logged: the
    difference of two medians of 5 has a spread of 1.4826 step_mad sqrt(pi / 5); 3.5 of those."""
    unit = 1.4826 * NOISE * math.sqrt(math.pi / CONFIG.resume_windows)
    reference = statistics.median(curve(s) for s in range(400, 405))
    assert replay_allowance(reference, NOISE, CONFIG.resume_windows, CONFIG) == pytest.approx(3.5 * unit)
    state, _ = trained_to(600)
    _, found = trained_to(800, state, first=400, restart_noise=NOISE, shift=units * unit)
    assert broken_at(found) == ([400] if named else [])


@pytest.mark.parametrize(("moved", "named"), [(1.029, False), (1.031, True), (0.971, False), (0.969, True)])
def test_a_replay_on_a_quiet_run_is_judged_against_the_relative_floor(moved: float, named: bool) -> None:
    """Step noise far below the floor (a loss logged smoothed): 3% of the reference decides."""
    state, _ = trained_to(600)
    _, found = trained_to(800, state, first=400, restart_noise=0.001, scale=moved)
    assert broken_at(found) == ([400] if named else [])


def test_without_a_noise_estimate_a_replay_is_not_judged() -> None:
    state, _ = trained_to(600)
    assert broken_at(trained_to(800, state, first=400, restart_noise=0.0, scale=1.2)[1]) == []


def spiked(
    state: ContinuityState, first: int, last: int, up_from: int, noted: bool = True
) -> ContinuityState:
    """Steps ``first``..``last`` of a timeline whose loss is 50% up from ``up_from`` on; each
    such step's loss spike noted (``after_findings``) as the series notes its findings."""
    for step in range(first, last + 1):
        point = StepPoint(step=step, loss=curve(step) * (1.5 if step >= up_from else 1.0), lr=1e-3)
        state, _ = observe_continuity(state, point, 3.2, CONFIG)
        if step >= up_from and noted:
            spike = Finding(step, "loss_spike", Severity.CRITICAL, "loss", point.loss, 3.5, "spike")
            state = after_findings(state, [spike])
    return state


def test_a_rollback_after_a_spike_with_exact_replay_is_quiet() -> None:
    """Spiked from 300, rolled back onto 298 and replayed exactly (the bad batches skipped):
    the steps from the spike on are what the rollback abandons, not a reference, and 2 steps
    before it are too few to judge 5 windows. Had the spike not been noted, the abandoned
    values would have named the good replay broken."""
    state, _ = trained_to(297)
    abandoned = spiked(state, 298, 320, up_from=300)
    assert broken_at(trained_to(400, abandoned, first=298, restart_noise=NOISE)[1]) == []
    unnoted = spiked(state, 298, 320, up_from=300, noted=False)
    assert broken_at(trained_to(400, unnoted, first=298, restart_noise=NOISE)[1]) == [298]


def test_a_spike_noted_later_cuts_from_its_first_step() -> None:
    """The earliest finding of the timeline is where its reference ends."""
    state, _ = trained_to(297)
    late = spiked(state, 298, 320, up_from=300, noted=False)
    late = after_findings(late, [Finding(310, "loss_spike", Severity.WARNING, "loss", 5.0, 4.0, "")])
    late = after_findings(late, [Finding(300, "rank_loss_spike", Severity.WARNING, "loss", 5.0, 4.0, "")])
    assert broken_at(trained_to(400, late, first=298, restart_noise=NOISE)[1]) == []
    # A straggler is no reason for a rollback: the steps stay a reference.
    slow = after_findings(
        spiked(state, 298, 320, up_from=300, noted=False),
        [Finding(300, "straggler", Severity.WARNING, "step_time", 1.3, 1.1, "")],
    )
    assert broken_at(trained_to(400, slow, first=298, restart_noise=NOISE)[1]) == [298]


def test_a_rollback_after_a_nan_with_exact_replay_is_quiet() -> None:
    """The loss rose from 296 (spikes noted) and went NaN at 300; rolled back onto 280, the
    replay matches what the run logged at 280-284 exactly."""
    state, _ = trained_to(295)
    state = spiked(state, 296, 299, up_from=296)
    for step in range(300, 310):
        state, _ = observe_continuity(state, StepPoint(step=step, loss=math.nan, lr=1e-3), 3.2, CONFIG)
        state = after_findings(
            state, [Finding(step, "nonfinite_loss", Severity.CRITICAL, "loss", None, None, "")]
        )
    assert broken_at(trained_to(400, state, first=280, restart_noise=NOISE)[1]) == []
    # A broken restore onto the same steps is still named.
    assert broken_at(trained_to(400, state, first=280, restart_noise=NOISE, scale=1.2)[1]) == [280]


def test_a_restart_onto_an_earlier_step_after_an_abandoned_timeline() -> None:
    """Trained to 600, resumed at 400 (exactly) and abandoned at 500: a restart onto 450 loaded
    the second timeline's checkpoint and is judged against it; one onto 300 loaded the first's."""
    first, _ = trained_to(600)
    second, _ = trained_to(500, first, first=400, restart_noise=NOISE)
    shifted = 8 * 1.4826 * NOISE
    assert broken_at(trained_to(520, second, first=450, restart_noise=NOISE, shift=shifted)[1]) == [450]
    assert broken_at(trained_to(520, second, first=450, restart_noise=NOISE)[1]) == []
    assert broken_at(trained_to(350, second, first=300, restart_noise=NOISE)[1]) == []
    assert broken_at(trained_to(350, second, first=300, restart_noise=NOISE, shift=shifted)[1]) == [300]


def test_each_broken_resume_of_one_checkpoint_is_named() -> None:
    """A second resume of the checkpoint a broken one loaded is judged against the timeline
    that saved it, not against the broken one (which began at that step)."""
    state, _ = trained_to(600)
    state, found = trained_to(450, state, first=400, restart_noise=NOISE, scale=1.2)
    assert broken_at(found) == [400]
    assert broken_at(trained_to(450, state, first=400, restart_noise=NOISE, scale=1.2)[1]) == [400]


@pytest.mark.parametrize("spikes_first", [False, True])
def test_a_resume_of_a_checkpoint_saved_after_a_broken_resume_is_judged_against_that_timeline(
    spikes_first: bool,
) -> None:
    """Broken at 400 (20% up) and trained on to 700: its checkpoint at 600 holds that state, so
    a restart onto 600 that continues it is quiet, and one that moves again is named. Spikes
    found in its first windows were that broken resume, not steps a rollback abandons."""
    state, _ = trained_to(600)
    state, found = trained_to(403, state, first=400, restart_noise=NOISE, scale=1.2)
    if spikes_first:
        state = after_findings(state, [Finding(400, "loss_spike", Severity.CRITICAL, "loss", 4.0, 3.5, "")])
    state, later = trained_to(700, state, first=404, resumed=False, scale=1.2)
    assert broken_at(found + later) == [400]
    assert broken_at(trained_to(700, state, first=600, restart_noise=NOISE, scale=1.2)[1]) == []
    assert broken_at(trained_to(700, state, first=600, restart_noise=NOISE, scale=1.0)[1]) == [600]
