"""Which ranks of a window have a nonfinite loss of their own (a nonfinite grad norm or loss
scale is judged on the whole window by the series rules, ``policies.numerics``).

A NaN on one rank is usually that rank's data or device; a NaN everywhere is the all-reduce
spreading it, and is then one finding with a count rather than one per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from policies.numerics import nonfinite_findings
from policies.peers import RankWindow
from policies.types import Finding, Severity, StepPoint


@dataclass(frozen=True)
class RankNonfiniteConfig:
    """``max_named_ranks`` 8: more ranks than this nonfinite in one window are reported as a
    count, not rank by rank (an incident naming hundreds of ranks says less than its count)."""

    max_named_ranks: int = 8

    def __post_init__(self) -> None:
        if self.max_named_ranks < 1:
            raise ValueError("RankNonfiniteConfig.max_named_ranks must be >= 1")


def rank_nonfinite_findings(window: RankWindow, config: RankNonfiniteConfig) -> list[Finding]:
    """Name the ranks whose own loss per supervised token is nonfinite."""
    found = []
    for index in _suspects(window).tolist():
        rank = int(window.ranks[index])
        loss_sum, tokens = float(window.loss_sum[index]), float(window.tokens[index])
        loss = loss_sum / tokens if tokens > 0 else (loss_sum if not math.isfinite(loss_sum) else None)
        point = StepPoint(step=window.step, loss=loss, incarnation=window.incarnation, attempt=window.attempt)
        found += [
            Finding(
                **{
                    **f.__dict__,
                    "rank": rank,
                    "node": window.nodes[index],
                    "device": window.devices[index],
                    "message": f"rank {rank}: {f.message}",
                    "evidence": {"sample_ids": list(window.sample_ids[index] or [])[:64]},
                }
            )
            for f in nonfinite_findings(point)
        ]
    if len(found) > config.max_named_ranks:
        first = found[0]
        return [
            Finding(
                step=first.step,
                kind="nonfinite",
                severity=Severity.CRITICAL,
                signal="loss",
                value=first.value,
                threshold=None,
                incarnation=first.incarnation,
                attempt=first.attempt,
                message=f"{len(found)} ranks have a nonfinite loss at step {first.step}",
                evidence={"ranks": len(found)},
            )
        ]
    return found


def _suspects(window: RankWindow) -> npt.NDArray[np.intp]:
    """The indices of the ranks whose loss may be nonfinite, in order: a loss sum that is not
    a finite number, or positive tokens under one (a finite sum over them may overflow). The
    rule itself is applied to these only; the others (nearly every rank of a healthy window)
    cannot raise a finding, and a StepPoint per rank per window was most of this policy's cost."""
    tokens = window.tokens
    suspects = ~np.isfinite(window.loss_sum) | ((tokens > 0) & (tokens < 1))
    if window.loss_unlogged is not None:
        suspects[window.loss_unlogged] = False  # no loss logged: nothing to call nonfinite
    return np.flatnonzero(suspects)


@dataclass(frozen=True)
class RankNonfinitePolicy:
    """``policies.registry.RankPolicy``: no memory; late records are judged too (a NaN that
    arrives late is still a NaN)."""

    config: RankNonfiniteConfig = RankNonfiniteConfig()
    name: str = "rank_nonfinite"
    late: bool = True
    device_evidence: bool = False

    def start(self) -> None:
        return None

    def judge(self, state: None, observed: RankWindow) -> tuple[None, list[Finding]]:
        return None, rank_nonfinite_findings(observed, self.config)
