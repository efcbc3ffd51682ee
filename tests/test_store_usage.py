"""``runhealth db usage`` (``monitor.store.usage``): rows and bytes per table and what retention
drops next, on a real PostgreSQL and SQLite."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from monitor.cli.render import fmt_time
from monitor.service import Service
from monitor.store import partitions
from monitor.store.models import Base
from monitor.store.retention import RetentionConfig
from monitor.store.usage import usage
from tests.support import RunHandle, both_backends, cli_result, post, step_record

DAY = partitions.DAY_S


@dataclass(frozen=True)
class Filled:
    now: float
    next_name: str
    """What the older day goes under: its partition, or ``rows`` on SQLite."""


@pytest.fixture
def filled(store: Engine, service: Service, run: RunHandle, backend: str) -> Filled:
    """Steps of two days, the older one 20 days back."""
    now = time.time()
    old_day = partitions.day_of(now - 20 * DAY)
    if backend == "postgres":
        with store.begin() as connection:
            partitions.create_day(connection, "step_records", old_day)
    start = partitions.day_bounds(old_day)[0]
    post(service, run, [step_record(rank, a, time=start + a) for a in range(30) for rank in (0, 1)])
    post(service, run, [step_record(rank, a, time=now) for a in range(30, 40) for rank in (0, 1)])
    if backend == "postgres":
        with store.begin() as connection:
            connection.execute(sa.text("ANALYZE"))
    return Filled(
        now, partitions.partition_name("step_records", old_day) if backend == "postgres" else "rows"
    )


def as_cli_db(store_url: URL) -> str:
    return store_url.render_as_string(hide_password=False)


@both_backends
def test_usage_json_lists_every_table_and_the_next_drop(
    filled: Filled, store_url: URL, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    now, next_name = filled.now, filled.next_name
    code, out, err = cli_result(capsys, "db", "usage", "--db", as_cli_db(store_url), "--json")
    assert code == 0, err
    document = json.loads(out)
    assert set(document) == {"backend", "retention_days", "tables", "total_bytes", "next_drops"}
    assert document["backend"] == ("postgresql" if backend == "postgres" else "sqlite")
    assert document["retention_days"] == 14.0
    tables = {t["table"]: t for t in document["tables"]}
    assert set(tables) == set(Base.metadata.tables)
    assert set(tables["step_records"]) == {"table", "rows", "rows_estimated", "bytes", "partitions"}
    assert tables["step_records"]["rows"] == 80
    assert tables["step_summaries"]["rows"] == 40
    assert all(t["bytes"] > 0 for t in tables.values())
    assert sum(t["bytes"] for t in tables.values()) <= document["total_bytes"]
    [step_drop] = [d for d in document["next_drops"] if d["table"] == "step_records"]
    old_day = partitions.day_of(now - 20 * DAY)
    start, end = partitions.day_bounds(old_day)
    assert step_drop["partition"] == (None if next_name == "rows" else next_name)
    assert step_drop["end"] == end
    assert step_drop["due_at"] == end + 14 * DAY
    assert step_drop["rows"] == 60
    assert step_drop["bytes"] > 0
    if backend == "postgres":
        assert step_drop["start"] == start
        today = partitions.day_of(now)
        assert tables["step_records"]["partitions"] == 5  # the old day, today and 3 ahead
        assert partitions.partition_name("step_records", today + timedelta(days=3))
    else:
        assert step_drop["start"] == start  # the oldest record, at the day's first second
        assert tables["step_records"]["partitions"] is None


@both_backends
def test_usage_table_names_the_next_drop_and_when(
    filled: Filled, store_url: URL, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    next_name = filled.next_name
    code, out, err = cli_result(capsys, "db", "usage", "--db", as_cli_db(store_url))
    assert code == 0, err
    assert "step_records" in out and "step_summaries" in out
    assert "retention drops next (raw records kept 14 days)" in out
    line = [line for line in out.splitlines() if line.startswith("│ step_records ")][-1]  # the drops
    assert next_name in line
    assert "at the next pass" in line  # 20 days old: past the period already
    assert "60" in line


@both_backends
def test_usage_of_an_empty_store(
    store: Engine, store_url: URL, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """SQLite: nothing to drop. PostgreSQL: today's empty partition goes first, 14 days after
    its day ends."""
    code, out, _ = cli_result(capsys, "db", "usage", "--db", as_cli_db(store_url))
    assert code == 0
    if backend == "sqlite":
        assert "retention: no raw records yet (kept 14 days)" in out
        return
    today = partitions.day_of(time.time())
    due = fmt_time(partitions.day_bounds(today)[1] + 14 * DAY)
    line = [line for line in out.splitlines() if line.startswith("│ step_records ")][-1]
    assert partitions.partition_name("step_records", today) in line and due in line


def test_a_period_of_zero_keeps_everything(store: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    with store.connect() as connection:
        assert usage(connection, RetentionConfig(raw_days=0)).next_drops == []


def test_usage_of_a_missing_store_is_one_line(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli_result(capsys, "db", "usage", "--db", f"{tmp_path}/nothing.db")
    assert code == 2
    assert err.strip().count("\n") == 0 and "no store at" in err
