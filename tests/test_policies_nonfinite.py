import math

import pytest

from policies.nonfinite import NonfiniteConfig, nonfinite_findings
from policies.types import Severity, StepPoint


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nonfinite_loss_is_critical(value: float) -> None:
    (finding,) = nonfinite_findings(StepPoint(step=9, loss=value, incarnation="a"), NonfiniteConfig())
    assert finding.severity is Severity.CRITICAL
    assert finding.signal == "loss"
    assert finding.step == 9
    assert finding.incarnation == "a"


def test_each_nonfinite_signal_is_its_own_finding() -> None:
    point = StepPoint(step=1, loss=math.nan, grad_norm=math.inf)
    assert {f.signal for f in nonfinite_findings(point, NonfiniteConfig())} == {"loss", "grad_norm"}


def test_not_logged_is_not_nonfinite() -> None:
    assert nonfinite_findings(StepPoint(step=1), NonfiniteConfig()) == ()


def test_finite_values_pass() -> None:
    point = StepPoint(step=1, loss=1e30, grad_norm=0.0)
    assert nonfinite_findings(point, NonfiniteConfig()) == ()


def test_signals_can_be_narrowed_and_are_validated() -> None:
    point = StepPoint(step=1, loss=math.nan, grad_norm=math.nan)
    assert [f.signal for f in nonfinite_findings(point, NonfiniteConfig(signals=("grad_norm",)))] == [
        "grad_norm"
    ]
    with pytest.raises(ValueError):
        NonfiniteConfig(signals=("lr",))
