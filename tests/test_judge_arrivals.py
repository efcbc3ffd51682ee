"""A replica judging what another replica stored (monitor/judge/arrivals.py): every window once,
and a record stored after its window was judged judged late, once."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.config import ServiceConfig
from monitor.judge.arrivals import Arrivals
from monitor.service import Service
from monitor.store import models
from monitor.store.db import create_store_engine
from monitor.store.leases import RunLeases
from tests.support import ADMIN_TOKEN, RunHandle, both_backends, post, spiky_windows

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
