"""The service's core, independent of HTTP: ingest a batch, then judge what it completed."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from monitor.config import ServiceConfig
from monitor.ingest import group_commit
from monitor.ingest.admission import IngestAdmission
from monitor.ingest.batches import IngestResult, WorldSizes, ingest_batch
from monitor.ingest.group_commit import Waiting
from monitor.judge.arrivals import Arrivals
from monitor.judge.canaries import CanaryWatch
from monitor.judge.engine import PolicyEngine
from monitor.judge.fleet import FleetWatch
from monitor.judge.hangs import HangWatch
from monitor.judge.summaries import fold_new_steps
from monitor.observe.metrics.sources import MetricSources
from monitor.observe.stages import StageSpans
from monitor.observe.tracing import EVALUATE, INGEST, Tracing
from monitor.recovery import directives
from monitor.recovery.decisions import Decisions
from monitor.store import queries
from monitor.store.durability import StoreFile, StoreUnavailable
from monitor.store.leases import RunLeases
from monitor.store.locks import lock_run_writes
from monitor.store.tokens import digest_matches

log = logging.getLogger("runhealth.service")

TOKEN_TRUST_S = 1.0
"""How long a run token found in the store is trusted without reading it again. Every post
read it (a transaction, a pooled connection and a worker thread's trip of its own); a run's
ranks post many times a second together, so one read a second serves them all. A token renewed
through another replica is refused here at most this long after (through this one, at once)."""

Pending = dict[int, list[dict[str, Any]]]
"""Per rank asked about, the directives it has still to act on (``directives.pending_for_ranks``)."""


@dataclass(frozen=True)
class Asked:
    """Whose pending directives a batch's answer carries: these ranks of this incarnation."""

    incarnation: str
    ranks: tuple[int, ...]


def _pending(connection: Connection, run_id: int, asked: Asked | None) -> Pending:
    if asked is None or not asked.ranks:
        return {}
    return directives.pending_for_ranks(connection, run_id, asked.incarnation, asked.ranks)


def _pending_for_group(
    connection: Connection, run_id: int, questions: Sequence[Asked | None]
) -> list[Pending]:
    """Each question's answer, read once for all of a group's batches asking about ranks of
    one incarnation (a rank's answer depends on nothing else): one read, not one a batch."""
    wanted: dict[str, set[int]] = {}
    for asked in questions:
        if asked is not None and asked.ranks:
            wanted.setdefault(asked.incarnation, set()).update(asked.ranks)
    found = {
        incarnation: directives.pending_for_ranks(connection, run_id, incarnation, sorted(ranks))
        for incarnation, ranks in wanted.items()
    }
    return [
        {rank: found[asked.incarnation][rank] for rank in asked.ranks}
        if asked is not None and asked.ranks
        else {}
        for asked in questions
    ]


class Service:
    def __init__(
        self,
        engine: Engine,
        config: ServiceConfig,
        clock: Callable[[], float] = time.time,
        tracing: Tracing | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.clock = clock
        self.store_file = StoreFile.of(engine)
        self.policies = PolicyEngine(engine, config.engine, clock)
        self.fleet = FleetWatch(engine, config.devices, self.policies.incidents, self.policies.last_step)
        self.hangs = HangWatch(engine, config.engine.hangs, self.policies.incidents, clock)
        self.policies.add_device_evidence = self.fleet.straggler_evidence
        self.decisions = Decisions(engine, config.decisions, clock)
        self.canaries = CanaryWatch(
            engine,
            config.canaries,
            self.policies.incidents,
            clock,
            on_hardware=self.decisions.reconsider_ranks,
        )
        # One writer at a time: SQLite has one anyway, and it keeps window folding exact.
        self._write_lock = threading.Lock()
        # Batches waiting for that lock, written together by whichever thread takes it next
        # (a replica's, ``monitor.ingest.group_commit``).
        self._waiting: list[Waiting] = []
        self._waiting_lock = threading.Lock()
        self._world_sizes = WorldSizes()  # read once per incarnation, not once per batch
        # Per run, its token's digest, id and when it was read (``TOKEN_TRUST_S``); the epoch
        # counts renewals, so a read that began before one does not store the old token after it.
        self._tokens: dict[str, tuple[str, int, float]] = {}
        self._token_lock = threading.Lock()
        self._token_epoch = 0
        self.counters: Counter[tuple[str, str]] = Counter()
        self._counter_lock = threading.Lock()
        # Batches in flight, and those refused past the bound (the API answers them 429).
        self.admission = IngestAdmission(config.ingest.shedding)
        # Observability: spans (off unless configured), and what /metrics reads beyond the store
        # and this object, set by the components that own it (monitor.observe.metrics.MetricSources).
        self.tracing = tracing if tracing is not None else Tracing.off()
        self.stages = StageSpans(self.tracing, engine)
        self.metric_sources = MetricSources()
        # One of several replicas (``replicate``): it judges only the runs it holds leases on,
        # reading what any replica stored for them; ``arrived`` wakes that reading early.
        self.leases: RunLeases | None = None
        self.arrivals = Arrivals()
        self.arrived = threading.Event()

    def count(self, run: str, what: str, n: int = 1) -> None:
        with self._counter_lock:
            self.counters[(run, what)] += n

    def counter_snapshot(self) -> dict[tuple[str, str], int]:
        with self._counter_lock:
            return dict(self.counters)

    def run_id_for_token(self, run: str, token: str) -> int | None:
        """The run's id when ``token`` is its bearer token; ``None`` when it is not."""
        known = self.known_run_id(run, token)
        if known is not None:
            return known
        epoch = self._token_epoch
        with self.engine.connect() as connection:
            row = queries.run_row(connection, run)
        if not digest_matches(token, row.token_hash):
            return None
        with self._token_lock:
            if epoch == self._token_epoch:  # else a token was renewed since this read
                self._tokens[run] = (row.token_hash, int(row.id), time.monotonic())
        return int(row.id)

    def known_run_id(self, run: str, token: str) -> int | None:
        """The run's id when ``token`` was found to be its token within ``TOKEN_TRUST_S``,
        without the store; ``None`` otherwise (``run_id_for_token`` asks the store)."""
        known = self._tokens.get(run)
        if known is None or time.monotonic() - known[2] > TOKEN_TRUST_S:
            return None
        return known[1] if digest_matches(token, known[0]) else None

    def renew_token(self, run: str) -> str:
        """A new bearer token for ``run``: from now on this replica refuses the old one, and
        every other replica within ``TOKEN_TRUST_S``."""
        with self.engine.begin() as connection:
            token = queries.renew_run_token(connection, run)
        with self._token_lock:
            self._token_epoch += 1
            self._tokens.pop(run, None)
        return token

    def ingest(self, run: str, run_id: int, records: Sequence[Any]) -> IngestResult:
        return self.ingest_asking(run, run_id, records, None)[0]

    def ingest_asking(
        self, run: str, run_id: int, records: Sequence[Any], asked: Asked | None
    ) -> tuple[IngestResult, Pending]:
        """``ingest``, and what the ranks ``asked`` about have still to act on after it (their
        acknowledgements in this batch counted; empty when nothing was asked)."""
        with self.tracing.span(INGEST, {"runhealth.run": run, "runhealth.records": len(records)}) as span:
            result, pending = self._ingest(run, run_id, records, asked)
            span.set_attributes(
                {"runhealth.accepted": result.accepted, "runhealth.duplicates": result.duplicates}
            )
            self.stages.acknowledged(result.new_rows.get("directive_ack", []))
        return result, pending

    def _ingest(
        self, run: str, run_id: int, records: Sequence[Any], asked: Asked | None
    ) -> tuple[IngestResult, Pending]:
        self._check_store()
        late: list[dict[str, Any]] = []
        if self.leases is not None and self.config.ingest.group_commit and group_commit.groupable(records):
            result, pending = self._ingest_grouped(Waiting(run, run_id, records, asked))
        else:
            with self._write_lock:
                result, pending, late = self._write(run_id, records, asked)
            self.count(run, "late", len(late))
        self._check_store()  # deleted while this batch was written: it is not acknowledged
        self.count(run, "accepted", result.accepted)
        self.count(run, "duplicates", result.duplicates)
        if self.leases is not None:  # the run's judge reads the batch from the store
            self.arrived.set()
            return result, pending
        self._judge_batch(run, run_id, records, result, late)
        if asked is not None:  # after judging: the directives it issued are in the answer
            with self.engine.connect() as connection:
                pending = _pending(connection, run_id, asked)
        return result, pending

    def _write(
        self, run_id: int, records: Sequence[Any], asked: Asked | None
    ) -> tuple[IngestResult, Pending, list[dict[str, Any]]]:
        """Store one batch in its own transaction, the write lock held: what it stored, its
        directives answer on a replica, and the step records that reached windows already
        judged."""
        try:
            # A replica judges apart from its posts: nothing between this write and the answer
            # adds a directive, so the answer is read in the batch's own transaction (a
            # connection and two round trips fewer than a read after).
            result, pendings, late = self._store(
                run_id, records, [asked if self.leases is not None else None]
            )
        except sa.exc.OperationalError as exc:  # read-only, full, locked past its timeout
            raise StoreUnavailable(f"the store cannot take the batch: {exc.orig}") from exc
        return result, pendings[0], late

    def _store(
        self, run_id: int, records: Sequence[Any], questions: Sequence[Asked | None]
    ) -> tuple[IngestResult, list[Pending], list[dict[str, Any]]]:
        """``records`` (one batch, or a group's merged) in one transaction: what it stored, each
        question's directives answer, and the step records that reached windows already
        judged; then its new rows to this replica's judge."""
        with self.engine.begin() as connection:
            lock_run_writes(connection, run_id)  # another replica may be writing this run
            result = ingest_batch(
                connection,
                run_id,
                records,
                self.clock(),
                copy=self.config.ingest.copy_on_postgresql,
                inline_rows=self.config.ingest.inline_rows,
                world_sizes=self._world_sizes,
            )
            late = fold_new_steps(connection, run_id, result.new_rows.get("step", []))
            pendings = _pending_for_group(connection, run_id, questions)
        self._hand_to_judge(run_id, result)
        return result, pendings, late

    def _ingest_grouped(self, entry: Waiting) -> tuple[IngestResult, Pending]:
        """Queue the batch; whichever thread takes the write lock next writes it with every
        other batch then queued (``monitor.ingest.group_commit``). Its own answer, or its own
        error, raised here."""
        with self._waiting_lock:
            self._waiting.append(entry)
        with self._write_lock:
            if not entry.done:
                with self._waiting_lock:
                    taken, self._waiting = self._waiting, []
                for group in group_commit.groups(taken, self.config.ingest.max_batch_records):
                    self._write_group(group)
        if entry.error is not None:
            raise entry.error
        assert entry.result is not None  # written by this thread or one that took the lock first
        return entry.result, entry.pending

    def _write_group(self, group: list[Waiting]) -> None:
        """One run's queued batches in one transaction; each alone if that fails."""
        if len(group) > 1:
            try:
                self._write_merged(group)
                return
            except Exception:  # a conflict, a refused record, the store: each batch alone
                log.debug("a group of %d batches is written one by one", len(group), exc_info=True)
        for entry in group:
            try:
                entry.result, entry.pending, late = self._write(entry.run_id, entry.records, entry.asked)
                self.count(entry.run, "late", len(late))
            except Exception as exc:  # raised in the thread that posted the batch
                entry.error = exc
            entry.done = True

    def _write_merged(self, group: list[Waiting]) -> None:
        """The group as one batch in one transaction; raises whatever stops it (the caller
        then writes each batch alone, and each gets its own answer or error)."""
        first = group[0]
        result, pendings, late = self._store(
            first.run_id, group_commit.merged(group), [entry.asked for entry in group]
        )
        self.count(first.run, "late", len(late))
        self.count(first.run, "grouped_batches", len(group))
        for entry, answer, pending in zip(group, group_commit.split(result, group), pendings, strict=True):
            entry.result, entry.pending, entry.done = answer, pending, True

    def _hand_to_judge(self, run_id: int, result: IngestResult) -> None:
        """A committed batch's new rows, to this replica's judge if it judges the run (it then
        need not read them back; ``monitor.judge.arrivals``). Called with the write lock held,
        so batches are handed in the order they were committed."""
        if self.leases is None:
            return
        for kind, newest in result.newest_id.items():
            self.arrivals.written(run_id, kind, result.new_rows.get(kind, []), newest)

    def _judge_batch(
        self, run: str, run_id: int, records: Sequence[Any], result: IngestResult, late: list[dict[str, Any]]
    ) -> None:
        if any(record.kind == "run_start" for record in records):
            self.canaries.ensure_schedule(run_id)
        try:
            with self.tracing.span(EVALUATE, {"runhealth.run": run}), self.stages.following():
                self.judge(run_id, result.new_rows, late)
                if result.by_kind.get("run_start") or result.by_kind.get("run_finish"):
                    self.decisions.consider(run_id, self.policies.judge_restarts(run_id))
        except Exception:  # the records are stored; judging is retried on the next batch
            log.exception("judging run %s failed", run)
            self.count(run, "judge_errors")

    def judge(
        self, run_id: int, new_rows: dict[str, list[dict[str, Any]]], late: list[dict[str, Any]]
    ) -> None:
        """Everything a batch's new records can tell, then the decisions they call for."""
        self.policies.note_steps(run_id, new_rows.get("step", []))
        touched = self.policies.judge(run_id)
        touched += self.policies.judge_late(run_id, late)
        touched += self.policies.judge_resumes(run_id, new_rows.get("resume", []))
        touched += self.policies.judge_saves(run_id, new_rows.get("checkpoint", []))
        touched += self.fleet.observe(
            run_id, new_rows.get("device_sample", []), new_rows.get("link_sample", [])
        )
        if new_rows.get("canary_result"):
            touched += self.canaries.judge(run_id)
        self.decisions.acknowledged(run_id, new_rows.get("directive_ack", []))
        self.decisions.resumed(run_id, new_rows.get("resume", []))
        self.decisions.consider(run_id, sorted(set(touched)))
        # A checkpoint's manifest can land after the incident it could recover was decided.
        self.decisions.checkpoints_recorded(run_id, new_rows.get("checkpoint", []))

    # --- replicas ------------------------------------------------------------------------

    def replicate(self, leases: RunLeases) -> None:
        """Judge only the runs ``leases`` holds (``monitor.replicas`` takes and keeps them)."""
        self.leases = leases
        self.policies.step_ceiling = self.arrivals.step_mark

    def judged_runs(self) -> frozenset[int] | None:
        """The runs this service judges: ``None`` for all (it is the only one)."""
        return None if self.leases is None else self.leases.held()

    def take_over(self, run_id: int) -> None:
        """A lease just taken: judge the run from what the store holds now."""
        self.forget(run_id)  # state from an earlier lease is stale
        with self.engine.connect() as connection:
            self.arrivals.begin(connection, run_id)

    def forget(self, run_id: int) -> None:
        """Drop what this service keeps of a run in memory (another replica judges it)."""
        self.arrivals.forget(run_id)
        self.policies.forget(run_id)
        self.fleet.forget(run_id)
        self.hangs.forget(run_id)

    def judge_arrivals(self, run_id: int) -> None:
        """Judge what any replica stored for a run this one holds, since the last look."""
        with self.engine.connect() as connection:
            arrived = self.arrivals.read(connection, run_id)
        if arrived.started:
            self.canaries.ensure_schedule(run_id)
        with self.tracing.span(EVALUATE, {"runhealth.run_id": run_id}), self.stages.following():
            self.judge(run_id, arrived.new_rows, arrived.late)
            if arrived.started or arrived.finished:
                self.decisions.consider(run_id, self.policies.judge_restarts(run_id))

    # --- the scheduler's passes, over the runs this service judges ------------------------

    def judge_waiting(self) -> list[int]:
        """The scheduler's pass over windows that nothing newer will release (a paused or
        finished run), with the decisions they call for."""
        touched: list[int] = []
        with self.stages.following():
            for run_id in self.policies.waiting_runs(self.judged_runs()):
                judged = self.policies.judge(run_id, now=self.clock())
                self.decisions.consider(run_id, judged)
                touched += judged
        return touched

    def check_hangs(self) -> list[int]:
        """The scheduler's hang check, with spans for the incidents and directives it records."""
        with self.stages.following():
            return self.hangs.check(self.judged_runs())

    def expire_holds(self) -> list[int]:
        return self.decisions.expire_holds(self.judged_runs())

    def schedule_canaries(self) -> list[int]:
        return self.canaries.schedule_due(self.judged_runs())

    def judge_canary_rounds(self) -> list[int]:
        return self.canaries.judge_waiting(self.judged_runs())

    def compare_peers(self) -> list[int]:
        """The scheduler's device and link peer comparison, likewise traced."""
        with self.stages.following():
            return self.fleet.compare_peers()

    def healthy(self) -> dict[str, Any]:
        self._check_store()
        with self.engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
            if self.leases is None:
                return {"status": "ok"}
            runs = queries.run_names(connection, self.leases.held())
        return {"status": "ok", "replica": self.leases.replica, "judging": sorted(runs)}

    def _check_store(self) -> None:
        if self.store_file is not None:
            self.store_file.check()


__all__ = ["Asked", "Pending", "Service"]
