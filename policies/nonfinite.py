"""Nonfinite loss or grad norm: the step is unsafe, whatever else is going on."""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.types import Finding, Severity, StepPoint


@dataclass(frozen=True)
class NonfiniteConfig:
    """Which signals are checked for NaN and infinity.

    Defaults from the reference text ("Reject nonfinite training state as a new operational
    recovery point"): a NaN or infinite loss or grad norm is always critical; there is no
    threshold to calibrate.
    """

    signals: tuple[str, ...] = ("loss", "grad_norm")

    def __post_init__(self) -> None:
        unknown = set(self.signals) - {"loss", "grad_norm"}
        if unknown:
            raise ValueError(f"NonfiniteConfig.signals: unknown signal(s) {sorted(unknown)}")


def nonfinite_findings(point: StepPoint, config: NonfiniteConfig) -> tuple[Finding, ...]:
    """A critical finding per nonfinite signal of one step (``None`` is "not logged")."""
    found = []
    for signal in config.signals:
        value = getattr(point, signal)
        if value is None or math.isfinite(value):
            continue
        found.append(
            Finding(
                step=point.step,
                kind="nonfinite",
                severity=Severity.CRITICAL,
                signal=signal,
                value=value,
                threshold=None,
                message=f"{signal} is {value} at step {point.step}: the step is unsafe",
                incarnation=point.incarnation,
                attempt=point.attempt,
            )
        )
    return tuple(found)
