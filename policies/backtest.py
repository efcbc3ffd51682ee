"""Judging a whole recorded series in order: what ``runhealth backtest`` runs.

The same step policies and grouping the live engine uses, with incidents kept in memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from policies.incidents import extend, matching_incident, open_incident
from policies.series import SeriesConfig, SeriesState, observe_step
from policies.types import Finding, IncidentView, Severity, StepPoint


@dataclass(frozen=True)
class BacktestIncident:
    view: IncidentView
    summary: str


@dataclass(frozen=True)
class BacktestResult:
    steps: int
    findings: tuple[tuple[Finding, int | None], ...]
    """Each finding with the key of the incident it joined; ``None`` for an ``info`` finding,
    which is evidence and opens no incident (as in the live judge)."""
    incidents: tuple[BacktestIncident, ...]


def backtest_series(points: Iterable[StepPoint], config: SeriesConfig) -> BacktestResult:
    state = SeriesState.empty(config)
    views: dict[int, IncidentView] = {}
    summaries: dict[int, str] = {}
    findings: list[tuple[Finding, int | None]] = []
    steps = 0
    for point in points:
        steps += 1
        state, found = observe_step(state, point, config)
        for finding in found:
            if finding.severity is Severity.INFO:
                findings.append((finding, None))
                continue
            match = matching_incident(finding, views.values(), config.grouping)
            if match is None:
                key = len(views) + 1
                views[key] = open_incident(key, finding)
                summaries[key] = finding.message
            else:
                key = match.key
                views[key] = extend(match, finding)
                if views[key].kind != match.kind:  # refined (a spike that is a broken resume): say why
                    summaries[key] = finding.message
            findings.append((finding, key))
    incidents = tuple(BacktestIncident(views[key], summaries[key]) for key in sorted(views))
    return BacktestResult(steps=steps, findings=tuple(findings), incidents=incidents)
