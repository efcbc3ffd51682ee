"""Bounded retries: an automatic restart loop must end with a human."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryConfig:
    """At most ``per_incident`` rollbacks for one incident and ``per_window`` for the whole
    run within ``window_s``.

    Defaults: 2 per incident (a rollback that lands back on the same fault is evidence that
    rolling back does not help: after the second, a human decides) and 3 per 6 hours for
    the run (the reference text: "Use bounded retries so an automatic restart cannot loop
    indefinitely"; the BigScience tr8-104B chronicle needed three rollbacks in a day before
    the team changed the recipe instead).
    """

    per_incident: int = 2
    per_window: int = 3
    window_s: float = 6 * 3600.0

    def __post_init__(self) -> None:
        if self.per_incident < 1 or self.per_window < 1 or self.window_s <= 0:
            raise ValueError("RetryConfig: per_incident >= 1, per_window >= 1, window_s > 0")


@dataclass(frozen=True)
class Rollback:
    """One rollback that was approved (automatically or by an operator)."""

    incident: int
    time: float


@dataclass(frozen=True)
class RetryDecision:
    allowed: bool
    reason: str


def may_roll_back(
    history: Sequence[Rollback], incident: int, now: float, config: RetryConfig
) -> RetryDecision:
    for_incident = sum(1 for r in history if r.incident == incident)
    if for_incident >= config.per_incident:
        return RetryDecision(
            False,
            f"incident {incident} was rolled back {for_incident} times (bound {config.per_incident}): escalate",
        )
    recent = sum(1 for r in history if now - r.time < config.window_s)
    if recent >= config.per_window:
        hours = config.window_s / 3600
        return RetryDecision(
            False, f"{recent} rollbacks in the last {hours:g} h (bound {config.per_window}): escalate"
        )
    return RetryDecision(True, f"rollback {for_incident + 1} of {config.per_incident} for this incident")
