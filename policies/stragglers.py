"""Stragglers: a rank persistently slower than its data-parallel peers.

Synchronous training waits for its slowest rank, so one slow device taxes every step. Each
phase (data wait, forward, backward, optimizer) of each rank is compared with its peers'
median for that window; the log of that ratio is smoothed per rank and phase with an
exponential moving average, and a rank whose smoothed slowdown in any phase that matters
(a phase that takes a real share of the step) reaches the threshold is a straggler.

Time waiting in collectives is not observable from the host: under DDP a slow rank's peers
absorb its delay in their backward phase (gradient all-reduce), so every rank's backward
looks alike and the slowdown shows in forward and optimizer. That is why phases are judged
separately rather than as one total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from policies.peers import PHASES, Floats, RankWindow, peer_median
from policies.types import Finding, Severity


@dataclass(frozen=True)
class StragglerConfig:
    """Thresholds of the straggler rule.

    - ``slow_ratio`` 1.07: a rank 10% slower than its peers converges to a smoothed ratio of
      1.10 and crosses 1.07 within ~30 windows (alpha 1/25); on the development scenarios
      (4-rank CPU trainings on 2 shared cores) healthy ranks' smoothed ratios stay within
      1.03.
    - ``alpha`` 0.04: an effective window of ~50 windows (2/alpha - 1), the issue's "over a
      window", at a cost of two arrays per phase.
    - ``clip`` 0.7: one window's log-ratio is clipped to +-0.7 (2x) so a single pause (GC,
      page fault, checkpoint) cannot make a straggler.
    - ``min_windows`` 20 and ``min_share`` 10%: judge a rank after 20 windows, and only on
      phases that take at least 10% of the peers' step (a 50 us data wait is noise).
    """

    slow_ratio: float = 1.07
    alpha: float = 0.04
    clip: float = 0.7
    min_windows: int = 20
    min_share: float = 0.10
    min_peers: int = 3
    phases: tuple[str, ...] = PHASES

    def __post_init__(self) -> None:
        if self.slow_ratio <= 1 or not 0 < self.alpha <= 1 or self.clip <= 0:
            raise ValueError("StragglerConfig: slow_ratio > 1, 0 < alpha <= 1, clip > 0")
        if self.min_windows < 1 or not 0 <= self.min_share < 1 or self.min_peers < 3:
            raise ValueError("StragglerConfig: min_windows >= 1, 0 <= min_share < 1, min_peers >= 3")
        if set(self.phases) - set(PHASES):
            raise ValueError(f"StragglerConfig.phases must be among {PHASES}")


@dataclass(frozen=True)
class StragglerState:
    """Per rank id (array index): smoothed log-ratio per phase and windows observed."""

    smoothed: dict[str, Floats] = field(default_factory=dict)
    observed: Floats = field(default_factory=lambda: np.zeros(0))
    flagged: frozenset[int] = frozenset()


def _grown(array: Floats, size: int) -> Floats:
    if len(array) >= size:
        return array.copy()
    grown = np.zeros(size)
    grown[: len(array)] = array
    return grown


@dataclass(frozen=True)
class StragglerScore:
    rank: int
    phase: str
    ratio: float


def observe_stragglers(
    state: StragglerState, window: RankWindow, config: StragglerConfig
) -> tuple[StragglerState, tuple[Finding, ...]]:
    size = int(window.ranks.max()) + 1 if len(window.ranks) else 0
    smoothed = {p: _grown(state.smoothed.get(p, np.zeros(0)), size) for p in config.phases}
    observed = _grown(state.observed, size)
    for members in window.peer_groups(config.min_peers):
        ranks = window.ranks[members]
        step_total = sum(peer_median(window.phases[p], members) for p in PHASES if p in window.phases)
        for phase in config.phases:
            times = window.phases[phase][members]
            center = peer_median(window.phases[phase], members)
            if not (center > 0 and step_total > 0 and center >= config.min_share * step_total):
                continue
            ok = np.isfinite(times) & (times > 0)
            ratio = np.clip(np.log(times[ok] / center), -config.clip, config.clip)
            previous = smoothed[phase][ranks[ok]]
            smoothed[phase][ranks[ok]] = previous + config.alpha * (ratio - previous)
        observed[ranks] += 1
    scores = straggler_scores(smoothed, observed, config)
    slow = {s.rank: s for s in scores if s.ratio >= config.slow_ratio}
    found = tuple(
        _finding(window, slow[rank], config.slow_ratio) for rank in sorted(slow) if rank not in state.flagged
    )
    return StragglerState(smoothed, observed, frozenset(slow)), found


def straggler_scores(
    smoothed: dict[str, Floats], observed: Floats, config: StragglerConfig
) -> list[StragglerScore]:
    """Each judged rank's worst phase, as a ratio to its peers' median (1.0 = typical)."""
    scores = []
    for rank in np.flatnonzero(observed >= config.min_windows):
        phase = max(smoothed, key=lambda p: smoothed[p][rank])
        scores.append(StragglerScore(int(rank), phase, math.exp(float(smoothed[phase][rank]))))
    return scores


def _finding(window: RankWindow, score: StragglerScore, threshold: float) -> Finding:
    index = int(np.flatnonzero(window.ranks == score.rank)[0]) if score.rank in window.ranks else None
    node = window.nodes[index] if index is not None else None
    device = window.devices[index] if index is not None else None
    severity = Severity.CRITICAL if score.ratio >= 1.5 else Severity.WARNING
    return Finding(
        step=window.step,
        kind="straggler",
        severity=severity,
        signal=f"{score.phase}_s",
        value=score.ratio,
        threshold=threshold,
        message=(
            f"rank {score.rank} ({node or 'unknown node'}) is {score.ratio - 1:.0%} slower than its "
            f"data-parallel peers in {score.phase} (smoothed over ~50 windows, step {window.step})"
        ),
        incarnation=window.incarnation,
        attempt=window.attempt,
        rank=score.rank,
        node=node,
        device=device,
        evidence={"phase": score.phase, "ratio": score.ratio},
    )
