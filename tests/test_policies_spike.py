import math
import random

import pytest

from policies.spike import SpikeConfig, SpikeState, observe_spike
from policies.stats import MAD_TO_SIGMA
from policies.types import Severity, StepPoint

CONFIG = SpikeConfig(window=20, warmup=10, z=10.0, min_relative=0.05)


def warmed(values: list[float], config: SpikeConfig = CONFIG) -> SpikeState:
    state = SpikeState.empty(config)
    for step, value in enumerate(values):
        state, found = observe_spike(state, StepPoint(step=step, loss=value), "loss", config)
        assert found == ()
    return state


def noisy(n: int, center: float = 2.0, spread: float = 0.01) -> list[float]:
    return [center + spread * ((i * 7) % 5 - 2) for i in range(n)]


def threshold_of(state: SpikeState, config: SpikeConfig = CONFIG) -> float:
    center = state.window.median()
    spread = state.window.step_mad() if config.noise == "steps" else state.window.mad()
    return center + max(config.z * MAD_TO_SIGMA * spread, config.min_relative * center)


def judge(state: SpikeState, value: float, step: int = 100) -> tuple:
    return observe_spike(state, StepPoint(step=step, loss=value), "loss", CONFIG)[1]


def test_just_over_the_threshold_is_a_spike_just_under_is_not() -> None:
    state = warmed(noisy(20))
    threshold = threshold_of(state)
    assert judge(state, threshold * (1 - 1e-9)) == ()
    (finding,) = judge(state, threshold * (1 + 1e-9))
    assert finding.kind == "loss_spike"
    assert finding.threshold == pytest.approx(threshold)
    assert finding.step == 100


@pytest.mark.parametrize("noise", ["level", "steps"])
def test_threshold_follows_the_chosen_spread(noise: str) -> None:
    config = SpikeConfig(window=20, warmup=10, z=10.0, min_relative=0.0, noise=noise)
    rng = random.Random(1)
    state = warmed([2.0 + rng.gauss(0, 0.01) for _ in range(20)], config)
    threshold = threshold_of(state, config)
    assert observe_spike(state, StepPoint(step=100, loss=threshold * (1 - 1e-9)), "loss", config)[1] == ()
    assert len(observe_spike(state, StepPoint(step=100, loss=threshold * (1 + 1e-9)), "loss", config)[1]) == 1


def test_a_falling_loss_does_not_hide_a_corrupted_batch() -> None:
    # Noise +-0.1 on a loss falling from 5 to 1.2: the fall dominates the spread of the values
    # (a level threshold near 6), not the spread of the step changes.
    values = [max(1.2, 5.0 - 0.08 * i) + 0.1 * ((i * 7) % 5 - 2) / 2 for i in range(100)]
    steps = SpikeConfig()
    level = SpikeConfig(z=14.0, noise="level")
    assert threshold_of(warmed(values, level), level) > 5.2
    assert len(observe_spike(warmed(values, steps), StepPoint(step=100, loss=5.2), "loss", steps)[1]) == 1


def test_relative_floor_governs_a_flat_series() -> None:
    state = warmed([2.0] * 20)  # MAD 0: only the 5% floor stands between jitter and alarm
    assert judge(state, 2.099) == ()
    assert len(judge(state, 2.101)) == 1


def test_during_warm_up_only_a_gross_jump_is_judged() -> None:
    state = warmed(noisy(9))  # median 2.0, cold threshold 2.0 * 1.3
    state_after, found = observe_spike(state, StepPoint(step=9, loss=2.59), "loss", CONFIG)
    assert found == ()
    assert len(state_after.window) == 10
    (finding,) = observe_spike(state, StepPoint(step=9, loss=2.61), "loss", CONFIG)[1]
    assert finding.evidence["warm"] is False
    assert "cold-start" in finding.message


def test_the_first_point_is_never_judged_and_the_second_only_for_a_gross_jump() -> None:
    state = SpikeState.empty(CONFIG)
    state, found = observe_spike(state, StepPoint(step=0, loss=90.0), "loss", CONFIG)
    assert found == ()
    assert observe_spike(state, StepPoint(step=1, loss=116.0), "loss", CONFIG)[1] == ()
    assert len(observe_spike(state, StepPoint(step=1, loss=118.0), "loss", CONFIG)[1]) == 1


def test_a_jump_that_stays_up_becomes_a_level_shift_then_a_new_normal() -> None:
    state = warmed(noisy(20))
    kinds = []
    for step in range(100, 100 + CONFIG.shift_after):
        state, found = observe_spike(state, StepPoint(step=step, loss=4.0), "loss", CONFIG)
        kinds.append([f.kind for f in found])
    assert kinds[:-1] == [["loss_spike"]] * (CONFIG.shift_after - 1)
    assert kinds[-1] == ["loss_spike", "loss_level_shift"]
    shift = found[1]
    assert shift.step == 100  # the first affected step, not the step of detection
    assert shift.evidence["detected_at"] == 100 + CONFIG.shift_after - 1
    # the new level is normal now: staying at 4.0 raises nothing
    state, found = observe_spike(state, StepPoint(step=200, loss=4.0), "loss", CONFIG)
    assert found == ()


def test_a_transient_spike_resets_the_run_of_flags() -> None:
    state = warmed(noisy(20))
    for step in range(100, 100 + CONFIG.shift_after - 1):
        state, _ = observe_spike(state, StepPoint(step=step, loss=4.0), "loss", CONFIG)
    state, _ = observe_spike(state, StepPoint(step=150, loss=2.0), "loss", CONFIG)
    assert state.flagged == ()


def test_log_scale_judges_ratios() -> None:
    config = SpikeConfig.grad_norm()
    state = SpikeState.empty(config)
    for step in range(60):
        state, _ = observe_spike(
            state, StepPoint(step=step, grad_norm=1.0 + 0.05 * (step % 3)), "grad_norm", config
        )
    assert observe_spike(state, StepPoint(step=60, grad_norm=3.9), "grad_norm", config)[1] == ()
    (finding,) = observe_spike(state, StepPoint(step=60, grad_norm=4.5), "grad_norm", config)[1]
    assert finding.kind == "grad_norm_spike"
    assert finding.threshold == pytest.approx(4.2, rel=0.05)
    assert observe_spike(state, StepPoint(step=60, grad_norm=0.0), "grad_norm", config)[1] == ()


def test_missing_and_nonfinite_values_are_left_to_other_policies() -> None:
    state = warmed(noisy(20))
    for value in (None, math.nan, math.inf):
        new_state, found = observe_spike(state, StepPoint(step=50, loss=value), "loss", CONFIG)
        assert found == ()
        assert new_state is state


def test_a_spike_enters_the_window_clipped() -> None:
    state = warmed(noisy(20))
    threshold = threshold_of(state)
    new_state, _ = observe_spike(state, StepPoint(step=21, loss=50.0), "loss", CONFIG)
    assert new_state.window.values[-1] == pytest.approx(threshold)


def test_severity_grows_with_the_excess() -> None:
    state = warmed(noisy(20))
    center = state.window.median()
    allowed = threshold_of(state) - center
    (warning,) = judge(state, center + 1.5 * allowed)
    (critical,) = judge(state, center + 2.5 * allowed)
    assert warning.severity is Severity.WARNING
    assert critical.severity is Severity.CRITICAL


def test_a_falling_loss_is_never_a_spike() -> None:
    state = warmed(noisy(20))
    assert judge(state, 0.01) == ()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": 2},
        {"warmup": 0},
        {"warmup": 200},
        {"z": 0.0},
        {"min_relative": -0.1},
        {"critical_factor": 0.5},
    ],
)
def test_config_rejects_nonsense(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SpikeConfig(**kwargs)


def test_authored_preset_is_median_plus_three_sigma_over_fifty() -> None:
    authored = SpikeConfig.authored()
    assert (authored.window, authored.warmup, authored.z, authored.min_relative) == (50, 50, 3.0, 0.0)
    state = warmed(noisy(49), authored)
    assert observe_spike(state, StepPoint(step=49, loss=1e6), "loss", authored)[1] == ()


def test_a_rollback_is_judged_against_the_history_it_returned_to() -> None:
    from policies.series import SeriesConfig, SeriesState, observe_step

    config = SeriesConfig()
    state = SeriesState.empty(config)

    # The loss falls from 3.0 toward 1.0 over 600 steps (the demo waits that long for an
    # approval); the run then resumes from its checkpoint at step 125.
    def loss(step: int) -> float:
        return 1.0 + 2.0 * math.exp(-step / 150)

    for step in range(1, 601):
        state, found = observe_step(state, StepPoint(step=step, loss=loss(step)), config)
        assert found == ()
    after, found = observe_step(state, StepPoint(step=126, loss=loss(126), restart=True), config)
    assert found == ()
    assert max(after.loss_spike.window.steps) == 126
    # Judged against the abandoned steps (no restart), the same loss is a spike.
    _, found = observe_step(state, StepPoint(step=601, loss=loss(126)), config)
    assert [f.kind for f in found] == ["loss_spike"]
