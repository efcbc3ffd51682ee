"""The locks that let several replicas write one PostgreSQL: one run's writes, one audit chain."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.judge.incidents import INCIDENT, IncidentRecorder
from monitor.store import audit
from monitor.store.locks import lock_run_writes
from policies.incidents import GroupingConfig
from policies.types import Finding, Severity
from tests.support import both_backends, make_run


@pytest.fixture
def backend() -> str:
    return "postgres"


def test_writers_of_one_run_take_turns_and_of_another_run_do_not_wait(store: Engine) -> None:
    order: list[str] = []
    holding = threading.Event()

    def second_writer(run_id: int) -> None:
        with store.begin() as connection:
            lock_run_writes(connection, run_id)
            order.append(f"second took run {run_id}")

    with store.begin() as connection:
        lock_run_writes(connection, 1)
        holding.set()
        other_run = threading.Thread(target=second_writer, args=(2,))
        other_run.start()
        other_run.join(30)
        same_run = threading.Thread(target=second_writer, args=(1,))
        same_run.start()
        time.sleep(0.5)  # time enough to take it, were it free
        order.append("first commits run 1")
    same_run.join(30)
    assert order == ["second took run 2", "first commits run 1", "second took run 1"]


@both_backends
def test_concurrent_appends_from_many_connections_make_one_chain(store: Engine) -> None:
    writers, each = 4, 25
    errors: list[BaseException] = []

    def append_some(writer: int) -> None:
        try:
            for n in range(each):
                with store.begin() as connection:
                    audit.append(
                        connection, actor=f"writer-{writer}", action="test", subject=f"n:{n}", now=float(n)
                    )
        except BaseException as exc:  # reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=append_some, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    with store.connect() as connection:
        checked = audit.verify(connection)
        seqs = list(connection.execute(sa.select(audit.AUDIT.c.seq).order_by(audit.AUDIT.c.seq)).scalars())
    assert checked.ok and checked.entries == writers * each, checked
    assert seqs == list(range(1, writers * each + 1))


def test_a_finding_recorded_while_another_replica_records_one_joins_its_incident(store: Engine) -> None:
    """Two judges of one run for a moment: the second waits for the first's incident and joins
    it (without the lock it read no open incident and opened a second)."""
    run = make_run(store, "two-judges")
    recorder = IncidentRecorder(GroupingConfig(), lambda: 1.0)
    finding = Finding(
        step=5, kind="nonfinite", severity=Severity.CRITICAL, signal="loss", value=float("nan"),
        threshold=None, message="loss is nan at step 5", incarnation="inc", rank=0,
    )  # fmt: skip
    done = threading.Event()

    def second_judge() -> None:
        with store.begin() as connection:
            recorder.record(connection, run.id, [finding], 5)
        done.set()

    with store.begin() as connection:
        recorder.record(connection, run.id, [finding], 5)
        other = threading.Thread(target=second_judge)
        other.start()
        assert not done.wait(0.5)  # waits for the first to commit
    other.join(30)
    assert done.is_set()
    with store.connect() as connection:
        incidents = connection.execute(sa.select(INCIDENT.c.finding_count)).scalars().all()
    assert incidents == [2]
