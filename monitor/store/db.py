"""Opening the store: URL resolution, SQLite pragmas, and the network-filesystem guard."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine, make_url

from policies.protocol import to_wire

DEFAULT_DB_FILE = "runhealth.db"

# Filesystems on which SQLite's POSIX locking is unsafe (SQLite FAQ, "Can multiple
# applications access the same database file?"): NFS, Lustre and other network or cluster
# filesystems.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "cifs",
        "smb3",
        "smbfs",
        "gpfs",
        "beegfs",
        "ceph",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.sshfs",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.juicefs",
        "9p",
        "afs",
        "orangefs",
        "panfs",
        "wekafs",
    }
)


class StoreError(Exception):
    """A store that cannot be opened as asked; the message says why and what to do."""


def resolve_url(db: str | None, environ: Mapping[str, str]) -> URL:
    """``--db`` wins over ``RUNHEALTH_DB``; a bare path means an SQLite file."""
    raw = db or environ.get("RUNHEALTH_DB") or DEFAULT_DB_FILE
    if "://" not in raw:
        raw = f"sqlite:///{Path(raw).expanduser().absolute()}"
    try:
        return make_url(raw)
    except (sa.exc.ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number
        raise StoreError(f"not a database URL or path: {raw!r}") from exc


def sqlite_path(url: URL) -> Path | None:
    """The file behind an SQLite URL, or ``None`` for memory or another backend."""
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database).expanduser().absolute()


def filesystem_type(path: Path, mounts_file: Path = Path("/proc/self/mounts")) -> str | None:
    """The filesystem type of the mount that holds ``path`` (longest mount-point prefix)."""
    try:
        lines = mounts_file.read_text().splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    best, best_type = "", None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount_point = parts[1].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, parts[2]
    return best_type


def check_local_disk(path: Path, mounts_file: Path = Path("/proc/self/mounts")) -> None:
    fstype = filesystem_type(path.parent, mounts_file)
    if fstype is not None and (fstype in NETWORK_FILESYSTEMS or fstype.startswith("nfs")):
        raise StoreError(
            f"refusing SQLite on {path}: it is on a {fstype} filesystem, where SQLite's "
            "locking is unsafe. Put the file on a local disk, or use PostgreSQL "
            "(RUNHEALTH_DB=postgresql://...)."
        )


def _json_serializer(obj: Any) -> str:
    return orjson.dumps(to_wire(obj)).decode()


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets the CLI and Prometheus scrapes read while the ingest path writes.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()


def _sqlite_savepoint(connection: Any, _name: str) -> None:
    """Begin the transaction before its first savepoint. pysqlite begins one only at the first
    write, so a SAVEPOINT issued before any write opened a transaction of its own, and its
    RELEASE committed: a batch's step records were committed before a later record of the same
    batch was refused (409), and stayed without their summaries. Reads still run outside a
    transaction until the first write, as the driver does: concurrent writers that read first
    then see each other's commits instead of failing on a stale snapshot."""
    if not connection.connection.dbapi_connection.in_transaction:
        connection.exec_driver_sql("BEGIN")


def create_store_engine(
    url: URL,
    *,
    mounts_file: Path = Path("/proc/self/mounts"),
    create_dir: bool = True,
    must_exist: bool = False,
) -> Engine:
    """An engine on the store at ``url``. A new SQLite file is created here, mode 0600 (its
    ``-wal`` and ``-shm`` files take the same mode from it), unless ``must_exist``: then a
    missing file is a ``StoreError`` and nothing is created. A dialect this SQLAlchemy does not
    know, or a driver that is not installed, is a ``StoreError`` too."""
    path = sqlite_path(url)
    if path is not None:
        check_local_disk(path, mounts_file)
        if must_exist and not path.exists():
            raise StoreError(f"no store at {path}")
        if create_dir:
            path.parent.mkdir(parents=True, exist_ok=True)
        _create_private_file(path)
    engine = _engine_for(url)
    if url.get_backend_name() == "sqlite":
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        sa.event.listen(engine, "savepoint", _sqlite_savepoint)
    else:
        ping_when_idle(engine, PING_IDLE_S)
    return engine


PING_IDLE_S = 1.0
"""A pooled connection to a database server is checked (``SELECT 1``) before use only when it
has lain in the pool this long. SQLAlchemy's ``pool_pre_ping`` checked it at every checkout,
a round trip each: two or three of a one-rank batch's (its token, its write, its directives),
about 0.5 ms of the service's CPU and 0.3 ms of PostgreSQL's a batch (load 6-8). A connection
the server dropped while idle (a restart, a proxy's idle timeout) is still found and replaced
before use; one dropped within a second of its last use fails that request (a batch: 503, sent
again by the hook) and SQLAlchemy replaces the pool's connections."""


def ping_when_idle(engine: Engine, idle_s: float) -> None:
    """Check a connection at checkout when it lay unused in the pool ``idle_s`` or more; a failed
    check discards it, and the pool connects anew (``DisconnectionError``)."""

    def returned(_dbapi_connection: Any, record: Any) -> None:
        record.info["runhealth_returned_at"] = time.monotonic()

    def taken(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("runhealth_returned_at")
        if since is None or time.monotonic() - since < idle_s:
            return  # just connected, or used a moment ago
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as exc:
            raise sa.exc.DisconnectionError(f"a pooled connection failed its check: {exc}") from exc

    sa.event.listen(engine, "checkin", returned)
    sa.event.listen(engine, "checkout", taken)


def _create_private_file(path: Path) -> None:
    """The store's file, empty and readable by its owner only, before SQLite opens it (SQLite
    would create it with the umask's mode, usually world-readable, tokens' digests and all)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    except FileNotFoundError:
        pass  # no parent directory: SQLite says so when it opens it


def _engine_for(url: URL) -> Engine:
    shown = url.render_as_string(hide_password=True)
    try:
        engine = sa.create_engine(url, json_serializer=_json_serializer)
    except sa.exc.NoSuchModuleError as exc:
        raise StoreError(
            f"unknown database type {url.drivername!r} in {shown}: use an SQLite path or "
            "postgresql+psycopg2://..."
        ) from exc
    except ImportError as exc:
        raise StoreError(
            f"the driver for {url.drivername!r} ({shown}) is not installed ({exc}); install it, "
            "or use postgresql+psycopg2:// (pip install 'runhealth[postgres]')"
        ) from exc
    except sa.exc.ArgumentError as exc:
        raise StoreError(f"cannot open the store {shown}: {exc}") from exc
    if engine.dialect.is_async:
        engine.dispose()
        raise StoreError(f"{url.drivername!r} ({shown}) is an asyncio driver; use a synchronous one")
    return engine


def open_store(db: str | None, environ: Mapping[str, str] | None = None) -> Engine:
    return create_store_engine(resolve_url(db, os.environ if environ is None else environ))
