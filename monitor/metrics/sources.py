"""Data ``/metrics`` reads from the components that own it: pending proposals, canary results."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor import models

PROPOSAL = models.table_of(models.Proposal)
# A proposal waits for a person while pending, and once escalated (past the retry bound, no
# automatic proposal: an operator decides).
WAITING = ("pending", "escalated")


@dataclass(frozen=True)
class CanaryResult:
    """One device's canary history, as the canary component reports it."""

    run_id: int
    node: str
    device: str
    matches: int
    mismatches: int
    last_matched: bool


PendingProposals = Callable[[Connection], Mapping[int, int]]
"""Run id -> proposals waiting for a decision, read on the scrape's connection."""
CanaryResults = Callable[[Connection], Sequence[CanaryResult]]


def pending_proposals(connection: Connection) -> Mapping[int, int]:
    """Proposals waiting for an operator, per run (``ix_proposals_run_status``)."""
    rows = connection.execute(
        sa.select(PROPOSAL.c.run_id, sa.func.count())
        .where(PROPOSAL.c.status.in_(WAITING))
        .group_by(PROPOSAL.c.run_id)
    )
    return {int(run_id): int(count) for run_id, count in rows}


def no_canaries(_connection: Connection) -> Sequence[CanaryResult]:
    return ()


@dataclass
class MetricSources:
    """Data that ``/metrics`` reads from the components that own it.

    Proposals are read from the decision workflow's table; the canary component sets
    ``canary_results`` (``service.metric_sources.canary_results = ...``), and until it does
    every device counts as unchecked.
    """

    pending_proposals: PendingProposals = field(default=pending_proposals)
    canary_results: CanaryResults = field(default=no_canaries)
