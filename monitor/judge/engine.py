"""The engine: judges each window once its ranks have reported, records findings, and
groups them into incidents.

Policies are pure (``policies/``); this module feeds them in step order, keeps their state
per run in memory (rebuilt from the newest judged windows after a restart, never from all
of history), and persists what they find. Whole-step signals are judged once per window;
per-rank signals are vectorised over the window's records.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from monitor.judge.batches import judge_batch
from monitor.judge.config import EngineConfig
from monitor.judge.incidents import IncidentRecorder
from monitor.judge.late_findings import news
from monitor.judge.readings import RANK_FIELDS, point_from_summary, rank_window
from monitor.judge.restarts import judge_restarts
from monitor.judge.resumes import judge_resumes
from monitor.judge.saves import judge_saves
from monitor.store import hook_settings, models, queries
from policies.preemption import Budget
from policies.readiness import (
    IncarnationWindows,
    PendingWindow,
    expected_ranks,
    ready_windows,
)
from policies.registry import RankPolicy, rank_policies
from policies.series import SeriesState, noted, observe_step
from policies.types import Finding

SUMMARY = models.table_of(models.StepSummary)
STEP = models.table_of(models.StepRecord)
INCARNATION = models.table_of(models.Incarnation)
# A window's step records as the per-rank rules read them (``readings.RANK_FIELDS``), built once:
# all of them, or (a replica's judge) those up to the newest it has read.
_IN_WINDOW = (
    STEP.c.run_id == sa.bindparam("run_id"),
    STEP.c.incarnation == sa.bindparam("incarnation"),
    STEP.c.attempt == sa.bindparam("attempt"),
)
_UNDER = STEP.c.id <= sa.bindparam("ceiling")
_WINDOW_ROWS = sa.select(*[STEP.c[name] for name in RANK_FIELDS]).where(*_IN_WINDOW)
_WINDOW_ROWS_UNDER = _WINDOW_ROWS.where(_UNDER)
_WINDOW_COUNT = sa.select(sa.func.count()).select_from(STEP).where(*_IN_WINDOW)
_WINDOW_COUNT_UNDER = _WINDOW_COUNT.where(_UNDER)
# Of several windows of one incarnation, the records up to a replica's judge's mark, by attempt.
_COUNTS_UNDER = (
    sa.select(STEP.c.attempt, sa.func.count())
    .where(
        STEP.c.run_id == sa.bindparam("run_id"),
        STEP.c.incarnation == sa.bindparam("incarnation"),
        STEP.c.attempt.in_(sa.bindparam("attempts", expanding=True)),
        _UNDER,
    )
    .group_by(STEP.c.attempt)
)


class _JudgedElsewhere(Exception):
    """Windows about to be judged were judged by another replica meanwhile."""


@dataclass
class _RunState:
    series: SeriesState
    ranks: dict[str, Any]  # each per-rank policy's state, by its name
    last_incarnation: str | None = None
    last_step: int = 0
    world_size: dict[str, int] = field(default_factory=dict)
    declared: set[str] = field(default_factory=set)  # world size from the run-start record
    watermark_s: dict[str, float] = field(default_factory=dict)
    pending: OrderedDict[tuple[str, int], list[dict[str, Any]]] = field(default_factory=OrderedDict)
    # When this service first saw each window still unjudged (its clock): see ``policies.readiness``.
    arrived: dict[tuple[str, int], float] = field(default_factory=dict)
    # The records each of the newest judged windows was judged with (and its late ones since).
    judged_rows: OrderedDict[tuple[str, int], list[dict[str, Any]]] = field(default_factory=OrderedDict)
    # Incarnations whose batch was compared with the one before (``monitor.judge.batches``).
    batch_judged: set[str] = field(default_factory=set)


class PolicyEngine:
    """Runs the policies over each run's windows as they become complete: the whole-step
    series, then every per-rank policy of ``rank_policies`` (by default those of
    ``policies.registry.rank_policies`` over this config)."""

    def __init__(
        self,
        engine: Engine,
        config: EngineConfig,
        clock: Callable[[], float],
        rank_policies: Sequence[RankPolicy] | None = None,
    ) -> None:
        self._engine = engine
        self._config = config
        self._clock = clock
        self._rank_policies = tuple(
            rank_policies if rank_policies is not None else default_rank_policies(config)
        )
        self._states: dict[int, _RunState] = {}
        self._lock = threading.RLock()
        self.incidents = IncidentRecorder(config.series.grouping, clock)
        # Each run's preemption budget after its newest measured save (``/metrics`` reads it).
        self._budgets: dict[int, Budget] = {}
        # Set by the service: adds a device's and its node's evidence to a finding about a slow
        # device (from the policies whose ``device_evidence`` says so).
        self.add_device_evidence: Callable[[int, Finding], Finding] = lambda _run, finding: finding
        # Set by a replica's service: the newest step record of the run its judging has read
        # (``monitor.judge.arrivals``); a window's records past it are judged late, when read.
        self.step_ceiling: Callable[[int], int | None] = lambda _run: None

    @property
    def config(self) -> EngineConfig:
        return self._config

    def last_step(self, run_id: int) -> int:
        state = self._states.get(run_id)
        return state.last_step if state is not None else 0

    def policy_state(self, run_id: int, name: str) -> object | None:
        """The state the per-rank policy ``name`` keeps for the run, as last updated; None
        before the run's first window here (after a service restart it warms up anew)."""
        with self._lock:
            state = self._states.get(run_id)
            return None if state is None else state.ranks.get(name)

    def note_steps(self, run_id: int, rows: Sequence[dict[str, Any]]) -> None:
        """Keep a batch's new step records for judging their windows without a read-back."""
        with self._lock:
            state = self._states.get(run_id)
            if state is None:
                return  # the first judge() rebuilds state and reads what it needs
            for row in rows:
                state.pending.setdefault((row["incarnation"], row["attempt"]), []).append(row)
            while len(state.pending) > self._config.cached_windows:
                state.pending.popitem(last=False)

    def judge(self, run_id: int, now: float | None = None) -> list[int]:
        """Judge every ready window of one run; returns the incidents opened or updated.

        With ``now`` (the service's clock, from the periodic pass), a window whose newest
        record is ``readiness.idle_watermarks`` (two) watermarks old is ready too: a run that
        paused, waits for a decision or ended sends nothing newer, and its last windows must not
        wait for ever.
        """
        touched: list[int] = []
        with self._lock:
            with self._engine.connect() as connection:
                state = self._state(connection, run_id)
                ready = self._ready(connection, run_id, state, now)
            # A transaction per chunk: a backlog (a spool replayed, a skip storm) must not hold
            # the store's write lock for long, or ingest waits behind it.
            for start in range(0, len(ready), self._config.judge_chunk):
                chunk = ready[start : start + self._config.judge_chunk]
                try:
                    with self._engine.begin() as connection:
                        self._claim(connection, chunk)
                        for summary in chunk:
                            findings = self._judge_window(connection, run_id, state, summary)
                            touched += self.incidents.record(connection, run_id, findings, summary["step"])
                except _JudgedElsewhere:
                    self._states.pop(run_id, None)  # its state went past windows it did not judge
                    return sorted(set(touched))
            touched += self._judge_batches(run_id, state, {s["incarnation"] for s in ready})
        return sorted(set(touched))

    def _judge_batches(self, run_id: int, state: _RunState, incarnations: set[str]) -> list[int]:
        """Each incarnation's batch against the one before it, once it has judged enough windows."""
        touched: list[int] = []
        for incarnation in sorted(incarnations - state.batch_judged):
            with self._engine.begin() as connection:
                findings = judge_batch(connection, run_id, incarnation, self._config.batch)
                if findings is None:
                    continue
                state.batch_judged.add(incarnation)
                detected = min((f.step for f in findings), default=state.last_step)
                touched += self.incidents.record(connection, run_id, findings, detected)
        return touched

    def _claim(self, connection: Connection, chunk: list[dict[str, Any]]) -> None:
        """Mark the windows judged before judging them, in the same transaction: a second judge
        of the run (two replicas whose leases overlapped for a moment) waits here for the first
        to commit, then finds them judged and rolls back instead of opening its incidents again."""
        claimed = connection.execute(
            SUMMARY.update()
            .where(SUMMARY.c.id.in_([s["id"] for s in chunk]), SUMMARY.c.judged.is_(False))
            .values(judged=True)
        ).rowcount
        if claimed != len(chunk):
            raise _JudgedElsewhere

    def judge_late(self, run_id: int, rows: Sequence[dict[str, Any]]) -> list[int]:
        """Records whose window was judged before they arrived (replayed from a spool): their
        window is judged again with them, against the state as it stands; what is news
        (``late_findings``: the late ranks' findings, and an on-time rank's named for the first
        time or more severely) joins open incidents, and the decisions are taken again."""
        if not rows:
            return []
        with self._lock, self._engine.begin() as connection:
            state = self._state(connection, run_id)
            findings: list[Finding] = []
            windows: dict[tuple[str, int], list[dict[str, Any]]] = {}
            for row in rows:
                windows.setdefault((row["incarnation"], row["attempt"]), []).append(row)
            for key, late in windows.items():
                window = rank_window(self._late_window(connection, run_id, state, key, late))
                ranks = {row["rank"] for row in late}
                for policy in self._rank_policies:
                    if policy.late:  # judged with the state as it stands: a late record does not move it
                        _, found = policy.judge(state.ranks[policy.name], window)
                        findings += news(connection, run_id, found, ranks)
            return self.incidents.record(connection, run_id, findings, state.last_step)

    def judge_resumes(self, run_id: int, rows: Sequence[dict[str, Any]]) -> list[int]:
        """Each resume record against its checkpoint and what the run did after it."""
        if not rows:
            return []
        with self._lock, self._engine.begin() as connection:
            findings = judge_resumes(connection, run_id, rows, self._config.series.continuity)
            # Found when the resume record arrived, before the resumed run's first window: the
            # run stands at the step it resumed at, not at the abandoned one judged last.
            detected = min((f.step for f in findings), default=self.last_step(run_id))
            return self.incidents.record(connection, run_id, findings, detected)

    def judge_saves(self, run_id: int, rows: Sequence[dict[str, Any]]) -> list[int]:
        """New checkpoint records with the hook's save timings: the save ordering rules and the
        preemption budget (``monitor.judge.saves``)."""
        if not rows:
            return []
        with self._lock, self._engine.begin() as connection:
            budget, findings = judge_saves(connection, run_id, rows, self._config.preemption)
            if budget is not None:
                self._budgets[run_id] = budget
            return self.incidents.record(connection, run_id, findings, self.last_step(run_id))

    def budget(self, run_id: int) -> Budget | None:
        """The run's preemption budget as its newest measured save left it (None before one
        since this service started, or without a configured warning)."""
        with self._lock:
            return self._budgets.get(run_id)

    def judge_restarts(self, run_id: int) -> list[int]:
        """The restart-loop guard, when an incarnation started or finished."""
        with self._lock, self._engine.begin() as connection:
            findings = judge_restarts(connection, run_id, self._config.restart_loop)
            return self.incidents.record(connection, run_id, findings, self.last_step(run_id))

    def forget(self, run_id: int) -> None:
        with self._lock:
            self._states.pop(run_id, None)

    def _state(self, connection: Connection, run_id: int) -> _RunState:
        state = self._states.get(run_id)
        if state is None:
            state = self._rebuild(connection, run_id)
            self._states[run_id] = state
        return state

    def _rebuild(self, connection: Connection, run_id: int) -> _RunState:
        """Series state from the newest judged windows; per-rank state warms up anew."""
        depth = self._config.series.loss_spike.window
        rows = connection.execute(
            sa.select(SUMMARY)
            .where(SUMMARY.c.run_id == run_id, SUMMARY.c.judged.is_(True))
            .order_by(SUMMARY.c.id.desc())
            .limit(depth)
        ).mappings()
        state = _RunState(
            series=SeriesState.empty(self._config.series),
            ranks={policy.name: policy.start() for policy in self._rank_policies},
        )
        for summary in reversed(list(rows)):
            restart = state.last_incarnation not in (None, summary["incarnation"])
            state.last_incarnation = summary["incarnation"]
            state.last_step = summary["step"]
            point = point_from_summary(dict(summary), restart)
            state.series, _ = observe_step(state.series, point, self._config.series)
        return state

    def _judge_window(
        self, connection: Connection, run_id: int, state: _RunState, summary: dict[str, Any]
    ) -> list[Finding]:
        restart = state.last_incarnation not in (None, summary["incarnation"])
        point = point_from_summary(summary, restart)
        state.last_incarnation = summary["incarnation"]
        state.last_step = summary["step"]
        state.series, found = observe_step(state.series, point, self._config.series)
        key = (summary["incarnation"], summary["attempt"])
        rows = state.pending.pop(key, None)
        if rows is None or len(rows) != summary["ranks_reported"]:
            rows = self._window_rows(connection, run_id, *key)
        by_rank: list[Finding] = []
        if rows:
            self._keep_judged(state, key, rows)
            window = rank_window(rows)
            for policy in self._rank_policies:
                state.ranks[policy.name], judged = policy.judge(state.ranks[policy.name], window)
                if policy.device_evidence:
                    judged = [self.add_device_evidence(run_id, f) for f in judged]
                by_rank += judged
            # A rank's spike or NaN makes this timeline's steps from here no reference for a
            # replay of them, as the run's own does (``policies.series.noted``).
            state.series = noted(state.series, by_rank)
        return [*found, *by_rank]

    def _late_window(
        self,
        connection: Connection,
        run_id: int,
        state: _RunState,
        key: tuple[str, int],
        late: list[dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """A window's records with its late ones: those it was judged with plus the late, when
        the store holds exactly that many (both are stored records of it, none in both: the late
        were stored after it was judged), else read from the store. Reading 1,024 rows per look
        was most of a replica's judging with ranks posting after their window (fleet.py)."""
        kept = state.judged_rows.pop(key, None)
        if kept is not None and len(kept) + len(late) == self._window_count(connection, run_id, *key):
            rows = kept + late
        else:
            rows = self._window_rows(connection, run_id, *key)
        self._keep_judged(state, key, rows)
        return rows

    def _keep_judged(self, state: _RunState, key: tuple[str, int], rows: list[dict[str, Any]]) -> None:
        """Keep a judged window's records: the newest ``late_windows_kept`` windows, at most
        ``late_rows_kept`` records in all."""
        state.judged_rows[key] = rows
        state.judged_rows.move_to_end(key)
        kept = sum(len(r) for r in state.judged_rows.values())
        config = self._config
        while state.judged_rows and (
            kept > config.late_rows_kept or len(state.judged_rows) > config.late_windows_kept
        ):
            kept -= len(state.judged_rows.popitem(last=False)[1])

    def _records_read(
        self,
        connection: Connection,
        run_id: int,
        state: _RunState,
        incarnation: str,
        summaries: list[dict[str, Any]],
    ) -> dict[int, int]:
        """Of each window's records, how many a replica's judge has read (by attempt): a
        window's summary also counts those stored since the judge's last look, and the window
        judged now would miss them, then read and judge them again as late. All of them when its
        looks brought them all; else the store's count up to the judge's mark (records stored
        before it took the run over, or of a window no longer kept, were never brought), one
        statement for the incarnation. A window that waits for the rest is still released by the
        watermark, as for a rank that never reports."""
        read: dict[int, int] = {}
        unsure: list[int] = []
        for summary in summaries:
            noted = state.pending.get((incarnation, summary["attempt"]))
            if noted is not None and len(noted) >= summary["ranks_reported"]:
                read[summary["attempt"]] = int(summary["ranks_reported"])
            else:
                unsure.append(summary["attempt"])
        if unsure:
            counted: dict[int, int] = dict(
                connection.execute(
                    _COUNTS_UNDER,
                    {
                        "run_id": run_id,
                        "incarnation": incarnation,
                        "attempts": unsure,
                        "ceiling": self.step_ceiling(run_id),
                    },
                ).all()
            )
            read.update({attempt: int(counted.get(attempt, 0)) for attempt in unsure})
        return read

    def _window_count(self, connection: Connection, run_id: int, incarnation: str, attempt: int) -> int:
        query, params = self._in_window(run_id, incarnation, attempt, _WINDOW_COUNT, _WINDOW_COUNT_UNDER)
        return int(connection.execute(query, params).scalar_one())

    def _window_rows(
        self, connection: Connection, run_id: int, incarnation: str, attempt: int
    ) -> list[dict[str, Any]]:
        query, params = self._in_window(run_id, incarnation, attempt, _WINDOW_ROWS, _WINDOW_ROWS_UNDER)
        # Rows as dicts from plain tuples: a RowMapping per row converted by dict() was most of
        # the cost of a late record's look at its 1,024-rank window (py-spy, fleet.py --ranks 1024).
        return [dict(zip(RANK_FIELDS, row, strict=True)) for row in connection.execute(query, params)]

    def _in_window(
        self, run_id: int, incarnation: str, attempt: int, whole: sa.Select[Any], under: sa.Select[Any]
    ) -> tuple[sa.Select[Any], dict[str, Any]]:
        """A window's statement and parameters: ``under`` the newest step record a replica's
        judge has read, else ``whole``."""
        params: dict[str, Any] = {"run_id": run_id, "incarnation": incarnation, "attempt": attempt}
        ceiling = self.step_ceiling(run_id)
        return (whole, params) if ceiling is None else (under, params | {"ceiling": ceiling})

    def waiting_runs(self, among: Collection[int] | None = None) -> list[int]:
        """Runs with windows not judged yet (of ``among``, when given)."""
        query = sa.select(SUMMARY.c.run_id).where(SUMMARY.c.judged.is_(False)).distinct()
        if among is not None:
            query = query.where(SUMMARY.c.run_id.in_(sorted(among)))
        with self._engine.connect() as connection:
            return list(connection.execute(query).scalars())

    def _ready(
        self, connection: Connection, run_id: int, state: _RunState, now: float | None = None
    ) -> list[dict[str, Any]]:
        """The unjudged windows to judge now, in order (the decision: ``policies.readiness``)."""
        pending = [
            dict(row)
            for row in connection.execute(
                sa.select(SUMMARY)
                .where(SUMMARY.c.run_id == run_id, SUMMARY.c.judged.is_(False))
                .order_by(SUMMARY.c.id)
            ).mappings()
        ]
        if not pending:
            return []
        by_incarnation: dict[str, list[dict[str, Any]]] = {}
        for summary in pending:
            by_incarnation.setdefault(summary["incarnation"], []).append(summary)
        self._learn_world_sizes(connection, run_id, state, by_incarnation)
        order = self._start_order(connection, run_id, list(by_incarnation))
        # Every waiting window's first sighting is noted now, not when the decision reaches it,
        # so a dead rank's windows are released together rather than one watermark apart.
        seen_now = self._clock()
        for summary in by_incarnation[order[-1]]:
            state.arrived.setdefault((order[-1], summary["attempt"]), seen_now)
        # A replica's judge judges a window with the records it has read, which can be fewer
        # than its summary counts (stored by any replica since its last look): judged now, the
        # window would miss them, read them back, and judge them again as late.
        replica = self.step_ceiling(run_id) is not None
        groups = [
            self._waiting(
                state,
                incarnation,
                by_incarnation[incarnation],
                seen_now,
                self._records_read(connection, run_id, state, incarnation, by_incarnation[incarnation])
                if replica
                else None,
            )
            for incarnation in order
        ]
        by_key = {(s["incarnation"], s["attempt"]): s for s in pending}
        ready = [
            by_key[(w.incarnation, w.attempt)]
            for w in ready_windows(groups, seen_now, now, self._config.readiness)
        ]
        for summary in ready:
            state.arrived.pop((summary["incarnation"], summary["attempt"]), None)
        return ready

    def _waiting(
        self,
        state: _RunState,
        incarnation: str,
        summaries: list[dict[str, Any]],
        seen_now: float,
        read: dict[int, int] | None = None,
    ) -> IncarnationWindows:
        """The incarnation's unjudged windows as the readiness rules take them; ``read``: of
        each, the records a replica's judge can judge it with (``_records_read``)."""
        windows = [
            PendingWindow(
                attempt=s["attempt"],
                ranks_reported=s["ranks_reported"] if read is None else read[s["attempt"]],
                last_time=s["last_time"],
                first_seen=state.arrived.get((incarnation, s["attempt"]), seen_now),
            )
            for s in summaries
        ]
        return IncarnationWindows(
            incarnation,
            windows,
            expected_ranks=state.world_size.get(incarnation, 1),
            watermark_s=state.watermark_s.get(incarnation, self._config.readiness.watermark_s),
        )

    def _start_order(self, connection: Connection, run_id: int, incarnations: list[str]) -> list[str]:
        """Incarnations in the order they began (their run_start or first record); those the
        store does not know yet keep their order of first pending window, after the known."""
        if len(incarnations) == 1:  # the common case, on every post: no order to ask the store for
            return incarnations
        known = dict(
            connection.execute(
                sa.select(INCARNATION.c.incarnation, INCARNATION.c.id).where(
                    INCARNATION.c.run_id == run_id, INCARNATION.c.incarnation.in_(incarnations)
                )
            ).all()
        )
        position = {inc: (0, known[inc]) if inc in known else (1, i) for i, inc in enumerate(incarnations)}
        return sorted(incarnations, key=position.__getitem__)

    def _learn_world_sizes(
        self,
        connection: Connection,
        run_id: int,
        state: _RunState,
        by_incarnation: dict[str, list[dict[str, Any]]],
    ) -> None:
        """Each incarnation's expected ranks (``policies.readiness.expected_ranks``: declared in
        its run-start record, else guessed) and its watermark from the flush interval the
        run-start record states. The store is asked only about incarnations not declared yet."""
        unknown = [inc for inc in by_incarnation if inc not in state.declared]
        declared = {}
        prior = 1
        if unknown:
            started = connection.execute(
                sa.select(INCARNATION.c.incarnation, INCARNATION.c.world_size, INCARNATION.c.config).where(
                    INCARNATION.c.run_id == run_id, INCARNATION.c.incarnation.in_(unknown)
                )
            ).all()
            declared = {row.incarnation: row.world_size for row in started if row.world_size is not None}
            for row in started:
                flush_s = hook_settings.stated(row.config, "flush_s")
                if flush_s is not None:
                    state.watermark_s[row.incarnation] = self._config.readiness.watermark_for(flush_s)
            if any(inc not in declared for inc in unknown):
                prior = queries.newest_world_size(connection, run_id) or 1
        for incarnation, summaries in by_incarnation.items():
            if incarnation in state.declared:
                continue
            seen = max(s["ranks_reported"] for s in summaries)
            guessed = state.world_size.get(incarnation)
            state.world_size[incarnation] = expected_ranks(declared.get(incarnation), guessed, prior, seen)
            if incarnation in declared:
                state.declared.add(incarnation)


def default_rank_policies(config: EngineConfig) -> tuple[RankPolicy, ...]:
    return rank_policies(config.rank_nonfinite, config.rank_loss, config.stragglers)
