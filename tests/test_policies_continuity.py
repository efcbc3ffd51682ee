import pytest

from monitor.judge.readings import resume_facts
from policies.continuity import (
    ContinuityConfig,
    ContinuityState,
    Expected,
    ResumeFacts,
    observe_continuity,
    resume_findings,
)
from policies.types import StepPoint

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
    }
    facts = resume_facts("inc-2", 0, 1840, restored)
    assert (facts.optimizer_step, facts.lr, facts.scheduler_last_epoch, facts.exp_avg_sq_norm) == (
        1840.0,
        1e-3,
        1840,
        0.01,
    )
    assert resume_findings(facts, EXPECTED, CONFIG) == ()
    lost = {**restored, "optimizer": {**restored["optimizer"], "exp_avg_sq_norm": 0.0}}
    assert [
        f.kind for f in resume_findings(resume_facts("i", 0, 1840, lost), EXPECTED, CONFIG)
    ] == ["optimizer_state_lost"]
