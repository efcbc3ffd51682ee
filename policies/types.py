"""Plain data the policies read and write."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return _SEVERITY_RANK[self]


_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}


def is_finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


@dataclass(frozen=True)
class StepPoint:
    """One optimizer-boundary observation of the whole run (all ranks of one window).

    ``loss`` is the token-weighted mean when token counts are known, otherwise the loss the
    trainer reported. ``None`` means "not logged"; ``nan`` is a real NaN.
    """

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    tokens: int | None = None
    loss_scale: float | None = None
    skipped: bool | None = None
    incarnation: str = ""
    attempt: int | None = None
    # True on the first point of a new incarnation (the job was restarted or resumed here).
    restart: bool = False
    consumed: int | None = None
    ranks: int = 1
    # For the loss-normalization audit: the mean of what the ranks reported (the loss they
    # backpropagate), the naive mean of per-rank token means, and the token spread.
    reported_loss: float | None = None
    naive_loss: float | None = None
    min_rank_tokens: int | None = None
    max_rank_tokens: int | None = None


@dataclass(frozen=True)
class Finding:
    """One piece of evidence a policy raised at one step."""

    step: int
    kind: str
    severity: Severity
    signal: str
    value: float | None
    threshold: float | None
    message: str
    incarnation: str = ""
    attempt: int | None = None
    rank: int | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)
    node: str | None = None
    device: str | None = None


@dataclass(frozen=True)
class IncidentView:
    """What the grouping policy needs to know of an open incident."""

    key: int
    kind: str
    severity: Severity
    first_step: int
    last_step: int
    finding_count: int = 1
    scope: str | None = None
    """For kinds judged per device, node or rank: which one (one incident each)."""
