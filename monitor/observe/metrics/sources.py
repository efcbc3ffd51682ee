"""Data ``/metrics`` reads from the components that own it: pending proposals, canary verdicts."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import models
from policies.proposal_lifecycle import AWAITING_DECISION

PROPOSAL = models.table_of(models.Proposal)
RESULT = models.table_of(models.CanaryResult)
# monitor.judge.canaries' verdicts by the result the metrics show.
VERDICTS = {"ok": "match", "mismatch": "mismatch", "rerun": "rerun"}
# A proposal waits for a person while pending, and once escalated (past the retry bound, no
# automatic proposal: an operator decides).
WAITING = tuple(status.value for status in AWAITING_DECISION)


@dataclass(frozen=True)
class CanaryVerdict:
    """A rank's newest judged canary result: "match", "mismatch" or "rerun" (a miss whose
    re-run was requested)."""

    run_id: int
    rank: int
    node: str
    device: str
    result: str
    time: float


PendingProposals = Callable[[Connection], Mapping[int, int]]
"""Run id -> proposals waiting for a decision, read on the scrape's connection."""
CanaryVerdicts = Callable[[Connection, Mapping[int, int]], Sequence[CanaryVerdict]]
"""(connection, run id -> its ranks) -> each rank's newest canary verdict."""


def pending_proposals(connection: Connection) -> Mapping[int, int]:
    """Proposals waiting for an operator, per run (``ix_proposals_run_status``)."""
    rows = connection.execute(
        sa.select(PROPOSAL.c.run_id, sa.func.count())
        .where(PROPOSAL.c.status.in_(WAITING))
        .group_by(PROPOSAL.c.run_id)
    )
    return {int(run_id): int(count) for run_id, count in rows}


def newest_canary_verdicts(
    connection: Connection, ranks_by_run: Mapping[int, int]
) -> Sequence[CanaryVerdict]:
    """Each rank's newest verdict among its run's newest judged results: twice the run's ranks,
    the newest round and its re-runs (``ix_canary_results_run_judged``; rounds are a few an hour
    and the table keeps them all, so the history is never read)."""
    found: list[CanaryVerdict] = []
    for run_id, ranks in ranks_by_run.items():
        rows = connection.execute(
            sa.select(RESULT.c.rank, RESULT.c.node, RESULT.c.device_uuid, RESULT.c.verdict, RESULT.c.time)
            .where(RESULT.c.run_id == run_id, RESULT.c.judged.is_(True))
            .order_by(RESULT.c.id.desc())
            .limit(2 * max(ranks, 1))
        )
        newest: dict[int, CanaryVerdict] = {}
        for rank, node, device, verdict, at in rows:  # newest first
            if rank not in newest and verdict in VERDICTS:
                newest[rank] = CanaryVerdict(run_id, rank, node or "", device or "", VERDICTS[verdict], at)
        found += newest.values()
    return found


@dataclass
class MetricSources:
    """Data that ``/metrics`` reads from the components that own it, replaceable by them.

    Proposals are read from the decision workflow's table, canary verdicts from the canary
    results the service judged (``monitor.judge.canaries``).
    """

    pending_proposals: PendingProposals = field(default=pending_proposals)
    canary_verdicts: CanaryVerdicts = field(default=newest_canary_verdicts)
