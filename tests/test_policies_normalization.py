import pytest

from policies.normalization import NormalizationConfig, normalization_findings
from policies.types import StepPoint

CONFIG = NormalizationConfig()


def window(reported: float) -> StepPoint:
    """The reference text's example: 4,800 and 9,600 supervised tokens on two replicas."""
    mean0, mean1 = 2.0, 3.0
    true = (mean0 * 4800 + mean1 * 9600) / 14400
    return StepPoint(
        step=10,
        loss=true,
        ranks=2,
        reported_loss=reported,
        naive_loss=(mean0 + mean1) / 2,
        min_rank_tokens=4800,
        max_rank_tokens=9600,
    )


def test_reported_mean_of_means_is_flagged_with_the_mis_weighting() -> None:
    (finding,) = normalization_findings(window(reported=2.5), CONFIG)
    assert finding.kind == "loss_normalization"
    assert finding.evidence["token_weight_ratio"] == pytest.approx(2.0)
    assert "weighs 2x" in finding.message


def test_token_weighted_reporting_passes() -> None:
    assert normalization_findings(window(reported=(2 * 4800 + 3 * 9600) / 14400), CONFIG) == ()


def test_equal_tokens_make_the_two_means_equal_and_nothing_to_judge() -> None:
    point = StepPoint(
        step=1, loss=2.5, ranks=2, reported_loss=2.5, naive_loss=2.5, min_rank_tokens=100, max_rank_tokens=100
    )
    assert normalization_findings(point, CONFIG) == ()


def test_single_rank_and_missing_values_are_not_judged() -> None:
    assert (
        normalization_findings(
            StepPoint(step=1, loss=2.0, ranks=1, reported_loss=3.0, naive_loss=3.0), CONFIG
        )
        == ()
    )
    assert normalization_findings(StepPoint(step=1, loss=2.0, ranks=2), CONFIG) == ()


def test_tolerance_boundary() -> None:
    naive = 2.5
    true = (2 * 4800 + 3 * 9600) / 14400
    just_inside = naive + 0.9e-3 * true
    just_outside = naive + 1.1e-3 * true
    assert len(normalization_findings(window(reported=just_inside), CONFIG)) == 1
    assert normalization_findings(window(reported=just_outside), CONFIG) == ()
