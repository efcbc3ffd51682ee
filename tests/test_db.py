"""Opening the store: where the URL comes from, SQLite's pragmas, and the refusal of SQLite
on a network filesystem."""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from monitor.store.db import (
    DEFAULT_DB_FILE,
    StoreError,
    check_local_disk,
    create_store_engine,
    filesystem_type,
    ping_when_idle,
    resolve_url,
    sqlite_path,
)
from tests.support import PostgresServer, run_cli

PG_URL = "postgresql+psycopg2://monitor@db.example:5432/runhealth"


def mounts(tmp_path: Path, *entries: tuple[str, str]) -> Path:
    """A fake /proc/self/mounts: the root on ext4, then ``(mount point, fstype)`` entries."""
    lines = ["/dev/sda1 / ext4 rw,relatime 0 0"]
    lines += [f"server:/export {point} {fstype} rw 0 0" for point, fstype in entries]
    path = tmp_path / "mounts"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_db_option_wins_over_environment(tmp_path: Path) -> None:
    url = resolve_url(str(tmp_path / "flag.db"), {"RUNHEALTH_DB": PG_URL})
    assert url.get_backend_name() == "sqlite"
    assert url.database == str(tmp_path / "flag.db")


def test_environment_wins_over_default() -> None:
    url = resolve_url(None, {"RUNHEALTH_DB": PG_URL})
    assert url.render_as_string(hide_password=False) == PG_URL


def test_default_is_a_file_in_the_working_directory() -> None:
    url = resolve_url(None, {})
    assert url.get_backend_name() == "sqlite"
    assert url.database == str(Path.cwd() / DEFAULT_DB_FILE)


def test_empty_environment_value_means_unset() -> None:
    assert resolve_url(None, {"RUNHEALTH_DB": ""}).database == str(Path.cwd() / DEFAULT_DB_FILE)


def test_bare_relative_path_is_an_absolute_sqlite_url() -> None:
    url = resolve_url("stores/run.db", {})
    assert url.drivername == "sqlite"
    assert url.database == str(Path.cwd() / "stores" / "run.db")


def test_home_is_expanded_in_a_bare_path() -> None:
    assert resolve_url("~/run.db", {}).database == str(Path.home() / "run.db")


@pytest.mark.parametrize("raw", ["postgresql://u@h:notaport/db", "://no-backend"])
def test_unparseable_url_is_a_store_error(raw: str) -> None:
    with pytest.raises(StoreError, match="not a database URL"):
        resolve_url(raw, {})


def test_sqlite_path_only_for_sqlite_files(tmp_path: Path) -> None:
    assert sqlite_path(URL.create("sqlite", database=str(tmp_path / "a.db"))) == tmp_path / "a.db"
    assert sqlite_path(URL.create("sqlite")) is None
    assert sqlite_path(URL.create("sqlite", database=":memory:")) is None
    assert sqlite_path(sa.make_url(PG_URL)) is None


def test_filesystem_type_takes_the_longest_mount_prefix(tmp_path: Path) -> None:
    table = mounts(tmp_path, ("/shared", "nfs4"), ("/shared/local", "xfs"))
    assert filesystem_type(Path("/shared/run"), table) == "nfs4"
    assert filesystem_type(Path("/shared/local/run"), table) == "xfs"
    assert filesystem_type(Path("/shared-not/run"), table) == "ext4"
    assert filesystem_type(Path("/work"), tmp_path / "absent") is None


def test_filesystem_type_reads_escaped_spaces(tmp_path: Path) -> None:
    table = mounts(tmp_path, ("/mnt/my\\040share", "cifs"))
    assert filesystem_type(Path("/mnt/my share/run"), table) == "cifs"


@pytest.mark.parametrize("fstype", ["nfs", "nfs4", "lustre"])
def test_sqlite_on_a_network_filesystem_is_refused(tmp_path: Path, fstype: str) -> None:
    shared = tmp_path / "shared"
    table = mounts(tmp_path, (str(shared), fstype))
    url = URL.create("sqlite", database=str(shared / "store" / "runhealth.db"))
    with pytest.raises(StoreError) as refused:
        create_store_engine(url, mounts_file=table)
    message = str(refused.value)
    assert fstype in message and "PostgreSQL" in message and "\n" not in message
    assert not (shared / "store").exists()


def test_sqlite_on_a_local_disk_is_accepted(tmp_path: Path) -> None:
    table = mounts(tmp_path, ("/elsewhere", "nfs"))
    check_local_disk(tmp_path / "runhealth.db", table)  # raises on refusal


def test_postgres_url_skips_the_filesystem_check(tmp_path: Path) -> None:
    table = mounts(tmp_path)
    table.write_text("server:/export / nfs4 rw 0 0\n")
    engine = create_store_engine(sa.make_url(PG_URL), mounts_file=table)
    assert engine.dialect.name == "postgresql"
    engine.dispose()


def test_sqlite_runs_in_wal_mode_with_foreign_keys(tmp_path: Path) -> None:
    engine = create_store_engine(URL.create("sqlite", database=str(tmp_path / "d" / "s.db")))
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        engine.dispose()
    assert (tmp_path / "d" / "s.db").exists()


def test_cli_store_error_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's path for a store it refuses (an NFS path raises the same StoreError)."""
    assert run_cli(["db", "upgrade", "--db", "postgresql://u@h:notaport/db"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("runhealth: error: not a database URL")


def test_a_new_sqlite_store_and_its_wal_are_readable_by_the_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "private" / "s.db"
    previous = os.umask(0o022)  # the usual umask: SQLite alone created the files 0644
    try:
        engine = create_store_engine(URL.create("sqlite", database=str(path)))
        with engine.begin() as connection:
            connection.exec_driver_sql("CREATE TABLE t (x INTEGER)")
            connection.exec_driver_sql("INSERT INTO t VALUES (1)")
            created = [p for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")) if p.exists()]
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in created}
        engine.dispose()
    finally:
        os.umask(previous)
    assert len(created) == 3 and set(modes.values()) == {0o600}, modes


def test_an_existing_store_file_keeps_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    path.touch(mode=0o640)
    path.chmod(0o640)
    create_store_engine(URL.create("sqlite", database=str(path))).dispose()
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_a_store_that_must_exist_is_not_created(tmp_path: Path) -> None:
    path = tmp_path / "typo" / "s.db"
    with pytest.raises(StoreError, match=f"^no store at {path}$"):
        create_store_engine(URL.create("sqlite", database=str(path)), must_exist=True)
    assert not path.parent.exists()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (
            "postgresql+pg8000://u@db.example/runhealth",
            "'postgresql+pg8000' (postgresql+pg8000://u@db.example/runhealth) is not installed",
        ),
        ("foo://x", "unknown database type 'foo'"),
        ("sqlite+nodriver:///x.db", "unknown database type 'sqlite+nodriver'"),
    ],
)
def test_a_driver_or_dialect_problem_is_one_store_error(
    url: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(StoreError, match=re.escape(says)):
        create_store_engine(sa.make_url(url))
    for args in (["runs", "--db", url], ["db", "upgrade", "--db", url], ["db", "current", "--db", url]):
        assert run_cli(args) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("runhealth: error: ") and captured.err.count("\n") == 1, captured.err
        assert says in captured.err and "Traceback" not in captured.err


# --- pooled connections to a database server ---------------------------------------------------


def backend_pid(engine: sa.Engine) -> int:
    with engine.connect() as connection:
        return int(connection.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())


def terminate(engine: sa.Engine, pid: int) -> None:
    """End a session from another one, as a server restart or a proxy's timeout would."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.exec_driver_sql("SELECT pg_terminate_backend(%s)", (pid,))


def test_a_connection_dropped_while_idle_is_replaced_before_use(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database()
    engine, other = sa.create_engine(url), sa.create_engine(url)
    ping_when_idle(engine, 0.05)
    try:
        dropped = backend_pid(engine)
        terminate(other, dropped)
        time.sleep(0.1)  # longer than idle_s in the pool: checked at checkout, and replaced
        assert backend_pid(engine) != dropped
    finally:
        engine.dispose()
        other.dispose()


def test_a_connection_used_a_moment_ago_is_not_checked(postgres_server: PostgresServer) -> None:
    """The trade: no round trip for a connection back in the pool under ``idle_s`` (a batch's
    every checkout under load), so one dropped in that moment fails its use once."""
    url = postgres_server.create_database()
    engine, other = sa.create_engine(url), sa.create_engine(url)
    ping_when_idle(engine, 60.0)
    try:
        terminate(other, backend_pid(engine))
        with pytest.raises(sa.exc.OperationalError), engine.connect() as connection:
            connection.exec_driver_sql("SELECT 1")
        assert backend_pid(engine) > 0  # the pool connects anew after the failure
    finally:
        engine.dispose()
        other.dispose()


def test_server_stores_check_idle_connections_and_sqlite_none(tmp_path: Path) -> None:
    postgres = create_store_engine(sa.make_url(PG_URL))
    sqlite = create_store_engine(URL.create("sqlite", database=str(tmp_path / "s.db")))
    assert postgres.pool.dispatch.checkout and not sqlite.pool.dispatch.checkout
    postgres.dispose()
    sqlite.dispose()
