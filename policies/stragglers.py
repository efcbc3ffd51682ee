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

    - ``slow_ratio`` 1.09 and ``persist`` 5: "at least 10% slower" with one point of room for
      noise: a rank 10% slower in every phase converges to a smoothed 1.10 and stays above
      1.09 from ~38 windows on (alpha 0.06), so it is flagged within ~43 windows, inside the
      50 the detection targets allow.
    - ``alpha`` 0.06: an effective window of ~32 windows (2/alpha - 1), whose noise is 18% of
      one window's (sqrt(alpha/(2-alpha))). Replayed over the 24 four-rank runs of the
      scenario corpus (``benchmarks/scenarios.py``: four ranks sharing two cores, where a
      rank that lands on a busier core really is slower for a while), alpha 0.08 flagged 17
      healthy ranks, 0.06 flagged 12 and 0.04 flagged 7 (but needs ~61 windows for a 10%
      slowdown). Device timings on a GPU do not share a core; these warnings are the host's.
    - ``recover_ratio`` 1.05: a flagged rank back below it has recovered (hysteresis keeps a
      rank at the threshold from flapping).
    - ``clip`` 0.7: one window's log-ratio is clipped to +-0.7 (2x) so a single pause (GC,
      page fault, checkpoint) cannot make a straggler.
    - ``min_windows`` 20 and ``min_share`` 10%: judge a rank after 20 windows, and only on
      phases that take at least 10% of the peers' step (a 50 us data wait is noise).
    """

    slow_ratio: float = 1.09
    persist: int = 5
    recover_ratio: float = 1.05
    alpha: float = 0.06
    clip: float = 0.7
    min_windows: int = 20
    min_share: float = 0.10
    min_peers: int = 3
    phases: tuple[str, ...] = PHASES

    def __post_init__(self) -> None:
        if self.slow_ratio <= 1 or not 0 < self.alpha <= 1 or self.clip <= 0:
            raise ValueError("StragglerConfig: slow_ratio > 1, 0 < alpha <= 1, clip > 0")
        if not 1 <= self.recover_ratio <= self.slow_ratio or self.persist < 1:
            raise ValueError("StragglerConfig: 1 <= recover_ratio <= slow_ratio, persist >= 1")
        if self.min_windows < 1 or not 0 <= self.min_share < 1 or self.min_peers < 3:
            raise ValueError("StragglerConfig: min_windows >= 1, 0 <= min_share < 1, min_peers >= 3")
        if set(self.phases) - set(PHASES):
            raise ValueError(f"StragglerConfig.phases must be among {PHASES}")


@dataclass(frozen=True)
class StragglerState:
    """Per rank id (array index): smoothed log-ratio per phase and windows observed."""

    smoothed: dict[str, Floats] = field(default_factory=dict)
    observed: Floats = field(default_factory=lambda: np.zeros(0))
    above: Floats = field(default_factory=lambda: np.zeros(0))
    """Consecutive windows each rank's score has been at or above the threshold."""
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
    scores = {s.rank: s for s in straggler_scores(smoothed, observed, config)}
    above = _grown(state.above, size)
    over = np.array([r for r, s in scores.items() if s.ratio >= config.slow_ratio], dtype=np.int64)
    above[np.setdiff1d(np.arange(size), over)] = 0
    above[over] += 1
    slow = {r for r in over.tolist() if above[r] >= config.persist}
    recovered = {r for r in state.flagged if r in scores and scores[r].ratio < config.recover_ratio}
    flagged = (set(state.flagged) - recovered) | slow
    found = [_finding(window, scores[r], config.slow_ratio) for r in sorted(slow - set(state.flagged))]
    found += [_recovered(window, scores[r]) for r in sorted(recovered)]
    return StragglerState(smoothed, observed, above, frozenset(flagged)), tuple(found)


def straggler_scores(
    smoothed: dict[str, Floats], observed: Floats, config: StragglerConfig
) -> list[StragglerScore]:
    """Each judged rank's worst phase, as a ratio to its peers' median (1.0 = typical)."""
    scores = []
    for rank in np.flatnonzero(observed >= config.min_windows):
        phase = max(smoothed, key=lambda p: smoothed[p][rank])
        scores.append(StragglerScore(int(rank), phase, math.exp(float(smoothed[phase][rank]))))
    return scores


def _recovered(window: RankWindow, score: StragglerScore) -> Finding:
    return Finding(
        step=window.step,
        kind="straggler_recovered",
        severity=Severity.INFO,
        signal=f"{score.phase}_s",
        value=score.ratio,
        threshold=None,
        message=f"rank {score.rank} is back within {score.ratio - 1:.0%} of its peers (step {window.step})",
        incarnation=window.incarnation,
        attempt=window.attempt,
        rank=score.rank,
    )


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


@dataclass(frozen=True)
class StragglerPolicy:
    """``policies.registry.RankPolicy``: smoothed over windows in order, so a late record is
    not judged; its findings carry the slow device's evidence."""

    config: StragglerConfig
    name: str = "stragglers"
    late: bool = False
    device_evidence: bool = True

    def start(self) -> StragglerState:
        return StragglerState()

    def judge(
        self, state: StragglerState, observed: RankWindow
    ) -> tuple[StragglerState, tuple[Finding, ...]]:
        return observe_stragglers(state, observed, self.config)
