"""The preemption budget: does the run's own path from a warning to a durable checkpoint fit
the notice its platform gives?

The reference text ("Budget the entire remaining path"): a preemption warning is a strict
deadline, not a save command, and

    T_warning >= T_window + T_save + T_margin

where ``T_window`` is finishing the accumulation window in flight (the run saves only at
completed update boundaries), ``T_save`` runs from the save's start through durable publication,
and ``T_margin`` absorbs network and disk jitter. Both measured terms come from the run's own
records: the p99 of its recent windows' times, and the longest of its recent saves. The check
establishes feasibility at those estimates, not a deadline guarantee (the reference text's own
words).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from policies.types import Finding, Severity

KIND = "preemption_budget"
FITS = "preemption_budget_fits"


@dataclass(frozen=True)
class PreemptionConfig:
    """The budget's terms that are not measured.

    - ``warning_s`` None: the notice the platform gives before it kills the job
      (``RUNHEALTH_PREEMPTION_WARNING_S``). There is no universal value, so no budget is judged
      until it is set: GCP spot VMs get 30 s, AWS spot instances 2 minutes (120 s), a Slurm job
      what its ``--signal=TERM@N`` says (N seconds before the end of its time limit).
    - ``margin_s`` 5: the reference text's ``T_margin`` ("absorbs network and disk jitter")
      comes with no number; 5 s is a sixth of the shortest common notice (GCP's 30 s), so a path
      that fits a 30 s notice still has room for jitter the measured saves did not show. Set it
      from your storage's own jitter.
    - ``window_quantile`` 0.99 over ``recent_windows`` 200: the window in flight when a warning
      comes is any window, and one in a hundred is as slow as the p99; 200 windows make the p99
      the second slowest, not the one slowest (an outlier that a retry or a cold cache made).
    - ``recent_saves`` 5: ``T_save`` is the longest of the run's last five measured saves
      (saves are few, minutes apart; the longest recent one, since a save that ran long once can
      run long again when the warning comes).
    """

    warning_s: float | None = None
    margin_s: float = 5.0
    window_quantile: float = 0.99
    recent_windows: int = 200
    recent_saves: int = 5

    def __post_init__(self) -> None:
        if self.warning_s is not None and not (math.isfinite(self.warning_s) and self.warning_s > 0):
            raise ValueError(f"PreemptionConfig.warning_s must be a positive number, got {self.warning_s}")
        if not (math.isfinite(self.margin_s) and self.margin_s >= 0):
            raise ValueError(f"PreemptionConfig.margin_s must be >= 0, got {self.margin_s}")
        if not 0 < self.window_quantile <= 1:
            raise ValueError(
                f"PreemptionConfig.window_quantile must be in (0, 1], got {self.window_quantile}"
            )
        if self.recent_windows < 1 or self.recent_saves < 1:
            raise ValueError("PreemptionConfig: recent_windows and recent_saves must be >= 1")


@dataclass(frozen=True)
class Budget:
    """One evaluation of the budget, in seconds."""

    warning_s: float
    window_s: float
    save_s: float
    margin_s: float
    windows: int
    """How many windows ``window_s`` was taken over."""
    saves: int
    """How many saves ``save_s`` was taken over."""

    @property
    def needed_s(self) -> float:
        return self.window_s + self.save_s + self.margin_s

    @property
    def slack_s(self) -> float:
        """What the warning leaves after the path: negative when the path does not fit."""
        return self.warning_s - self.needed_s

    @property
    def fits(self) -> bool:
        return self.slack_s >= 0

    def arithmetic(self) -> str:
        relation = ">=" if self.fits else "<"
        return (
            f"T_warning {self.warning_s:g} s {relation} T_window {self.window_s:.3g} s + T_save "
            f"{self.save_s:.3g} s + T_margin {self.margin_s:g} s = {self.needed_s:.3g} s"
        )


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by the nearest rank (a value the run really had, never interpolated
    past its slowest window)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("quantile of no values")
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def preemption_budget(
    window_seconds: Sequence[float], save_seconds: Sequence[float], config: PreemptionConfig
) -> Budget | None:
    """The budget from the run's recent window times (oldest first) and its measured saves
    (oldest first); None without a configured warning, a window or a save to measure."""
    windows = [w for w in window_seconds[-config.recent_windows :] if math.isfinite(w) and w >= 0]
    saves = [s for s in save_seconds[-config.recent_saves :] if math.isfinite(s) and s >= 0]
    if config.warning_s is None or not windows or not saves:
        return None
    return Budget(
        warning_s=config.warning_s,
        window_s=quantile(windows, config.window_quantile),
        save_s=max(saves),
        margin_s=config.margin_s,
        windows=len(windows),
        saves=len(saves),
    )


def _evidence(budget: Budget) -> dict[str, float | int]:
    return {
        "warning_s": budget.warning_s,
        "window_s": budget.window_s,
        "save_s": budget.save_s,
        "margin_s": budget.margin_s,
        "needed_s": budget.needed_s,
        "slack_s": budget.slack_s,
        "windows": budget.windows,
        "saves": budget.saves,
    }


def budget_finding(budget: Budget, step: int, incarnation: str = "") -> Finding | None:
    """A warning when the path from a preemption notice to a durable checkpoint does not fit
    the notice; None when it fits."""
    if budget.fits:
        return None
    return Finding(
        step=step,
        kind=KIND,
        severity=Severity.WARNING,
        signal="preemption_slack_s",
        value=budget.slack_s,
        threshold=0.0,
        message=(
            f"a preemption warning does not leave time to save: {budget.arithmetic()}, short by "
            f"{-budget.slack_s:.3g} s (p99 of {budget.windows} windows, longest of {budget.saves} "
            "saves). Save faster (asynchronous staging), checkpoint to a closer tier, shorten the "
            "window, or rely on the last periodic checkpoint when the notice comes"
        ),
        incarnation=incarnation,
        evidence=_evidence(budget),
    )


def budget_fits(budget: Budget, step: int, incarnation: str = "") -> Finding:
    """The note that resolves an open ``preemption_budget`` incident: the path fits again."""
    return Finding(
        step=step,
        kind=FITS,
        severity=Severity.INFO,
        signal="preemption_slack_s",
        value=budget.slack_s,
        threshold=0.0,
        message=f"the preemption budget fits again: {budget.arithmetic()}",
        incarnation=incarnation,
        evidence=_evidence(budget),
    )
