"""Retention of raw records (``monitor.store.retention``) and the day partitions it drops
(``monitor.store.partitions``), on a real PostgreSQL and SQLite."""

from __future__ import annotations

import threading
import time
from datetime import date, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.config import ServiceConfig
from monitor.errors import ConfigError
from monitor.scheduler import start_scheduler
from monitor.service import Service
from monitor.settings import service_config
from monitor.store import partitions
from monitor.store.retention import RetentionConfig, maintain
from tests.support import RunHandle, post, step_record

DAY = partitions.DAY_S
postgres_only = pytest.mark.parametrize("backend", ["postgres"])
sqlite_only = pytest.mark.parametrize("backend", ["sqlite"])


def day_start(day: date) -> float:
    return partitions.day_bounds(day)[0]


def attempts_stored(store: Engine, table: str = "step_records") -> set[int]:
    with store.connect() as connection:
        return set(connection.execute(sa.text(f"SELECT attempt FROM {table}")).scalars())


def summaries_stored(store: Engine) -> set[int]:
    with store.connect() as connection:
        return set(connection.execute(sa.text("SELECT attempt FROM step_summaries")).scalars())


def heartbeat(rank: int, at: float) -> dict[str, Any]:
    return {"kind": "heartbeat", "incarnation": step_record()["incarnation"], "rank": rank,
            "phase": "forward", "phase_since": at, "time": at}  # fmt: skip


def test_config_defaults_and_checks() -> None:
    config = RetentionConfig()
    assert (config.raw_days, config.partitions_ahead_days) == (14.0, 3)
    assert config.cutoff(100 * DAY) == 86 * DAY
    for bad in ({"raw_days": -1}, {"batch_rows": 0}, {"check_s": 0}, {"lock_timeout_s": 0}):
        with pytest.raises(ConfigError):
            RetentionConfig(**bad)


def test_the_period_is_a_setting() -> None:
    config = service_config({"RUNHEALTH_RETENTION__RAW_DAYS": "30", "RUNHEALTH_RETENTION__CHECK_S": "60"})
    assert (config.retention.raw_days, config.retention.check_s) == (30.0, 60.0)
    with pytest.raises(ConfigError):
        service_config({"RUNHEALTH_RETENTION__RAW_DAYS": "-2"})


def test_partition_names() -> None:
    assert partitions.partition_name("step_records", date(2026, 12, 3)) == "step_records_p20261203"
    assert partitions.is_partition("step_records_p20261203")
    assert partitions.is_partition("link_samples_default")
    assert not partitions.is_partition("step_records")
    assert not partitions.is_partition("step_summaries_p20261203")
    assert partitions.day_bounds(date(1970, 1, 2)) == (DAY, 2 * DAY)
    assert partitions.day_of(DAY - 0.001) == date(1970, 1, 1)


@postgres_only
def test_days_ahead_are_created_once_and_strays_move_into_their_day(
    store: Engine, service: Service, run: RunHandle
) -> None:
    now = time.time()
    today = partitions.day_of(now)
    with store.connect() as connection:
        names = {p.name for p in partitions.partitions(connection, "device_samples")}
    for offset in range(4):  # made by the migration
        assert partitions.partition_name("device_samples", today + timedelta(days=offset)) in names
    later = today + timedelta(days=6)
    post(service, run, [step_record(attempt=1, time=day_start(later) + 5)])  # past the days ahead
    with store.connect() as connection:
        where = connection.execute(sa.text("SELECT tableoid::regclass::text FROM step_records")).scalar()
    assert where == "step_records_default"
    done = maintain(store, RetentionConfig(), day_start(later) - 3 * DAY)
    assert done.created == [
        partitions.partition_name(table, today + timedelta(days=offset))
        for table in ("step_records", "device_samples", "link_samples")
        for offset in (4, 5, 6)
    ]
    with store.connect() as connection:
        where = connection.execute(sa.text("SELECT tableoid::regclass::text FROM step_records")).scalar()
    assert where == partitions.partition_name("step_records", later)
    assert maintain(store, RetentionConfig(), day_start(later) - 3 * DAY).created == []
    post(service, run, [step_record(attempt=1, time=day_start(later) + 5)])  # still a duplicate
    assert attempts_stored(store) == {1}


@postgres_only
def test_a_day_is_dropped_while_ingest_goes_on(store: Engine, service: Service, run: RunHandle) -> None:
    """Retention drops the day past the period as one table while another thread keeps
    ingesting: every batch is accepted, and nothing but that day's raw records goes."""
    now = time.time()
    old_day, kept_day = partitions.day_of(now - 20 * DAY), partitions.day_of(now - 10 * DAY)
    with store.begin() as connection:
        for day in (old_day, kept_day):
            assert partitions.create_day(connection, "step_records", day)
    old = [
        step_record(rank, attempt, time=day_start(old_day) + attempt)
        for attempt in range(50)
        for rank in (0, 1)
    ]
    kept = [step_record(rank, attempt, time=day_start(kept_day) + attempt) for attempt in range(50, 100) for rank in (0, 1)]  # fmt: skip
    post(service, run, old + kept)

    fed: list[int] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def feed() -> None:
        attempt = 1000
        try:
            while not stop.is_set():
                post(service, run, [step_record(rank, attempt, time=time.time()) for rank in (0, 1)])
                fed.append(attempt)
                attempt += 1
        except BaseException as exc:  # the assertion below names it
            failures.append(exc)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        wait_for(lambda: len(fed) >= 20 or bool(failures), "ingest to get going")
        done = maintain(store, RetentionConfig(), now)
        during = len(fed)
        wait_for(lambda: len(fed) >= during + 20 or bool(failures), "ingest to go on after the drop")
    finally:
        stop.set()
        feeder.join(timeout=60)
    assert not failures, failures
    assert [p.name for p in done.dropped] == [partitions.partition_name("step_records", old_day)]
    assert done.deferred == []
    assert attempts_stored(store) == set(range(50, 100)) | set(fed)
    with store.connect() as connection:
        assert connection.execute(sa.text("SELECT count(*) FROM step_records")).scalar() == 2 * (
            50 + len(fed)
        )
        left = {p.name for p in partitions.partitions(connection, "step_records")}
    assert partitions.partition_name("step_records", old_day) not in left
    assert partitions.partition_name("step_records", kept_day) in left
    assert set(range(50)) <= summaries_stored(store)  # per-window summaries are kept


@postgres_only
def test_a_drop_that_waits_for_a_long_reader_is_left_for_the_next_pass(
    store: Engine, service: Service, run: RunHandle
) -> None:
    now = time.time()
    old_day = partitions.day_of(now - 30 * DAY)
    with store.begin() as connection:
        partitions.create_day(connection, "step_records", old_day)
    post(service, run, [step_record(attempt=1, time=day_start(old_day) + 1)])
    config = RetentionConfig(lock_timeout_s=0.2)
    with store.connect() as reader:
        reader.execute(sa.text("SELECT count(*) FROM step_records"))  # holds its lock until the end
        done = maintain(store, config, now)
        assert done.deferred == [partitions.partition_name("step_records", old_day)]
        post(service, run, [step_record(attempt=2, time=now)])  # ingest does not queue behind it
        reader.rollback()
    assert [p.name for p in maintain(store, config, now).dropped] == done.deferred
    assert attempts_stored(store) == {2}


@postgres_only
def test_strays_in_the_default_partition_and_old_heartbeats_go_row_by_row(
    store: Engine, service: Service, run: RunHandle
) -> None:
    now = time.time()
    records = [step_record(attempt=a, time=1000.0 + a) for a in range(12)] + [
        step_record(attempt=20, time=now)
    ]
    post(service, run, [*records, heartbeat(0, now - 40 * DAY), heartbeat(1, now)])
    done = maintain(store, RetentionConfig(batch_rows=5), now)
    assert done.deleted == {"step_records_default": 12, "heartbeats": 1}
    assert attempts_stored(store) == {20}
    with store.connect() as connection:
        assert connection.execute(sa.text("SELECT rank FROM heartbeats")).scalars().all() == [1]


@sqlite_only
def test_sqlite_deletes_old_rows_in_batches_and_keeps_the_rest(
    store: Engine, service: Service, run: RunHandle
) -> None:
    now = time.time()
    old = [step_record(attempt=a, time=now - 20 * DAY + a) for a in range(23)]
    new = [step_record(attempt=a, time=now - 13 * DAY + a) for a in range(23, 30)]
    post(service, run, old + new + [heartbeat(0, now - 15 * DAY), heartbeat(1, now)])
    done = maintain(store, RetentionConfig(batch_rows=4), now)
    assert done.created == [] and done.dropped == []
    assert done.deleted == {"step_records": 23, "heartbeats": 1}
    assert attempts_stored(store) == set(range(23, 30))
    assert summaries_stored(store) == set(range(30))
    assert maintain(store, RetentionConfig(raw_days=0), now + 100 * DAY).deleted == {}  # kept for ever


def wait_for(condition: Any, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@postgres_only
def test_the_service_makes_the_days_ahead_when_it_starts(
    store: Engine, service_config: ServiceConfig
) -> None:
    """A service started long after the last pass (its clock 30 days on) makes its days at once,
    and schedules the hourly pass."""
    later = time.time() + 30 * DAY
    service = Service(store, service_config, clock=lambda: later)
    scheduler = start_scheduler(service, service_config.scheduler)
    try:
        with store.connect() as connection:
            names = {p.name for p in partitions.partitions(connection, "link_samples")}
        for offset in range(4):
            assert (
                partitions.partition_name("link_samples", partitions.day_of(later) + timedelta(days=offset))
                in names
            )
        assert scheduler.get_job("store_retention").trigger.interval.total_seconds() == 3600
    finally:
        scheduler.shutdown(wait=True)
