import pytest

from monitor.judge.readings import resume_facts
from policies.continuity import (
    NOT_REPRODUCIBLE,
    ContinuityConfig,
    ContinuityState,
    Expected,
    ResumeFacts,
    data_order_note,
    observe_continuity,
    resume_findings,
)
from policies.remedies import Remedy, stated_remedy
from policies.types import Severity, StepPoint

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
