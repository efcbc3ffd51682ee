"""Loss-normalization audit: is the trainer's loss the token-weighted mean over replicas?

With replicas holding different numbers of supervised tokens, the mean of per-rank means
weighs each token by 1/(its rank's token count): the reference text's 4,800 vs 9,600 example
gives replica 0's tokens twice the weight of replica 1's. The true objective is
sum(loss) / sum(tokens) over all replicas and the whole accumulation window.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.types import Finding, Severity, StepPoint


@dataclass(frozen=True)
class NormalizationConfig:
    """When a reported loss "matches" one mean and not the other.

    ``relative_tolerance`` 1e-3: float32 accumulation of a few million token losses agrees
    to about 1e-6 relative, and trainers round logged losses to 4 significant digits
    (the transformers Trainer rounds to 4 decimals), so 1e-3 separates "equal" from the
    smallest distortion worth reporting. ``min_distortion`` 1%: below it the two means are
    too close to tell which one the trainer computed.
    """

    relative_tolerance: float = 1e-3
    min_distortion: float = 0.01

    def __post_init__(self) -> None:
        if self.relative_tolerance <= 0 or self.min_distortion <= self.relative_tolerance:
            raise ValueError("NormalizationConfig: 0 < relative_tolerance < min_distortion")


def normalization_findings(point: StepPoint, config: NormalizationConfig) -> tuple[Finding, ...]:
    true, naive, reported = point.loss, point.naive_loss, point.reported_loss
    if point.ranks < 2 or true is None or naive is None or reported is None:
        return ()
    if not (true == true and naive == naive and reported == reported):  # NaN: nonfinite's job
        return ()
    scale = max(abs(true), 1e-12)
    if abs(naive - true) < config.min_distortion * scale:
        return ()
    matches_naive = abs(reported - naive) <= config.relative_tolerance * scale
    if not matches_naive or abs(reported - true) <= config.relative_tolerance * scale:
        return ()
    weight = (
        point.max_rank_tokens / point.min_rank_tokens
        if point.max_rank_tokens and point.min_rank_tokens
        else None
    )
    weighting = (
        f"; a token on the rank with the fewest tokens weighs {weight:.3g}x one on the rank with the most"
        if weight is not None
        else ""
    )
    return (
        Finding(
            step=point.step,
            kind="loss_normalization",
            severity=Severity.WARNING,
            signal="reported_loss",
            value=reported,
            threshold=true,
            message=(
                f"reported loss {reported:.6g} at step {point.step} is the mean of per-rank means "
                f"({naive:.6g}), not the token-weighted mean ({true:.6g}){weighting}"
            ),
            incarnation=point.incarnation,
            attempt=point.attempt,
            evidence={
                "true": true,
                "naive": naive,
                "token_weight_ratio": weight,
                "min_rank_tokens": point.min_rank_tokens,
                "max_rank_tokens": point.max_rank_tokens,
            },
        ),
    )
