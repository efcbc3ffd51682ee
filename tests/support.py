"""Helpers shared by the tests: what to do when a dependency is missing, and a real
PostgreSQL 15 server the session starts and stops itself."""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from monitor import cli
from monitor.ingest.schemas import BatchIn
from monitor.recovery.directives import create_directive
from monitor.service import Service
from monitor.store import queries
from monitor.store.models import Base

POSTGRES_BIN = Path("/usr/lib/postgresql/15/bin")
POSTGRES_USER = "postgres"
BACKENDS = ("sqlite", "postgres")

# Apply to a test that takes the ``backend`` fixture to run it on both stores.
both_backends = pytest.mark.parametrize("backend", BACKENDS)


def missing(reason: str, environ: Mapping[str, str] = os.environ) -> NoReturn:
    """Skip a test whose dependency is missing; in CI (``CI=true``) fail it instead."""
    if environ.get("CI", "").lower() == "true":
        pytest.fail(f"required in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def require_binary(name: str, directory: Path | None = None) -> Path:
    """The path of an executable, found in ``directory`` or on PATH."""
    if directory is not None:
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
        missing(f"{candidate} is not installed")
    found = shutil.which(name)
    if found is None:
        missing(f"{name} is not on PATH")
    return Path(found)


def require_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"python package {name} is not installed")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_traversable(path: Path) -> None:
    """Let another user reach ``path``: add o+x to it and every parent that lacks it."""
    for directory in [path, *path.parents]:
        mode = directory.stat().st_mode
        if not mode & stat.S_IXOTH:
            directory.chmod(mode | stat.S_IXOTH)


class PostgresServer:
    """A throwaway PostgreSQL cluster under ``root``: loopback only, trust auth, no fsync.

    initdb refuses to run as root, so as root every server command runs as ``postgres``.
    """

    def __init__(self, root: Path, bin_dir: Path = POSTGRES_BIN) -> None:
        self.root = root
        self.data = root / "data"
        self.log = root / "server.log"
        self.bin_dir = bin_dir
        self.port = 0
        self._names = itertools.count()
        self._as_owner: list[str] = []
        if os.geteuid() == 0:
            self._as_owner = [str(require_binary("runuser")), "-u", POSTGRES_USER, "--"]

    def start(self) -> None:
        require_binary("initdb", self.bin_dir)
        require_binary("pg_ctl", self.bin_dir)
        self._prepare_root()
        self._command("initdb", "-D", str(self.data), "-U", "postgres", "-E", "UTF8", "-N")
        (self.data / "pg_hba.conf").write_text("local all all trust\nhost all all 127.0.0.1/32 trust\n")
        for _attempt in range(3):  # a free port can be taken between probe and bind
            self.port = free_port()
            self._write_settings()
            log = ["-l", str(self.log)]
            started = self._command("pg_ctl", "-D", str(self.data), *log, "-w", "start", check=False)
            if started.returncode == 0:
                return
            self.stop()
        raise RuntimeError(f"PostgreSQL did not start; see {self.log}")

    def stop(self) -> None:
        """Stop the server, and make sure no postmaster survives it."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        self._command("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop", check=False)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid)

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def url(self, database: str = "postgres") -> URL:
        return URL.create(
            "postgresql+psycopg2",
            username="postgres",
            host="127.0.0.1",
            port=self.port,
            database=database,
        )

    def create_database(self, prefix: str = "test", template: str | None = None) -> URL:
        """A new database with a name unique in this session: empty, or a copy of the database
        ``template`` (which nobody may be connected to meanwhile)."""
        name = f"{prefix}_{os.getpid()}_{next(self._names)}"
        psycopg2 = require_module("psycopg2")
        connection = psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres")
        try:
            connection.autocommit = True  # CREATE DATABASE cannot run in a transaction
            with connection.cursor() as cursor:
                copy = "" if template is None else f' TEMPLATE "{template}"'
                cursor.execute(f'CREATE DATABASE "{name}"{copy}')
        finally:
            connection.close()
        return self.url(name)

    def _prepare_root(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self._as_owner:
            owner = pwd.getpwnam(POSTGRES_USER)
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            make_traversable(self.root)

    def _write_settings(self) -> None:
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.data}'",
            # A test cluster: durability buys nothing and costs seconds.
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
        }
        lines = [f"{name} = {value}" for name, value in settings.items()]
        (self.data / "postgresql.auto.conf").write_text("\n".join(lines) + "\n")

    def _command(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [*self._as_owner, str(self.bin_dir / name), *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=self.root, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"{name} failed ({done.returncode}): {done.stderr.strip()}")
        return done


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] != "Z"


def _wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


# --- records and store contents --------------------------------------------------------------

ADMIN_TOKEN = "rh_admin_test-admin-token"
INCARNATION = "00000000-0000-4000-8000-000000000001"
SHA = "0123456789abcdef" * 4


def step_record(rank: int = 0, attempt: int = 0, **fields: Any) -> dict[str, Any]:
    """One rank's step record as a collector sends it; ``fields`` override the defaults."""
    record: dict[str, Any] = {
        "kind": "step",
        "incarnation": INCARNATION,
        "rank": rank,
        "attempt": attempt,
        "step": attempt,
        "time": 1000.0 + attempt,
        "tokens": 1024,
        "loss_sum": 2048.0,
        "grad_norm": 1.5,
        "lr": 3e-4,
        "loss_scale": 65536.0,
        "skipped": False,
    }
    record.update(fields)
    return record


def steps(count: int, ranks: int = 1, first_attempt: int = 0) -> list[dict[str, Any]]:
    return [
        step_record(rank, attempt)
        for attempt in range(first_attempt, first_attempt + count)
        for rank in range(ranks)
    ]


def record_of_each_kind(directive_id: int = 1) -> list[dict[str, Any]]:
    """One valid record of every kind the ingest API takes, in ``RECORD_KINDS`` order.

    The ``directive_ack`` answers ``directive_id``, which must exist for the run.
    """
    return [
        step_record(node="node-0", device_uuid="GPU-0", sample_ids=[1, "shard-3:17"]),
        {
            "kind": "heartbeat",
            "incarnation": INCARNATION,
            "rank": 0,
            "phase": "forward",
            "phase_since": 999.0,
            "time": 1000.0,
            "node": "node-0",
            "step": 0,
            "attempt": 0,
        },
        {
            "kind": "run_start",
            "incarnation": INCARNATION,
            "time": 990.0,
            "world_size": 1,
            "layout": {"dp": 1, "tp": 1},
            "config": {"lr": 3e-4},
        },
        {"kind": "run_finish", "incarnation": INCARNATION, "time": 2000.0, "status": "completed"},
        {
            "kind": "device_sample",
            "node": "node-0",
            "device_uuid": "GPU-0",
            "seq": 1,
            "time": 1000.0,
            "rank": 0,
            "clock_event_reasons": 0,
            "sm_clock_mhz": 1980.0,
            "power_w": 650.5,
            "temperature_c": 61.0,
            "counters": {"ecc_dbe": 0},
            "xids": [{"xid": 79, "time": 1000.0}],
        },
        {
            "kind": "link_sample",
            "node": "node-0",
            "device": "mlx5_0",
            "port": 1,
            "seq": 1,
            "time": 1000.0,
            "state": "ACTIVE",
            "counters": {"symbol_error": 0},
            "saturated": [],
        },
        {
            "kind": "checkpoint",
            "incarnation": INCARNATION,
            "rank": 0,
            "step": 0,
            "path": "/ckpt/step-0",
            "time": 1001.0,
            "consumed": 64,
            "manifest": {
                "step": 0,
                "consumed": 64,
                "files": [{"path": "model.pt", "size": 123, "sha256": SHA}],
            },
            "tags": ["periodic"],
            "metrics": {"loss": 2.0},
        },
        {
            "kind": "resume",
            "incarnation": INCARNATION,
            "rank": 0,
            "time": 1002.0,
            "restored": {"optimizer": True, "lr": 3e-4},
            "checkpoint_path": "/ckpt/step-0",
            "checkpoint_step": 0,
        },
        {
            "kind": "stack_dump",
            "incarnation": INCARNATION,
            "rank": 0,
            "time": 1002.0,
            "stacks": 'Thread 0x1 (most recent call first):\n  File "train.py", line 10 in step\n',
            "directive_id": directive_id,
        },
        {
            "kind": "directive_ack",
            "directive_id": directive_id,
            "incarnation": INCARNATION,
            "rank": 0,
            "time": 1003.0,
            "status": "done",
        },
        {
            "kind": "canary_result",
            "incarnation": INCARNATION,
            "rank": 0,
            "step": 0,
            "time": 1004.0,
            "stack": {"device_name": "NVIDIA H200", "cuda": "13.0", "torch": "2.11"},
            "stack_key": "h200-cuda13",
            "kernels": {"gemm_fp32": {"fingerprint": "ab" * 32, "summary": [1.5, "NaN", 2.0]}},
            "seconds": 0.004,
            "node": "node-0",
            "device_uuid": "GPU-0",
        },
    ]


def batch(*records: dict[str, Any]) -> dict[str, Any]:
    return {"records": list(records)}


def count_rows(engine: Engine, table: sa.Table | Any) -> int:
    with engine.connect() as connection:
        return int(connection.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def table_counts(engine: Engine) -> dict[str, int]:
    """Rows in every table of the models, by name."""
    return {name: count_rows(engine, table) for name, table in Base.metadata.tables.items()}


def snapshot(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, in id order: compare two to prove nothing was written."""
    found = {}
    with engine.connect() as connection:
        for name, table in Base.metadata.tables.items():
            rows = connection.execute(sa.select(table).order_by(*table.primary_key.columns))
            found[name] = [tuple(row) for row in rows]
    return found


@dataclass(frozen=True)
class RunHandle:
    name: str
    id: int
    token: str
    directive_id: int
    """A pending ``dump_stacks`` directive of this run, for records that answer one."""

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def records_path(self) -> str:
        return f"/v1/runs/{self.name}/records"


def make_run(store: Engine, name: str) -> RunHandle:
    with store.begin() as connection:
        token = queries.create_run(connection, name)
        run_id = int(queries.run_row(connection, name).id)
        directive_id = create_directive(connection, run_id, "dump_stacks", created_by="tests", now=0.0)
    return RunHandle(name=name, id=run_id, token=token, directive_id=directive_id)


def run_cli(argv: list[str]) -> int:
    """``runhealth ARGV`` in this process; its exit status."""
    try:
        cli.main(argv)
    except SystemExit as exited:
        return exited.code if isinstance(exited.code, int) else 1
    return 0


def cli_result(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``runhealth ARGS`` in this process: its exit status, stdout and stderr."""
    code = run_cli(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def post(service: Service, run: RunHandle, records: list[dict[str, Any]]) -> None:
    """Records into a service in this process, through the same validation as the API."""
    service.ingest(run.name, run.id, BatchIn.model_validate_json(json.dumps({"records": records})).records)


def spiky_windows(
    attempts: range, ranks: int = 2, spike: int | None = None, incarnation: str = INCARNATION
) -> list[dict[str, Any]]:
    """Step records of a steady run (loss about 2) whose every rank jumps to 9 at ``spike``."""
    return [
        {
            "kind": "step",
            "incarnation": incarnation,
            "rank": r,
            "attempt": a,
            "step": a,
            "time": 100.0 + a,
            "tokens": 10,
            "loss_sum": 10 * (9.0 if a == spike else 2.0 + 0.01 * ((a * 7 + r) % 5)),
            "lr": 1e-3,
            "consumed": 8 * a,
            "sample_ids": [f"b{a}-{r}"],
        }
        for a in attempts
        for r in range(ranks)
    ]


def checkpoint(tmp_path: Path, step: int, tamper: bool = False) -> dict[str, Any]:
    """A checkpoint event of ``spiky_windows``' run, its one file written under ``tmp_path``
    (``tamper``: changed after its manifest was taken)."""
    folder = tmp_path / f"ckpt-{step}"
    folder.mkdir()
    payload = f"weights at {step}".encode()
    (folder / "model.pt").write_bytes(payload)
    manifest = {
        "step": step,
        "consumed": 8 * step,
        "files": [{"path": "model.pt", "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}],
    }
    if tamper:
        (folder / "model.pt").write_bytes(payload.upper())
    return {
        "kind": "checkpoint",
        "incarnation": INCARNATION,
        "step": step,
        "path": str(folder),
        "time": 100.0 + step,
        "consumed": 8 * step,
        "manifest": manifest,
    }
