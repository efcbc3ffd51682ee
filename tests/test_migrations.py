"""The Alembic history: every revision up, down to base and up again, on SQLite and
PostgreSQL, and the models agreeing with what the migrations build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, Engine

from monitor.ingest.batches import ConflictError, content_hash, ingest_batch
from monitor.ingest.schemas import BatchIn
from monitor.store import migrate, models, partitions
from monitor.store.db import create_store_engine
from monitor.store.models import Base
from monitor.store.partitions import is_partition
from policies.checkpoints import manifest_digest
from tests.support import both_backends, require_binary, run_cli, step_record

IncludeObject = Callable[[Any, str | None, str, bool, Any], bool]


def script_directory() -> ScriptDirectory:
    return ScriptDirectory.from_config(migrate.alembic_config())


def revisions_oldest_first() -> list[str]:
    return [rev.revision for rev in reversed(list(script_directory().walk_revisions()))]


def env_include_object(connection: sa.Connection) -> IncludeObject:
    """The ``include_object`` that ``migrations/env.py`` configures, read from a run of it
    that applies no step."""
    config = migrate.alembic_config(connection)
    script = ScriptDirectory.from_config(config)
    options: dict[str, Any] = {}

    def no_steps(_revision: Any, context: MigrationContext) -> list[Any]:
        options.update(context.opts)
        return []

    with EnvironmentContext(config, script, fn=no_steps):
        script.run_env()
    include_object: IncludeObject = options["include_object"]
    return include_object


def schema_differences(engine: Engine) -> list[Any]:
    with engine.connect() as connection:
        context = MigrationContext.configure(
            connection,
            opts={"compare_type": True, "include_object": env_include_object(connection)},
        )
        return list(compare_metadata(context, Base.metadata))


def our_tables(engine: Engine) -> set[str]:
    """The tables, a partitioned table's partitions aside (PostgreSQL lists them as tables)."""
    names = set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    return {name for name in names if not is_partition(name)}


def test_history_is_one_line_from_base_to_head() -> None:
    script = script_directory()
    revisions = revisions_oldest_first()
    assert script.get_heads() == [revisions[-1]]
    previous = None
    for revision in revisions:
        assert script.get_revision(revision).down_revision == previous
        previous = revision


def test_env_excludes_only_foreign_tables() -> None:
    engine = create_store_engine(URL.create("sqlite"))
    with engine.connect() as connection:
        include_object = env_include_object(connection)
    engine.dispose()
    assert include_object(None, "apscheduler_jobs", "table", True, None) is False
    assert include_object(None, "step_records", "table", True, None) is True


@both_backends
def test_every_revision_up_down_and_up_again(empty_store: Engine) -> None:
    revisions = revisions_oldest_first()
    for revision in revisions:
        migrate.upgrade(empty_store, revision)
        assert migrate.current_revision(empty_store) == revision
    assert schema_differences(empty_store) == []
    for previous in reversed([None, *revisions[:-1]]):
        migrate.downgrade(empty_store, previous or "base")
        assert migrate.current_revision(empty_store) == previous
    assert our_tables(empty_store) == set()
    migrate.upgrade(empty_store)
    assert migrate.is_current(empty_store)
    assert schema_differences(empty_store) == []


@both_backends
def test_head_builds_every_model_table(store: Engine) -> None:
    assert our_tables(store) == set(Base.metadata.tables)


def test_schema_comparison_sees_a_missing_table(store: Engine) -> None:
    """The agreement check above can fail: drop a table and it must say so."""
    with store.begin() as connection:
        connection.execute(sa.text("DROP TABLE heartbeats"))
    differences = schema_differences(store)
    assert [(d[0], d[1].name) for d in differences] == [("add_table", "heartbeats")]


def test_cli_db_upgrade_creates_a_store_from_scratch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "new" / "runhealth.db"
    assert run_cli(["db", "upgrade", "--db", str(path)]) == 0
    assert capsys.readouterr().out.strip() == f"store at revision {migrate.head_revision()}"
    engine = create_store_engine(URL.create("sqlite", database=str(path)))
    try:
        assert migrate.is_current(engine)
        assert schema_differences(engine) == []
    finally:
        engine.dispose()


def test_installed_console_script_upgrades_from_another_directory(tmp_path: Path) -> None:
    runhealth = Path(sys.executable).parent / "runhealth"
    if not runhealth.exists():
        runhealth = require_binary("runhealth")
    environ = {name: value for name, value in os.environ.items() if name != "RUNHEALTH_DB"}
    done = subprocess.run(
        [str(runhealth), "db", "upgrade", "--db", "store.db"],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    engine = create_store_engine(URL.create("sqlite", database=str(tmp_path / "store.db")))
    try:
        assert migrate.is_current(engine)
    finally:
        engine.dispose()


CONTENT_KEYS = "0007"  # checkpoints keyed by content (migrations/versions/0007_checkpoint_versions.py)


@both_backends
def test_stored_checkpoints_get_their_digest_and_a_path_may_then_hold_versions(empty_store: Engine) -> None:
    """A checkpoint stored under the path key gets the digest the service derives, so its record
    re-sent after the upgrade is still a duplicate; the same path may then hold another version.
    Down again, only the newest version at each path stays."""
    previous = script_directory().get_revision(CONTENT_KEYS).down_revision
    assert isinstance(previous, str)
    migrate.upgrade(empty_store, previous)
    manifest = {"step": 5, "consumed": 40, "files": [{"path": ".", "size": 3, "sha256": "a" * 64}]}
    row = {"run_id": 1, "incarnation": "i", "rank": 0, "step": 5, "path": "/c.pt", "time": 1.0,
           "received_at": 1.0, "content_hash": "h", "manifest": json.dumps(manifest)}  # fmt: skip
    with empty_store.begin() as connection:
        connection.execute(
            sa.text("INSERT INTO runs (id, name, token_hash, created_at) VALUES (1, 'r', 't', 0)")
        )
        insert = sa.text(
            "INSERT INTO checkpoint_events (run_id, incarnation, rank, step, path, time, received_at, "
            "content_hash, manifest) VALUES (:run_id, :incarnation, :rank, :step, :path, :time, "
            ":received_at, :content_hash, :manifest)"
        )
        connection.execute(insert, row)
    migrate.upgrade(empty_store, CONTENT_KEYS)
    with empty_store.begin() as connection:
        digest = connection.execute(sa.text("SELECT manifest_digest FROM checkpoint_events")).scalar_one()
        assert digest == manifest_digest(manifest)
        connection.execute(
            sa.text(
                "INSERT INTO checkpoint_events (run_id, incarnation, rank, step, path, time, received_at, "
                "content_hash, manifest_digest) VALUES (1, 'i', 0, 9, '/c.pt', 2.0, 2.0, 'h', '')"
            )
        )
    migrate.downgrade(empty_store, previous)
    with empty_store.connect() as connection:
        steps = connection.execute(sa.text("SELECT step FROM checkpoint_events")).scalars().all()
    assert steps == [9]


@both_backends
def test_time_partitions_keep_the_rows_and_their_keys(empty_store: Engine, backend: str) -> None:
    """A store with records upgraded to partitions keeps every row, its id and the id sequence;
    the records re-sent after it are duplicates and a conflict is still refused. Down again,
    the rows are still there."""
    migrate.upgrade(empty_store, "0010")
    now = time.time()
    times = [1000.0, now - 20 * 86400, now - 86400, now, now + 5 * 86400]  # 1970, old, ..., ahead
    records = [step_record(attempt=i, time=t) for i, t in enumerate(times)]
    run = make_run_at_revision(empty_store)
    with empty_store.begin() as connection:  # as ingest stored them before (its key had no time)
        connection.execute(models.table_of(models.StepRecord).insert(), [stored_row(r, now) for r in records])
    before = rows_of(empty_store)
    migrate.upgrade(empty_store)  # through 0011
    assert rows_of(empty_store) == before
    assert schema_differences(empty_store) == []
    with empty_store.begin() as connection:
        again = ingest_batch(connection, run, parse(records), now)
        assert (again.accepted, again.duplicates) == (0, len(records))
        with pytest.raises(ConflictError):
            ingest_batch(connection, run, parse([step_record(attempt=3, time=now, loss_sum=1.0)]), now)
    with empty_store.begin() as connection:
        newer = ingest_batch(connection, run, parse([step_record(attempt=9, time=now)]), now)
        assert newer.accepted == 1
        ids = connection.execute(sa.text("SELECT id FROM step_records ORDER BY id")).scalars().all()
    # The id sequence went on (PostgreSQL's ON CONFLICT spends values on duplicates too).
    assert ids[:-1] == list(range(1, len(records) + 1)) and ids[-1] > len(records)
    if backend == "postgres":
        with empty_store.connect() as connection:
            names = {p.name: p for p in partitions.partitions(connection, "step_records")}
            query = sa.text("SELECT attempt, tableoid::regclass::text FROM step_records")
            placed = {row[0]: row[1] for row in connection.execute(query)}
        days = [partitions.day_of(t) for t in times]
        assert placed[0] == "step_records_default"  # 1970: before the earliest day given a partition
        for attempt in (1, 2, 3, 4):
            assert placed[attempt] == partitions.partition_name("step_records", days[attempt])
        today = partitions.day_of(now)
        for offset in range(4):
            assert partitions.partition_name("step_records", today + timedelta(days=offset)) in names
    migrate.downgrade(empty_store, "0010")
    assert len(rows_of(empty_store)) == len(records) + 1


def make_run_at_revision(engine: Engine) -> int:
    with engine.begin() as connection:
        connection.execute(
            sa.text("INSERT INTO runs (id, name, token_hash, created_at) VALUES (1, 'r', 't', 0)")
        )
    return 1


def stored_row(record: dict[str, Any], now: float) -> dict[str, Any]:
    [parsed] = parse([record])
    row = parsed.model_dump(exclude={"kind"})
    return {**row, "run_id": 1, "received_at": now, "content_hash": content_hash(row, has_dicts=False)}


def parse(records: list[dict[str, Any]]) -> list[Any]:
    return list(BatchIn.model_validate({"records": records}).records)


def rows_of(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as connection:
        return [
            tuple(row)
            for row in connection.execute(
                sa.text("SELECT id, run_id, rank, attempt, time, content_hash FROM step_records ORDER BY id")
            )
        ]
