import math

import pytest

from policies.numerics import NumericsConfig, NumericsState, nonfinite_findings, observe_numerics
from policies.types import Severity, StepPoint

CONFIG = NumericsConfig()


def run(points: list[StepPoint], config: NumericsConfig = CONFIG) -> list[list[str]]:
    state, kinds = NumericsState(), []
    for point in points:
        state, found = observe_numerics(state, point, config)
        kinds.append([f.kind for f in found])
    return kinds


@pytest.mark.parametrize("signal", ["loss", "grad_norm", "loss_scale"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nonfinite_values_are_critical(signal: str, value: float) -> None:
    (finding,) = nonfinite_findings(StepPoint(step=3, **{signal: value}))
    assert (finding.kind, finding.signal, finding.severity) == ("nonfinite", signal, Severity.CRITICAL)


def test_an_inf_grad_norm_on_a_skipped_amp_step_is_the_scaler_at_work() -> None:
    assert nonfinite_findings(StepPoint(step=3, grad_norm=math.inf, skipped=True)) == ()
    assert nonfinite_findings(StepPoint(step=3, loss=math.nan, skipped=True)) != ()


def test_not_logged_is_not_nonfinite() -> None:
    assert nonfinite_findings(StepPoint(step=1)) == ()


def test_zero_token_window() -> None:
    assert run([StepPoint(step=1, tokens=0)]) == [["zero_tokens"]]
    assert run([StepPoint(step=1, tokens=1), StepPoint(step=2, tokens=None)]) == [[], []]


def test_skip_storm_needs_three_skips_in_twenty_windows() -> None:
    points = [StepPoint(step=i, skipped=i in (4, 12, 24)) for i in range(30)]
    assert all(k == [] for k in run(points))  # 4..24 spans 21 windows: 2 in any 20
    points = [StepPoint(step=i, skipped=i in (5, 12, 24)) for i in range(30)]
    kinds = run(points)
    assert kinds[24] == ["skip_storm"] and sum(map(len, kinds)) == 1


def test_loss_scale_collapse_by_factor_and_floor() -> None:
    halving = [StepPoint(step=i, loss_scale=65536.0 / 2**i) for i in range(6)]
    kinds = run(halving)
    assert kinds[:4] == [[], [], [], []]
    assert kinds[4] == ["loss_scale_collapse"]  # 65536 -> 4096: 16x
    (finding,) = observe_numerics(NumericsState(), StepPoint(step=1, loss_scale=1.0), CONFIG)[1]
    assert finding.severity is Severity.CRITICAL


def test_loss_scale_collapse_counts_steps_not_logged_rows() -> None:
    sparse = [StepPoint(step=13251, loss_scale=524288.0), StepPoint(step=14000, loss_scale=4096.0)]
    assert run(sparse) == [[], []]  # 750 steps apart: not one overflow storm
    every_tenth = [
        StepPoint(step=29040 + 10 * i, loss_scale=s) for i, s in enumerate([65536.0, 8192.0, 4096.0])
    ]
    assert run(every_tenth)[2] == ["loss_scale_collapse"]


def test_a_restart_begins_a_new_scale_span() -> None:
    points = [StepPoint(step=100, loss_scale=65536.0), StepPoint(step=90, loss_scale=2048.0, restart=True)]
    assert run(points) == [[], []]


def test_learning_rate_advancing_after_a_skip() -> None:
    points = [
        StepPoint(step=1, attempt=1, lr=1e-3, skipped=False),
        StepPoint(step=1, attempt=2, lr=1e-3, skipped=True),
        StepPoint(step=2, attempt=3, lr=1.1e-3, skipped=False),
    ]
    assert run(points) == [[], [], ["lr_advanced_on_skip"]]
    points[2] = StepPoint(step=2, attempt=3, lr=1e-3 * (1 + 1e-7), skipped=False)
    assert run(points) == [[], [], []]


def test_counters_must_agree() -> None:
    good = [
        StepPoint(step=1, attempt=1, consumed=64, skipped=False),
        StepPoint(step=1, attempt=2, consumed=128, skipped=True),
        StepPoint(step=2, attempt=3, consumed=192, skipped=False),
    ]
    assert run(good) == [[], [], []]
    advanced_on_skip = [good[0], StepPoint(step=2, attempt=2, consumed=128, skipped=True)]
    assert run(advanced_on_skip)[1] == ["counter_mismatch"]
    cursor_back = [good[0], StepPoint(step=2, attempt=2, consumed=0, skipped=False)]
    assert run(cursor_back)[1] == ["counter_mismatch"]


def test_restart_boundaries_are_not_counter_faults() -> None:
    points = [
        StepPoint(step=100, attempt=100, consumed=6400, skipped=False),
        StepPoint(step=81, attempt=81, consumed=5184, skipped=False, restart=True),
    ]
    assert run(points) == [[], []]


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        NumericsConfig(skip_storm_count=30, skip_storm_window=20)
    with pytest.raises(ValueError):
        NumericsConfig(scale_collapse_factor=1.0)
