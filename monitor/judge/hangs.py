"""Hang checks over heartbeats, on the service's own clock (a hung run sends no steps).

For each run's newest unfinished incarnation: its ranks' newest heartbeats, the timeout
learned from its own window durations, and ``policies.hangs``. A new or changed hang is
recorded once (not on every check), asks the stuck ranks for stack dumps, and the incident
closes when every rank moves again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from monitor.judge.incidents import IncidentRecorder, close_incident
from monitor.recovery import directives
from monitor.store import hook_settings, models
from policies.hangs import Beat, HangConfig, PhaseTimeouts, hang_finding, learned_timeouts, stuck_beats

HEARTBEAT = models.table_of(models.Heartbeat)
INCARNATION = models.table_of(models.Incarnation)
SUMMARY = models.table_of(models.StepSummary)
STEP = models.table_of(models.StepRecord)
INCIDENT = models.table_of(models.Incident)

# The most stuck-looking ranks named in the moved-on read's ``IN``; past it the read groups
# every rank's windows since the oldest beat's attempt.
MAX_LISTED_RANKS = 1000

# Incarnations whose newest heartbeat is older than this are abandoned, not hung.
ABANDONED_AFTER_S = 24 * 3600.0


@dataclass(frozen=True)
class Longest:
    """A run's longest window so far, and where reading its windows left off."""

    last_id: int = 0
    previous: dict[str, float] = field(default_factory=dict)
    longest: float = 0.0


class HangWatch:
    def __init__(
        self, engine: Engine, config: HangConfig, recorder: IncidentRecorder, clock: Callable[[], float]
    ) -> None:
        self._engine = engine
        self._config = config
        self._recorder = recorder
        self._clock = clock
        self._lock = threading.Lock()
        self._reported: dict[tuple[int, str], tuple[frozenset[int], frozenset[int]]] = {}
        self._longest: dict[int, Longest] = {}

    def check(self, among: Collection[int] | None = None) -> list[int]:
        """One pass over every live incarnation (of the runs ``among``, when given); returns
        the hang incidents touched."""
        now = self._clock()
        touched: list[int] = []
        with self._lock, self._engine.begin() as connection:
            for run_id, incarnation in self._live(connection, now):
                if among is None or run_id in among:
                    touched += self._check(connection, run_id, incarnation, now)
        return touched

    def forget(self, run_id: int) -> None:
        """Drop what this watch remembers of a run another replica judges now."""
        with self._lock:
            self._longest.pop(run_id, None)
            for key in [key for key in self._reported if key[0] == run_id]:
                del self._reported[key]

    def _live(self, connection: Connection, now: float) -> list[tuple[int, str]]:
        """Each run's newest incarnation that has heartbeats and has not finished."""
        newest = (
            sa.select(
                HEARTBEAT.c.run_id,
                HEARTBEAT.c.incarnation,
                sa.func.max(HEARTBEAT.c.received_at).label("heard"),
            )
            .group_by(HEARTBEAT.c.run_id, HEARTBEAT.c.incarnation)
            .subquery()
        )
        rows = connection.execute(
            sa.select(newest.c.run_id, newest.c.incarnation, newest.c.heard, INCARNATION.c.finished_at)
            .outerjoin(
                INCARNATION,
                (INCARNATION.c.run_id == newest.c.run_id)
                & (INCARNATION.c.incarnation == newest.c.incarnation),
            )
            .where(newest.c.heard > now - ABANDONED_AFTER_S)
        ).all()
        latest: dict[int, Any] = {}
        for row in rows:
            if row.run_id not in latest or row.heard > latest[row.run_id].heard:
                latest[row.run_id] = row
        return [(r.run_id, r.incarnation) for r in latest.values() if r.finished_at is None]

    def _check(self, connection: Connection, run_id: int, incarnation: str, now: float) -> list[int]:
        beats = [
            Beat(r.rank, r.node, r.step, r.phase, r.phase_since, r.received_at, r.attempt, r.cpu_busy_at)
            for r in connection.execute(
                sa.select(HEARTBEAT).where(
                    HEARTBEAT.c.run_id == run_id, HEARTBEAT.c.incarnation == incarnation
                )
            )
        ]
        facts = connection.execute(
            sa.select(INCARNATION.c.world_size, INCARNATION.c.config, INCARNATION.c.started_at).where(
                INCARNATION.c.run_id == run_id, INCARNATION.c.incarnation == incarnation
            )
        ).first()
        world, config, started_at = (
            (facts.world_size, facts.config, facts.started_at) if facts else (None, None, None)
        )
        timeouts = self._timeouts(connection, run_id, incarnation)
        stated = hook_settings.stated(config, "heartbeat_s")
        candidates = stuck_beats(beats, now, timeouts, self._config, stated)
        moved_on = self._moved_on(connection, run_id, incarnation, candidates)
        finding = hang_finding(
            beats, world, now, timeouts, incarnation, self._config, stated, started_at, moved_on
        )
        key = (run_id, incarnation)
        if finding is None:
            if key in self._reported:
                del self._reported[key]
                return self._resolve(connection, run_id, now)
            return []
        signature = (
            frozenset(s["rank"] for s in finding.evidence["stuck"]),
            frozenset(m["rank"] for m in finding.evidence["missing"]),
        )
        if self._reported.get(key) == signature:
            return []
        self._reported[key] = signature
        touched = self._recorder.record(connection, run_id, [finding], finding.step)
        wanted = sorted(signature[0]) or None
        for incident_id in touched:
            if not directives.has_pending(connection, run_id, "dump_stacks", incident_id):
                directives.create_directive(
                    connection,
                    run_id,
                    "dump_stacks",
                    created_by="engine",
                    now=now,
                    incarnation=incarnation,
                    ranks=wanted,
                    incident_id=incident_id,
                )
        return touched

    def _moved_on(
        self, connection: Connection, run_id: int, incarnation: str, candidates: list[Beat]
    ) -> set[int]:
        """The ranks among ``candidates`` (beats past their timeout) that stored a window ending
        after their heartbeat's phase began (both times on the rank's clock): they left that
        phase, whatever the heartbeat says. One grouped read through the window index, from the
        oldest candidate's attempt on (a window ending after a phase began is the beat's own
        attempt or a later one): in a real hang, where every rank waits in the same window,
        it finds nothing at once."""
        if not candidates:
            return set()
        ranks = {b.rank for b in candidates}
        query = (
            sa.select(STEP.c.rank, sa.func.max(STEP.c.time).label("ended"))
            .where(
                STEP.c.run_id == run_id,
                STEP.c.incarnation == incarnation,
                STEP.c.attempt >= min(b.attempt or 0 for b in candidates),
            )
            .group_by(STEP.c.rank)
        )
        if len(ranks) <= MAX_LISTED_RANKS:
            query = query.where(STEP.c.rank.in_(sorted(ranks)))
        ended = {row.rank: row.ended for row in connection.execute(query)}
        return {b.rank for b in candidates if b.rank in ended and ended[b.rank] > b.phase_since}

    def _timeouts(self, connection: Connection, run_id: int, incarnation: str) -> PhaseTimeouts:
        times = (
            connection.execute(
                sa.select(SUMMARY.c.last_time)
                .where(SUMMARY.c.run_id == run_id, SUMMARY.c.incarnation == incarnation)
                .order_by(SUMMARY.c.attempt.desc())
                .limit(200)
            )
            .scalars()
            .all()
        )
        ordered = sorted(times)
        recent = [b - a for a, b in pairwise(ordered)]
        return learned_timeouts(recent, self._config, self._longest_window(connection, run_id))

    def _longest_window(self, connection: Connection, run_id: int) -> float:
        """The longest window the run ever had (its longest save or evaluation between two
        windows included), kept up to date from the windows summarized since the last check."""
        seen = self._longest.get(run_id, Longest())
        rows = connection.execute(
            sa.select(SUMMARY.c.id, SUMMARY.c.incarnation, SUMMARY.c.last_time)
            .where(SUMMARY.c.run_id == run_id, SUMMARY.c.id > seen.last_id)
            .order_by(SUMMARY.c.id)
            .limit(100_000)
        ).all()
        longest, previous = seen.longest, dict(seen.previous)
        for row in rows:
            before = previous.get(row.incarnation)
            if before is not None and row.last_time > before:
                longest = max(longest, row.last_time - before)
            previous[row.incarnation] = row.last_time
        last_id = rows[-1].id if rows else seen.last_id
        # Only the newest incarnation's last window matters for the next gap.
        newest = {rows[-1].incarnation: previous[rows[-1].incarnation]} if rows else seen.previous
        self._longest[run_id] = Longest(last_id, newest, longest)
        return longest

    def _resolve(self, connection: Connection, run_id: int, now: float) -> list[int]:
        open_hangs = (
            connection.execute(
                sa.select(INCIDENT.c.id).where(
                    INCIDENT.c.run_id == run_id, INCIDENT.c.kind == "hang", INCIDENT.c.status == "open"
                )
            )
            .scalars()
            .all()
        )
        for incident_id in open_hangs:
            close_incident(connection, incident_id, now)
        return list(open_hangs)
