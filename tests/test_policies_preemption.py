"""The preemption budget (``policies/preemption.py``): the reference text's
``T_warning >= T_window + T_save + T_margin`` at its boundary, the p99 by nearest rank, and
the terms it needs before it judges anything."""

from __future__ import annotations

import pytest

from policies.preemption import (
    FITS,
    KIND,
    PreemptionConfig,
    budget_finding,
    budget_fits,
    preemption_budget,
    quantile,
)
from policies.types import Severity

WINDOWS = [10.0] * 200
SAVES = [15.0]


def test_a_path_that_fits_exactly_is_no_finding() -> None:
    budget = preemption_budget(WINDOWS, SAVES, PreemptionConfig(warning_s=30.0, margin_s=5.0))
    assert budget is not None and budget.needed_s == 30.0 and budget.slack_s == 0.0 and budget.fits
    assert budget_finding(budget, step=100) is None


def test_a_path_that_misses_by_a_little_is_a_warning_with_the_arithmetic() -> None:
    budget = preemption_budget(WINDOWS, SAVES, PreemptionConfig(warning_s=29.99, margin_s=5.0))
    assert budget is not None and not budget.fits
    finding = budget_finding(budget, step=100, incarnation="inc-1")
    assert finding is not None and finding.kind == KIND and finding.severity is Severity.WARNING
    assert "T_warning 29.99 s < T_window 10 s + T_save 15 s + T_margin 5 s = 30 s" in finding.message
    assert "short by 0.01 s" in finding.message
    assert finding.value == pytest.approx(-0.01) and finding.step == 100 and finding.incarnation == "inc-1"
    assert finding.evidence["needed_s"] == 30.0 and finding.evidence["warning_s"] == 29.99


def test_the_note_that_resolves_it_says_the_path_fits_again() -> None:
    budget = preemption_budget(WINDOWS, SAVES, PreemptionConfig(warning_s=120.0, margin_s=5.0))
    assert budget is not None
    note = budget_fits(budget, step=200)
    assert note.kind == FITS and note.severity is Severity.INFO
    assert "T_warning 120 s >= T_window 10 s + T_save 15 s + T_margin 5 s = 30 s" in note.message


def test_t_window_is_the_p99_by_nearest_rank_over_the_recent_windows() -> None:
    two_slow = [1.0] * 198 + [9.0] * 2
    three_slow = [1.0] * 197 + [9.0] * 3
    assert quantile(two_slow, 0.99) == 1.0  # the two slowest of 200 are past the p99
    assert quantile(three_slow, 0.99) == 9.0
    config = PreemptionConfig(warning_s=30.0, recent_windows=200)
    old_slow = [50.0] * 10 + [1.0] * 200  # slow windows older than the recent 200 are forgotten
    budget = preemption_budget(old_slow, SAVES, config)
    assert budget is not None and budget.window_s == 1.0 and budget.windows == 200


def test_t_save_is_the_longest_of_the_recent_saves() -> None:
    config = PreemptionConfig(warning_s=60.0, recent_saves=3)
    budget = preemption_budget(WINDOWS, [40.0, 12.0, 14.0, 11.0], config)
    assert budget is not None and budget.save_s == 14.0 and budget.saves == 3


def test_no_budget_without_a_warning_a_window_or_a_save() -> None:
    assert preemption_budget(WINDOWS, SAVES, PreemptionConfig()) is None
    assert preemption_budget([], SAVES, PreemptionConfig(warning_s=30.0)) is None
    assert preemption_budget(WINDOWS, [], PreemptionConfig(warning_s=30.0)) is None
    assert preemption_budget([float("nan")], SAVES, PreemptionConfig(warning_s=30.0)) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("warning_s", 0.0), ("warning_s", float("inf")), ("margin_s", -1.0), ("window_quantile", 0.0),
     ("window_quantile", 1.5), ("recent_windows", 0), ("recent_saves", 0)],
)  # fmt: skip
def test_the_config_refuses_what_cannot_be_a_budget(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        PreemptionConfig(**{field: value})
