"""Checkpoint interval advice: Young/Daly's optimum from the run's own save cost and interruptions.

Young (1974) and Daly (2006): with a save that stalls training for ``C`` and interruptions every
``M`` on average, the compute between saves that wastes least is ``T_opt = sqrt(2 * C * M)``
(first order, valid while ``C`` is small against ``M``). An interruption falls anywhere in a
cycle of ``T`` compute and ``C`` save, so it loses half a cycle of work on average, ``(T + C) / 2``;
over a long run the expected waste is ``C / (T + C)`` of the time for saves plus ``(T + C) / (2M)``
for redone work. The reference text asks for exactly this choice: "Choose the interval using
measured latency, interruption frequency, and acceptable replay cost."
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class IntervalConfig:
    """``fleet_mtbi_s`` 11,135 s (3.1 h): Llama 3 405B's pre-training had 419 unexpected
    interruptions in 54 days on 16,384 H100s (Dubey et al. 2024, "The Llama 3 Herd of Models",
    section 3.3.4): 54 x 86,400 / 419. Used when the run has fewer than ``min_interruptions`` of
    its own: a run interrupted once or twice says little about its rate. Set it to your fleet's
    (``RUNHEALTH_POLICIES__CHECKPOINT_INTERVAL__FLEET_MTBI_S``).

    ``min_interruptions`` 3: with three interruptions the run's own mean is within about a
    factor of two of the true rate at 90% confidence (a Poisson count of 3 has its 5-95%
    interval at 0.8-7.8), tighter than a fleet figure for another job is likely to be."""

    fleet_mtbi_s: float = 54 * 86_400 / 419
    min_interruptions: int = 3

    def __post_init__(self) -> None:
        if not self.fleet_mtbi_s > 0:
            raise ValueError(f"IntervalConfig.fleet_mtbi_s must be > 0, got {self.fleet_mtbi_s}")
        if self.min_interruptions < 1:
            raise ValueError(f"IntervalConfig.min_interruptions must be >= 1, got {self.min_interruptions}")


@dataclass(frozen=True)
class Exposure:
    """What an interval costs: lost work per interruption and the expected waste fraction."""

    interval_s: float
    lost_per_interruption_s: float
    waste_fraction: float


@dataclass(frozen=True)
class IntervalAdvice:
    save_cost_s: float | None
    """C: the median measured save stall."""
    mtbi_s: float
    """M: mean time between interruptions."""
    mtbi_source: str
    """``run`` (the run's wall time over its own interruptions) or ``fleet`` (configured)."""
    interruptions: int
    current: Exposure | None
    """Today's interval (the median compute between two saves in one incarnation), if measured."""
    advised: Exposure | None
    arithmetic: tuple[str, ...]
    """Each figure as it was computed, for the user to check."""


def exposure(interval_s: float, save_cost_s: float, mtbi_s: float) -> Exposure:
    cycle = interval_s + save_cost_s
    waste = save_cost_s / cycle + cycle / (2 * mtbi_s) if cycle > 0 else 0.0
    return Exposure(interval_s, cycle / 2, waste)


def current_interval(save_times: Sequence[Sequence[float]], save_cost_s: float) -> float | None:
    """The median time between consecutive saves of one incarnation, less the save itself."""
    gaps = [b - a for times in save_times for a, b in itertools.pairwise(times) if b > a]
    return max(0.0, statistics.median(gaps) - save_cost_s) if gaps else None


def advise(
    save_costs_s: Sequence[float],
    save_times: Sequence[Sequence[float]],
    wall_s: float,
    interruptions: int,
    config: IntervalConfig,
) -> IntervalAdvice:
    """The advice from measured save stalls (``save_costs_s``), each incarnation's save
    publication times (``save_times``), the run's wall time and its interruptions."""
    lines: list[str] = []
    if interruptions >= config.min_interruptions and wall_s > 0:
        mtbi, source = wall_s / interruptions, "run"
        lines.append(
            f"M = wall {wall_s:.1f} s / {interruptions} interruptions = {mtbi:.1f} s (the run's own)"
        )
    else:
        mtbi, source = config.fleet_mtbi_s, "fleet"
        lines.append(
            f"M = {mtbi:.1f} s (configured fleet rate: the run has {interruptions} interruption(s), "
            f"fewer than {config.min_interruptions})"
        )
    if not save_costs_s:
        lines.append("C: not measured (no checkpoint was recorded): no interval can be advised")
        return IntervalAdvice(None, mtbi, source, interruptions, None, None, tuple(lines))
    cost = statistics.median(save_costs_s)
    lines.append(f"C = median of {len(save_costs_s)} measured save stall(s) = {cost:.3f} s")
    optimum = math.sqrt(2 * cost * mtbi)
    lines.append(f"T_opt = sqrt(2 x C x M) = sqrt(2 x {cost:.3f} x {mtbi:.1f}) = {optimum:.1f} s")
    advised = exposure(optimum, cost, mtbi)
    lines.append(_exposure_line("advised", advised, cost, mtbi))
    today = current_interval(save_times, cost)
    current = None if today is None else exposure(today, cost, mtbi)
    if current is None:
        lines.append("today's interval: not measured (fewer than two saves in one incarnation)")
    else:
        lines.append(f"T_now = median time between saves less C = {today:.1f} s")
        lines.append(_exposure_line("today", current, cost, mtbi))
    return IntervalAdvice(cost, mtbi, source, interruptions, current, advised, tuple(lines))


def _exposure_line(name: str, found: Exposure, cost: float, mtbi: float) -> str:
    cycle = found.interval_s + cost
    return (
        f"{name}: lost per interruption (T + C) / 2 = ({found.interval_s:.1f} + {cost:.3f}) / 2 = "
        f"{found.lost_per_interruption_s:.1f} s; waste C / (T + C) + (T + C) / 2M = "
        f"{cost:.3f} / {cycle:.1f} + {cycle:.1f} / {2 * mtbi:.1f} = {100 * found.waste_fraction:.2f}%"
    )
