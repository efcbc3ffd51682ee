"""A replica judging what another replica stored (monitor/judge/arrivals.py): every window once,
and a record stored after its window was judged judged late, once."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.config import ServiceConfig
from monitor.judge import arrivals as arrivals_module
from monitor.judge.arrivals import Arrivals
from monitor.service import Service
from monitor.store import models
from monitor.store.db import create_store_engine
from monitor.store.leases import RunLeases
from tests.support import ADMIN_TOKEN, INCARNATION, RunHandle, both_backends, make_run, post, spiky_windows

SUMMARY = models.table_of(models.StepSummary)
FINDING = models.table_of(models.FindingRow)


def replica(store: Engine, name: str) -> Service:
    """A service that judges only through ``judge_arrivals`` (its lease is not asked here)."""
    service = Service(create_store_engine(store.url), ServiceConfig(admin_token=ADMIN_TOKEN))
    service.replicate(RunLeases(store.url, name))
    return service


def judged(store: Engine) -> int:
    with store.connect() as connection:
        return int(
            connection.execute(sa.select(sa.func.count()).where(SUMMARY.c.judged.is_(True))).scalar_one()
        )


def late_findings(store: Engine) -> list[tuple[int, int, str]]:
    with store.connect() as connection:
        rows = connection.execute(
            sa.select(FINDING.c.attempt, FINDING.c.rank, FINDING.c.kind).where(FINDING.c.rank == 2)
        )
        return [tuple(row) for row in rows]


@both_backends
def test_the_judge_judges_what_another_replica_stored_and_a_late_record_once(
    store: Engine, run: RunHandle
) -> None:
    storing, judge = replica(store, "storing"), replica(store, "judge")
    try:
        judge.take_over(run.id)
        post(storing, run, spiky_windows(range(1, 21)))
        assert judged(store) == 0  # storing is no judge
        judge.judge_arrivals(run.id)
        assert judged(store) == 20
        # A third rank's record of window 5, judged already: a NaN that only it shows.
        late = {**spiky_windows(range(5, 6))[0], "rank": 2, "loss_sum": "NaN"}
        post(storing, run, [late])
        judge.judge_arrivals(run.id)
        found = late_findings(store)
        assert found == [(5, 2, "nonfinite")]
        judge.judge_arrivals(run.id)  # nothing new: nothing judged again
        assert late_findings(store) == found
        assert storing.counter_snapshot()[(run.name, "late")] == 1
    finally:
        for service in (storing, judge):
            service.engine.dispose()


@both_backends
def test_a_look_reads_only_the_kinds_with_new_rows(store: Engine, run: RunHandle) -> None:
    """Step records alone arrived: the look asks once which kinds have new rows (and how many
    incarnations started and finished), then reads the step records and which of their windows
    were judged; not the six other kinds one statement each, nor the incarnations apart."""
    storing = replica(store, "storing")
    arrivals = Arrivals()
    with store.connect() as connection:
        arrivals.begin(connection, run.id)
    post(storing, run, spiky_windows(range(1, 4)))
    sent: list[str] = []
    sa.event.listen(store, "before_cursor_execute", lambda *args: sent.append(args[2]))
    with store.connect() as connection:
        arrived = arrivals.read(connection, run.id)
    assert sorted(arrived.new_rows) == ["step"] and len(arrived.new_rows["step"]) == 6  # 2 ranks
    assert len(sent) == 3, sent
    with store.connect() as connection:
        assert arrivals.read(connection, run.id).new_rows == {}  # nothing new: nothing read
    assert len(sent) == 3 + 1, sent[3:]  # which kinds are new, with the incarnations' counts


def _start(incarnation: str) -> dict[str, object]:
    return {"kind": "run_start", "incarnation": incarnation, "time": 990.0, "world_size": 2}


def _finish(incarnation: str) -> dict[str, object]:
    return {"kind": "run_finish", "incarnation": incarnation, "time": 2000.0, "status": "completed"}


@both_backends
def test_a_look_tells_each_start_and_finish_once(store: Engine, run: RunHandle) -> None:
    """A start, then a finish, each told by the one look after it; a finish that arrived before
    its start (a placeholder row) is a finish, not a start, until the start completes it."""
    storing = replica(store, "storing")
    arrivals = Arrivals()
    with store.connect() as connection:
        arrivals.begin(connection, run.id)

    def look() -> tuple[bool, bool]:
        with store.connect() as connection:
            arrived = arrivals.read(connection, run.id)
        return arrived.started, arrived.finished

    try:
        for records, told in [
            ([_start("a")], (True, False)),
            ([], (False, False)),
            ([_finish("a")], (False, True)),
            ([_finish("b")], (False, True)),  # its start not here yet
            ([_start("b")], (True, False)),
            ([_start("b"), _finish("b")], (False, False)),  # both again: duplicates
        ]:
            if records:
                post(storing, run, records)
            assert look() == told, records
    finally:
        storing.engine.dispose()


def _read(store: Engine, service: Service, run: RunHandle) -> tuple[list[tuple[int, int]], list[str]]:
    """One look of ``service``'s judge: the (attempt, rank) of the step records it took, and the
    statements that read step records from the store."""
    sent: list[str] = []

    def note(*args: object) -> None:
        if str(args[2]).lstrip().startswith("SELECT step_records.id"):
            sent.append(str(args[2]))

    sa.event.listen(store, "before_cursor_execute", note)
    try:
        with store.connect() as connection:
            arrived = service.arrivals.read(connection, run.id)
    finally:
        sa.event.remove(store, "before_cursor_execute", note)
    return [(row["attempt"], row["rank"]) for row in arrived.new_rows.get("step", [])], sent


def _each(attempts: range) -> list[tuple[int, int]]:
    return [(attempt, rank) for attempt in attempts for rank in range(2)]


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_judge_takes_its_own_replicas_rows_from_memory_and_reads_the_rest(
    store: Engine, run: RunHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows the judging replica stored itself are handed over, not read back; with another
    replica's batch among them, the look reads them all from the store; with one after them,
    it reads only that one. Every record once, in the order stored."""
    own, other = replica(store, "own"), replica(store, "other")
    own.take_over(run.id)
    try:
        post(own, run, spiky_windows(range(1, 4)))
        post(own, run, spiky_windows(range(4, 6)))
        assert _read(store, own, run) == (_each(range(1, 6)), [])

        post(own, run, spiky_windows(range(6, 8)))
        post(other, run, spiky_windows(range(8, 10)))
        post(own, run, spiky_windows(range(10, 12)))
        taken, reads = _read(store, own, run)
        assert taken == _each(range(6, 12)) and len(reads) == 1

        post(own, run, spiky_windows(range(12, 14)))
        post(other, run, spiky_windows(range(14, 16)))
        taken, reads = _read(store, own, run)
        assert taken == _each(range(12, 16)) and len(reads) == 1

        assert _read(store, own, run) == ([], [])
        # A judge behind by more than it keeps in memory: the rows handed are dropped, and
        # the look reads them (and those handed after) from the store.
        monkeypatch.setattr(arrivals_module, "MAX_HANDED_ROWS", 6)
        post(own, run, spiky_windows(range(16, 18)))
        post(own, run, spiky_windows(range(18, 20)))  # past 6: both dropped
        post(own, run, spiky_windows(range(20, 21)))
        taken, reads = _read(store, own, run)
        assert taken == _each(range(16, 21)) and len(reads) == 1
        # Rows handed after a look already read them from the store (committed, then read,
        # then handed) are not taken again.
        stale = [{"incarnation": INCARNATION, "attempt": 3, "rank": 0}]
        own.arrivals.written(run.id, "step", stale, own.arrivals.step_mark(run.id) or 0)
        assert _read(store, own, run) == ([], [])
    finally:
        for service in (own, other):
            service.engine.dispose()


@pytest.mark.parametrize("backend", ["postgres"])
def test_rows_taken_from_memory_are_judged_as_rows_read_from_the_store(store: Engine, run: RunHandle) -> None:
    """The same spiky windows, stored by the judge itself in one run and by another replica in
    a second: the same windows judged and the same findings."""
    judge, other = replica(store, "judge"), replica(store, "other")
    second = make_run(store, "run-b")
    try:
        for handle in (run, second):
            judge.take_over(handle.id)
        for start in range(1, 25, 4):
            post(judge, run, spiky_windows(range(start, start + 4), spike=13))
            post(other, second, spiky_windows(range(start, start + 4), spike=13))
            for handle in (run, second):
                judge.judge_arrivals(handle.id)
        with store.connect() as connection:
            found = {
                handle.id: sorted(
                    connection.execute(
                        sa.select(FINDING.c.attempt, FINDING.c.rank, FINDING.c.kind).where(
                            FINDING.c.run_id == handle.id
                        )
                    ).all()
                )
                for handle in (run, second)
            }
            windows = dict(
                connection.execute(
                    sa.select(SUMMARY.c.run_id, sa.func.count())
                    .where(SUMMARY.c.judged.is_(True))
                    .group_by(SUMMARY.c.run_id)
                ).all()
            )
        assert found[run.id] and found[run.id] == found[second.id]
        assert windows[run.id] == windows[second.id] > 18
        assert judge.arrivals.step_mark(run.id) is not None
    finally:
        for service in (judge, other):
            service.engine.dispose()


@both_backends
def test_a_window_waits_for_its_records_stored_after_the_judges_look(store: Engine, run: RunHandle) -> None:
    """The judge read window 5's first rank; the second rank's record (and two later windows,
    so the summaries say window 5 is whole) were stored before it judged. The window waits for
    the next look and is judged with both ranks, none of them late; windows not read at all
    wait too."""
    judge, other = replica(store, "judge"), replica(store, "other")
    try:
        judge.take_over(run.id)
        windows = spiky_windows(range(1, 8))
        post(judge, run, windows[:9])  # windows 1-4, and window 5's rank 0
        with store.connect() as connection:
            arrived = judge.arrivals.read(connection, run.id)
        post(other, run, windows[9:])  # window 5's rank 1, windows 6 and 7
        judge.judge(run.id, arrived.new_rows, arrived.late)
        assert judged(store) == 4
        with store.connect() as connection:
            arrived = judge.arrivals.read(connection, run.id)
        assert arrived.late == []
        judge.judge(run.id, arrived.new_rows, arrived.late)
        assert judged(store) == 7  # windows 6 and 7 too: every rank of them read
    finally:
        for service in (judge, other):
            service.engine.dispose()
