"""Per-rank loss per token, compared within the rank's data-parallel group.

A corrupted batch, or a device that computes wrong answers, shows first on one rank: its
loss per supervised token leaves its peers'. The whole-run loss sees it diluted by the
number of replicas; this policy names the rank, its node and device and the batch ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from policies.peers import RankWindow
from policies.stats import allowed_excess, array_median_mad
from policies.types import Finding, Severity
from policies.window import RobustWindow


@dataclass(frozen=True)
class RankLossConfig:
    """Thresholds of the per-rank loss-per-token rule.

    The scale is the trailing median (over ``window`` windows) of each window's spread of
    per-rank loss per token across peers (MAD), so it is the run's own rank-to-rank noise.
    A rank is flagged above ``z`` 10 scaled spreads and at least ``min_relative`` above its
    peers' median. The floor, +100% (loss per token doubled), comes from the scenario corpus
    (``benchmarks/scenarios.py``, 4-rank CPU trainings on 128-token batches, 28 runs): the
    largest healthy excess over the peer median was +89%, a corrupted batch reached +348% and
    +395%. A garbage batch on a real model sits near ln(vocabulary), several times a trained
    loss, so it clears the floor too. ``warmup`` 20 windows of spreads before judging: with
    the floor at +100%, replaying the corpus's 24 four-rank runs flags only the two corrupted
    batches (a 20% floor let a healthy +28% through at step 34).
    """

    window: int = 100
    warmup: int = 20
    z: float = 10.0
    min_relative: float = 1.0
    min_peers: int = 3

    def __post_init__(self) -> None:
        if not 1 <= self.warmup <= self.window or self.z <= 0 or self.min_relative < 0:
            raise ValueError("RankLossConfig: 1 <= warmup <= window, z > 0, min_relative >= 0")
        if self.min_peers < 3:
            raise ValueError("RankLossConfig.min_peers must be >= 3 (two peers cannot tell which is off)")


@dataclass(frozen=True)
class RankLossState:
    spread: RobustWindow

    @classmethod
    def empty(cls, config: RankLossConfig) -> RankLossState:
        return cls(RobustWindow(config.window))


def observe_rank_loss(
    state: RankLossState, window: RankWindow, config: RankLossConfig
) -> tuple[RankLossState, tuple[Finding, ...]]:
    with np.errstate(divide="ignore", invalid="ignore"):
        per_token = np.where(window.tokens > 0, window.loss_sum / window.tokens, np.nan)
    spreads, found = [], []
    warm = len(state.spread) >= config.warmup
    scale = state.spread.median() if warm else math.nan
    for members in window.peer_groups(config.min_peers):
        values = per_token[members]
        finite = values[np.isfinite(values)]
        if len(finite) < config.min_peers:
            continue
        center, deviation = array_median_mad(finite)
        spreads.append(deviation)
        if not warm:
            continue
        allowed = max(allowed_excess(config.z, scale), config.min_relative * abs(center))
        for index in members[np.isfinite(values) & (values > center + allowed)]:
            found.append(_finding(window, int(index), float(per_token[index]), center, center + allowed))
    spread = state.spread
    for value in spreads:
        spread = spread.push(value)
    return RankLossState(spread), tuple(found)


def _finding(window: RankWindow, index: int, value: float, center: float, threshold: float) -> Finding:
    rank = int(window.ranks[index])
    severity = Severity.CRITICAL if value - center >= 2 * (threshold - center) else Severity.WARNING
    return Finding(
        step=window.step,
        kind="rank_loss_spike",
        severity=severity,
        signal="loss_per_token",
        value=value,
        threshold=threshold,
        message=(
            f"rank {rank} loss per token {value:.4g} at step {window.step} is above its peers' "
            f"{center:.4g} (threshold {threshold:.4g}; per-rank rule: this rank against its "
            f"{len(window.ranks) - 1} data-parallel peers at the same step)"
        ),
        incarnation=window.incarnation,
        attempt=window.attempt,
        rank=rank,
        node=window.nodes[index],
        device=window.devices[index],
        evidence={
            "rule": "dp_peers",
            "peer_median": center,
            "tokens": float(window.tokens[index]),
            "sample_ids": list(window.sample_ids[index] or [])[:64],
        },
    )


@dataclass(frozen=True)
class RankLossPolicy:
    """``policies.registry.RankPolicy``: a late record is judged against its window's peers
    with the spreads as they stand (it does not move them)."""

    config: RankLossConfig
    name: str = "rank_loss"
    late: bool = True
    device_evidence: bool = False

    def start(self) -> RankLossState:
        return RankLossState.empty(self.config)

    def judge(self, state: RankLossState, observed: RankWindow) -> tuple[RankLossState, tuple[Finding, ...]]:
        return observe_rank_loss(state, observed, self.config)
