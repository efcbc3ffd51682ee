"""Numerics faults of the whole step: nonfinite values, zero-token windows, AMP skip storms,
loss-scale collapse, a schedule that advanced on a skipped update, and counters that disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.types import Finding, Severity, StepPoint


@dataclass(frozen=True)
class NumericsConfig:
    """Thresholds of the numerics rules.

    - ``skip_storm``: at least 3 skipped updates in 20 windows. A healthy fp16 run skips one
      window each time the scaler probes a higher scale (every ``growth_interval`` = 2,000
      updates by default in torch.amp.GradScaler), so 3 in 20 is far from normal; the
      BigScience tr8b-104B storm skipped 5 of 7.
    - ``scale_collapse_factor``: the loss scale fell 16x below its maximum over the last 20
      steps of this incarnation (four halvings without recovery: tr1-13B fell 65536 -> 4096,
      tr8b-104B 1048576 -> 32768); counted in steps, not logged rows, so a sparse log cannot
      stretch the span. ``scale_floor``: a scale at or below 1 leaves fp16 gradients no
      headroom at all.
    - ``lr_relative_tolerance``: a schedule "advanced" when the learning rate changed by more
      than float32 rounding (1e-6 relative).
    """

    skip_storm_window: int = 20
    skip_storm_count: int = 3
    scale_window: int = 20
    scale_collapse_factor: float = 16.0
    scale_floor: float = 1.0
    lr_relative_tolerance: float = 1e-6

    def __post_init__(self) -> None:
        if not 1 <= self.skip_storm_count <= self.skip_storm_window:
            raise ValueError("NumericsConfig: 1 <= skip_storm_count <= skip_storm_window")
        if self.scale_window < 2 or self.scale_collapse_factor <= 1 or self.scale_floor < 0:
            raise ValueError("NumericsConfig: scale_window >= 2, scale_collapse_factor > 1, scale_floor >= 0")
        if self.lr_relative_tolerance < 0:
            raise ValueError("NumericsConfig.lr_relative_tolerance must be >= 0")


@dataclass(frozen=True)
class NumericsState:
    skips: tuple[bool, ...] = ()
    scales: tuple[tuple[int, float], ...] = ()
    """(step, loss scale) of this incarnation's last ``scale_window`` steps."""
    previous: StepPoint | None = None


def _finding(
    point: StepPoint,
    kind: str,
    severity: Severity,
    signal: str,
    value: float | None,
    threshold: float | None,
    message: str,
    **evidence: object,
) -> Finding:
    return Finding(
        step=point.step,
        kind=kind,
        severity=severity,
        signal=signal,
        value=value,
        threshold=threshold,
        message=message,
        incarnation=point.incarnation,
        attempt=point.attempt,
        evidence=evidence,
    )


def nonfinite_findings(point: StepPoint) -> tuple[Finding, ...]:
    """NaN or infinity in the loss, grad norm or loss scale: critical, the step is unsafe.

    One exception, by design of AMP: an infinite or NaN grad norm on a window whose update
    was skipped is the GradScaler doing its job (it found the overflow and skipped), so it
    counts toward a skip storm instead of being critical on its own.
    """
    found = []
    for signal in ("loss", "grad_norm", "loss_scale"):
        value = getattr(point, signal)
        if value is None or math.isfinite(value):
            continue
        if signal == "grad_norm" and point.skipped:
            continue
        found.append(
            _finding(
                point,
                "nonfinite",
                Severity.CRITICAL,
                signal,
                value,
                None,
                f"{signal} is {value} at step {point.step}: the step is unsafe",
            )
        )
    return tuple(found)


def zero_token_findings(point: StepPoint) -> tuple[Finding, ...]:
    if point.tokens != 0:
        return ()
    return (
        _finding(
            point,
            "zero_tokens",
            Severity.WARNING,
            "tokens",
            0.0,
            None,
            f"window at step {point.step} carried no supervised tokens: its loss is "
            "undefined (every label masked?)",
        ),
    )


def observe_numerics(
    state: NumericsState, point: StepPoint, config: NumericsConfig
) -> tuple[NumericsState, tuple[Finding, ...]]:
    found = nonfinite_findings(point) + zero_token_findings(point)
    skips = (*state.skips, bool(point.skipped))[-config.skip_storm_window :]
    # A restart restores the scale of an older checkpoint: a new span begins.
    scales = () if point.restart else state.scales
    if point.loss_scale is not None and math.isfinite(point.loss_scale):
        scales = tuple(
            (s, v)
            for s, v in (*scales, (point.step, point.loss_scale))
            if s >= point.step - config.scale_window
        )
    found += _skip_storm(point, skips, config) + _scale_collapse(point, scales, config)
    previous = state.previous
    if previous is not None and not point.restart:
        found += _lr_on_skip(previous, point, config) + _counters(previous, point)
    return NumericsState(skips=skips, scales=scales, previous=point), found


def _skip_storm(point: StepPoint, skips: tuple[bool, ...], config: NumericsConfig) -> tuple[Finding, ...]:
    count = sum(skips)
    if not point.skipped or count < config.skip_storm_count:
        return ()
    return (
        _finding(
            point,
            "skip_storm",
            Severity.WARNING,
            "skipped",
            float(count),
            float(config.skip_storm_count),
            f"{count} skipped updates in the last {len(skips)} windows (step {point.step}): "
            "an overflow storm",
            window=len(skips),
        ),
    )


def _scale_collapse(
    point: StepPoint, scales: tuple[tuple[int, float], ...], config: NumericsConfig
) -> tuple[Finding, ...]:
    if not scales or point.loss_scale is None or scales[-1][0] != point.step:
        return ()
    current, peak = scales[-1][1], max(v for _, v in scales)
    if current <= config.scale_floor:
        return (
            _finding(
                point,
                "loss_scale_collapse",
                Severity.CRITICAL,
                "loss_scale",
                current,
                config.scale_floor,
                f"loss scale {current:g} at step {point.step} is at the floor {config.scale_floor:g}",
            ),
        )
    if current * config.scale_collapse_factor > peak:
        return ()
    return (
        _finding(
            point,
            "loss_scale_collapse",
            Severity.WARNING,
            "loss_scale",
            current,
            peak / config.scale_collapse_factor,
            f"loss scale fell from {peak:g} to {current:g} within {point.step - scales[0][0] + 1} steps "
            f"(step {point.step})",
            peak=peak,
        ),
    )


def _lr_on_skip(previous: StepPoint, point: StepPoint, config: NumericsConfig) -> tuple[Finding, ...]:
    """The schedule moved although the previous window made no update."""
    if not previous.skipped or previous.lr is None or point.lr is None:
        return ()
    if not (math.isfinite(previous.lr) and math.isfinite(point.lr)):
        return ()
    scale = max(abs(previous.lr), abs(point.lr), 1e-30)
    if abs(point.lr - previous.lr) <= config.lr_relative_tolerance * scale:
        return ()
    return (
        _finding(
            point,
            "lr_advanced_on_skip",
            Severity.WARNING,
            "lr",
            point.lr,
            previous.lr,
            f"learning rate moved {previous.lr:.6g} -> {point.lr:.6g} after the skipped update "
            f"at step {previous.step}: a per-update schedule must not advance on a skip",
        ),
    )


def _counters(previous: StepPoint, point: StepPoint) -> tuple[Finding, ...]:
    """Attempts, consumed examples and successful updates are three counters that must agree."""
    if previous.attempt is None or point.attempt != previous.attempt + 1:
        return ()
    problems = []
    expected_step = previous.step + (0 if point.skipped else 1)
    if point.skipped is not None and point.step != expected_step:
        problems.append(
            f"step went {previous.step} -> {point.step} on a {'skipped' if point.skipped else 'successful'} "
            f"window (expected {expected_step})"
        )
    if point.consumed is not None and previous.consumed is not None and point.consumed < previous.consumed:
        problems.append(f"consumed examples went backwards {previous.consumed} -> {point.consumed}")
    if not problems:
        return ()
    return (
        _finding(
            point,
            "counter_mismatch",
            Severity.WARNING,
            "step",
            float(point.step),
            float(expected_step),
            "; ".join(problems) + f" (attempt {point.attempt})",
        ),
    )
