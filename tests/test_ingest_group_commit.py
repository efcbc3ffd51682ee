"""Batches that wait for the store together, written as one (``monitor.ingest.group_commit``):
each batch answered as it would have been alone, and one at fault refused alone.

The grouping is made certain, not left to timing: the test holds the service's write lock
while the batches' threads queue behind it, then lets them go.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.config import IngestConfig, ServiceConfig
from monitor.ingest import group_commit
from monitor.ingest.batches import ConflictError, IngestResult, InvalidRecord
from monitor.ingest.group_commit import Waiting
from monitor.ingest.schemas import BatchIn
from monitor.recovery import directives
from monitor.service import Asked, Service
from monitor.store import models
from monitor.store.db import create_store_engine
from monitor.store.leases import RunLeases
from tests.support import ADMIN_TOKEN, INCARNATION, make_run, record_of_each_kind, step_record

WRITTEN = ("step_records", "device_samples", "heartbeats", "step_summaries")


@pytest.fixture
def backend() -> str:
    return "postgres"


def records(raw: list[dict[str, Any]]) -> list[Any]:
    return list(BatchIn.model_validate_json(json.dumps({"records": raw})).records)


@pytest.fixture
def replica(store: Engine) -> Iterator[Service]:
    service = Service(create_store_engine(store.url), ServiceConfig(admin_token=ADMIN_TOKEN))
    leases = RunLeases(store.url, "grouping")
    service.replicate(leases)
    yield service
    leases.close()
    service.engine.dispose()


def queued_together(
    service: Service, run: Any, batches: list[list[Any]], questions: list[Asked | None] | None = None
) -> tuple[list[Any], list[int]]:
    """Post ``batches`` from one thread each while the write lock is held, so that all of them
    queue; then let them go. Each batch's answer (or the exception it raised; with
    ``questions``, the answer and its directives), and the order they queued in (indexes into
    ``batches``)."""
    outcomes: list[Any] = [None] * len(batches)
    asking = questions or [None] * len(batches)

    def post(index: int) -> None:
        try:
            result, pending = service.ingest_asking(run.name, run.id, batches[index], asking[index])
            outcomes[index] = result if questions is None else (result, pending)
        except Exception as exc:
            outcomes[index] = exc

    threads = [threading.Thread(target=post, args=(index,)) for index in range(len(batches))]
    with service._write_lock:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while len(service._waiting) < len(batches):
            assert time.monotonic() < deadline, f"{len(service._waiting)} of {len(batches)} batches queued"
            time.sleep(0.01)
        order = [
            next(i for i, batch in enumerate(batches) if entry.records is batch) for entry in service._waiting
        ]
    for thread in threads:
        thread.join(timeout=60)
    return outcomes, order


def answer(outcome: Any) -> Any:
    if isinstance(outcome, IngestResult):
        return outcome.as_json()
    return type(outcome).__name__, str(outcome)


def contents(store: Engine, run_id: int) -> dict[str, list[Any]]:
    """A run's written rows without ids, run or arrival time, sorted."""
    found = {}
    with store.connect() as connection:
        for name in WRITTEN:
            table = models.Base.metadata.tables[name]
            columns = [c for c in table.columns if c.name not in ("id", "run_id", "received_at")]
            rows = connection.execute(sa.select(*columns).where(table.c.run_id == run_id))
            found[name] = sorted(repr(tuple(row)) for row in rows)
    return found


def heartbeat(rank: int, time_s: float) -> dict[str, Any]:
    return {
        "kind": "heartbeat",
        "incarnation": INCARNATION,
        "rank": rank,
        "phase": "forward",
        "phase_since": time_s - 1,
        "time": time_s,
        "node": "node-0",
    }


def sample(seq: int) -> dict[str, Any]:
    return {
        "kind": "device_sample",
        "node": "node-0",
        "device_uuid": "GPU-0",
        "seq": seq,
        "time": 1000.0 + seq,
        "power_w": 650.5,
        "counters": {"ecc": {"dbe": 0}},
    }


def hook_batches() -> list[list[Any]]:
    """What ranks post under load: each rank's steps, a heartbeat, now and then a device
    sample, and one batch re-sent whole (its records are duplicates, whichever goes first)."""
    batches = [
        records(
            [step_record(rank, attempt) for attempt in (2 * post, 2 * post + 1)]
            + [heartbeat(rank, 1000.0 + 2 * post)]
            + ([sample(post)] if rank == 0 else [])
        )
        for post in range(3)
        for rank in range(4)
    ]
    return [*batches, records([step_record(1, 2), step_record(1, 3), heartbeat(1, 1002.0)])]


def test_queued_batches_are_written_as_one_and_answered_as_one_after_another(
    store: Engine, replica: Service
) -> None:
    batches = hook_batches()
    grouped_run, alone_run = make_run(store, "grouped"), make_run(store, "alone")
    outcomes, order = queued_together(replica, grouped_run, batches)
    assert replica.counter_snapshot()[("grouped", "grouped_batches")] == len(batches)

    alone = Service(
        create_store_engine(store.url),
        ServiceConfig(admin_token=ADMIN_TOKEN, ingest=IngestConfig(group_commit=False)),
    )
    alone.replicate(RunLeases(store.url, "alone"))
    try:
        expected = {i: answer(alone.ingest_asking("alone", alone_run.id, batches[i], None)[0]) for i in order}
    finally:
        alone.engine.dispose()
    assert [answer(outcome) for outcome in outcomes] == [expected[i] for i in range(len(batches))]
    assert sum(outcome.duplicates for outcome in outcomes) == 2  # the re-sent batch's two steps
    assert contents(store, grouped_run.id) == contents(store, alone_run.id)
    assert contents(store, grouped_run.id)["step_records"]  # something was compared


def test_a_conflicting_batch_is_refused_alone_and_the_rest_are_stored(
    store: Engine, replica: Service
) -> None:
    run = make_run(store, "run-a")
    first = records([step_record(0, 0), step_record(1, 0)])
    conflicting = records([step_record(2, 0), step_record(0, 0, loss_sum=9.0)])
    last = records([step_record(0, 1), step_record(1, 1)])
    outcomes, order = queued_together(replica, run, [first, conflicting, last])
    later = 1 if order.index(1) > order.index(0) else 0  # of two batches, the second conflicts
    assert isinstance(outcomes[later], ConflictError)
    assert [answer(outcomes[i]) for i in (1 - later, 2)] == [
        {"accepted": 2, "duplicates": 0, "by_kind": {"step": 2}}
    ] * 2
    assert ("run-a", "grouped_batches") not in replica.counter_snapshot()
    with store.connect() as connection:
        table = models.table_of(models.StepRecord)
        stored = connection.execute(sa.select(sa.func.count()).where(table.c.run_id == run.id)).scalar_one()
    assert stored == 4


def test_a_refused_record_refuses_its_own_batch_only(store: Engine, replica: Service) -> None:
    run = make_run(store, "run-a")
    start = records(
        [{"kind": "run_start", "incarnation": INCARNATION, "time": 999.0, "world_size": 2, "config": {}}]
    )
    replica.ingest_asking(run.name, run.id, start, None)
    good = records([step_record(0, 0), step_record(1, 0)])
    past_world = records([step_record(5, 0)])
    outcomes, _ = queued_together(replica, run, [good, past_world])
    assert answer(outcomes[0]) == {"accepted": 2, "duplicates": 0, "by_kind": {"step": 2}}
    assert isinstance(outcomes[1], InvalidRecord) and "world size 2" in str(outcomes[1])


def test_only_the_high_volume_kinds_wait_to_be_grouped() -> None:
    assert group_commit.groupable(records([step_record(0, 0), heartbeat(0, 1.0), sample(1)]))
    assert not group_commit.groupable([])
    for other in record_of_each_kind():
        grouped = other["kind"] in ("step", "heartbeat", "device_sample", "link_sample")
        assert group_commit.groupable(records([step_record(0, 0), other])) == grouped, other["kind"]


def test_groups_keep_each_run_apart_in_queue_order_and_bounded() -> None:
    def entry(run_id: int, size: int) -> Waiting:
        return Waiting(f"run-{run_id}", run_id, [object()] * size, None)

    a1, b1, a2, a3 = entry(1, 3), entry(2, 1), entry(1, 2), entry(1, 4)
    assert list(group_commit.groups([a1, b1, a2, a3], max_records=5)) == [[a1, a2], [a3], [b1]]
    big = entry(1, 9)
    assert list(group_commit.groups([big, a1], max_records=5)) == [[big], [a1]]


def test_split_gives_each_batch_its_own_counts_in_its_kinds_order() -> None:
    first = records([heartbeat(0, 1.0), step_record(0, 0), step_record(1, 0)])
    second = records([step_record(0, 0), sample(1)])
    group = [Waiting("r", 1, first, None), Waiting("r", 1, second, None)]
    merged = IngestResult(accepted=4, duplicates=1, stored_at=[0, 1, 2, 4], duplicate_at=[3])
    one, two = group_commit.split(merged, group)
    assert one.as_json() == {"accepted": 3, "duplicates": 0, "by_kind": {"heartbeat": 1, "step": 2}}
    assert two.as_json() == {"accepted": 1, "duplicates": 1, "by_kind": {"step": 0, "device_sample": 1}}
    assert (two.stored_at, two.duplicate_at) == ([1], [0])


def test_each_batch_asking_for_its_ranks_directives_gets_them_from_one_read(
    store: Engine, replica: Service
) -> None:
    run = make_run(store, "run-a")  # with a pending dump_stacks directive for every rank
    batches = [records([step_record(rank, 0), heartbeat(rank, 1000.0)]) for rank in range(4)]
    questions: list[Asked | None] = [Asked(INCARNATION, (rank,)) for rank in range(3)] + [None]
    outcomes, _ = queued_together(replica, run, batches, questions)
    with store.connect() as connection:
        expected = [directives.pending_for(connection, run.id, INCARNATION, rank) for rank in range(3)]
    assert [expected[0][0]["id"]] == [run.directive_id]
    assert [pending for _, pending in outcomes] == [{rank: expected[rank]} for rank in range(3)] + [{}]
    assert replica.counter_snapshot()[("run-a", "grouped_batches")] == 4
