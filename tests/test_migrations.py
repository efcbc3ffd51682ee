"""The Alembic history: every revision up, down to base and up again, on SQLite and
PostgreSQL, and the models agreeing with what the migrations build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, Engine

from monitor.store import migrate
from monitor.store.db import create_store_engine
from monitor.store.models import Base
from policies.checkpoints import manifest_digest
from tests.support import both_backends, require_binary, run_cli

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
    return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}


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
