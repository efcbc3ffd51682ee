"""Helpers for the collector tests: a real ``runhealth serve`` child, a recording transport,
fake markers, and reads of the SQLite store the service wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from pydantic import TypeAdapter

from collectors.transport import Delivery, Outcome
from collectors.wire import Record, encode_batch
from monitor.ingest.schemas import BatchIn
from tests.support import free_port

REPO = Path(__file__).resolve().parents[1]
ADMIN = "rh_admin_collectors_test"
BATCH = TypeAdapter(BatchIn)


def child_environ(**extra: str) -> dict[str, str]:
    """The environment for a child process: this one, the repository importable, plus extra."""
    environ = {key: value for key, value in os.environ.items() if not key.startswith("RUNHEALTH_")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")]))
    environ.update(extra)
    return environ


def launch_ranks(
    root: Path,
    world: int,
    command: list[str],
    per_rank: Callable[[int], dict[str, str]] = lambda _rank: {},
    **environ: str,
) -> list[subprocess.Popen[bytes]]:
    """``world`` ranks of ``command`` as torchrun would start them on one node (gloo on
    loopback, one thread each), with ``environ`` and ``per_rank(rank)`` added, logging to
    ``root/rank-N.log`` and writing into ``root/results``."""
    (root / "results").mkdir()
    port = str(free_port())
    ranks = []
    for rank in range(world):
        rank_environ = child_environ(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
            **environ, **per_rank(rank),
        )  # fmt: skip
        with open(root / f"rank-{rank}.log", "ab") as log:
            ranks.append(subprocess.Popen(command, cwd=root, env=rank_environ, stdout=log, stderr=log))
    return ranks


def finish_ranks(
    ranks: list[subprocess.Popen[bytes]], root: Path, timeout_s: float, log_tail: int = 3000
) -> list[dict[str, Any]]:
    """Wait for every rank (killing those past the deadline), assert each exited 0 (showing
    the logs' tails when not), and return each rank's ``results/rank-N.json``."""
    deadline = time.monotonic() + timeout_s
    try:
        for rank in ranks:
            rank.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    world = range(len(ranks))
    logs = "\n".join((root / f"rank-{n}.log").read_text(errors="replace")[-log_tail:] for n in world)
    assert all(rank.returncode == 0 for rank in ranks), logs
    return [json.loads((root / "results" / f"rank-{n}.json").read_text()) for n in world]


@contextmanager
def job_running(
    command: list[str], root: Path, environ: dict[str, str]
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``command`` started in ``root`` (its working directory), its output in ``root/job.log``,
    for the block; a job still running at its end (a test that failed early) is ended by PID
    (``end_job``). Inside, ``finish_job`` waits for it to exit 0."""
    log_path = root / "job.log"
    with open(log_path, "wb") as log:
        job = subprocess.Popen(command, cwd=root, env=environ, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield job, log_path
    finally:
        end_job(job)


def finish_job(job: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 240.0) -> None:
    """Wait for the job (a ``TimeoutExpired`` leaves it to ``job_running``) and check it exited 0."""
    job.wait(timeout_s)
    assert job.returncode == 0, log_path.read_text(errors="replace")[-4000:]


def embedded_store(root: Path, log_path: Path, timeout_s: float = 120.0) -> Path:
    """The store of the job's embedded service in ``root`` (``./runhealth.db``), once the service
    wrote its discovery file beside it: ``runhealth approve ID --db`` finds it from then on."""
    db = root / "runhealth.db"
    started = wait_until(lambda: (root / "runhealth.db.service.json").exists(), timeout_s, 0.25)
    assert started, log_path.read_text(errors="replace")[-4000:]
    return db


def held_job_environ(run: str, **extra: str) -> dict[str, str]:
    """A job's environment with the embedded service (no ``RUNHEALTH_URL``): run ``run``, records
    every 0.2 s, directives polled every 0.5 s, and a NaN held until its proposal is decided (the
    embedded service inherits the setting), plus ``extra``."""
    return child_environ(
        RUNHEALTH_RUN=run,
        RUNHEALTH_SENDER__FLUSH_INTERVAL_S="0.2",
        RUNHEALTH_DIRECTIVES__POLL_INTERVAL_S="0.5",
        RUNHEALTH_POLICIES__RESPONSE__NONFINITE="hold",
        **extra,
    )


def assert_recovered_in_the_audit(db: Path, root: Path) -> None:
    """The audit log holds the hold, the approval, the rollback, its verified resume and the
    resolved incident; no rank left a dead letter in ``root/runhealth-spool``."""
    audit = {row["action"] for row in table_rows(db, "audit_log")}
    assert {"hold", "approved", "rollback_executed", "resume_verified", "incident_resolved"} <= audit, audit
    assert [p for p in (root / "runhealth-spool").rglob("*.dead.jsonl") if p.stat().st_size] == []


def pending_rollback(
    db: Path, run: str, step: int, log_path: Path, timeout_s: float = 150.0
) -> dict[str, Any]:
    """The run's pending rollback proposal to the checkpoint of ``step``, once the fault was
    judged and that checkpoint recorded (an escalation or an older target is superseded on the
    way: a checkpoint is recorded once its files are hashed)."""
    from monitor.store import queries
    from monitor.store.db import create_store_engine, resolve_url

    found: list[dict[str, Any]] = []
    engine = create_store_engine(resolve_url(str(db), {}))

    def pending() -> bool:
        try:
            with engine.connect() as connection:
                rows = queries.list_proposals(connection, run, "pending")
        except Exception:  # the store not migrated yet
            return False
        found[:] = [p for p in rows if p["action"] == "rollback" and p["target"]["step"] == step]
        return bool(found)

    try:
        assert wait_until(pending, timeout_s, 0.5), log_path.read_text(errors="replace")[-4000:]
    finally:
        engine.dispose()
    return found[0]


def end_job(job: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """A test that failed early: its job, by PID. SIGTERM first (torchrun then ends its workers,
    which a SIGKILL of the launcher alone leaves running; a trainer closes its hook), SIGKILL
    after ``grace_s``."""
    if job.poll() is not None:
        return
    job.terminate()
    try:
        job.wait(grace_s)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()


class ServeProcess:
    """``python -m monitor serve`` on a fixed loopback port, which can be killed and restarted."""

    def __init__(self, root: Path, db: Path | sa.URL, port: int | None = None, **environ: str) -> None:
        self.root = root
        self.db = db
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._environ = child_environ(RUNHEALTH_ADMIN_TOKEN=ADMIN, **environ)
        self._process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self, timeout_s: float = 180.0) -> None:
        """Start it and wait for its port file; 180 s: at load 20-30 on 2 cores a start took
        over 60. One that exits or does not start in time is stopped before the error."""
        self.starts += 1
        port_file = self.root / f"port-{self.starts}"
        command = [
            sys.executable, "-m", "monitor", "serve", "--db", store_argument(self.db),
            "--host", "127.0.0.1", "--port", str(self.port), "--port-file", str(port_file),
        ]  # fmt: skip
        with open(self.root / "serve.log", "ab") as log:
            self._process = subprocess.Popen(
                command, env=self._environ, cwd=self.root, stdout=log, stderr=log
            )
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"runhealth serve did not start: {self.log_tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL by PID: no shutdown, in-flight requests cut off."""
        assert self._process is not None
        os.kill(self._process.pid, signal.SIGKILL)
        self._process.wait(10)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(10)

    def create_run(self, name: str) -> str:
        response = httpx.post(
            f"{self.url}/v1/runs", json={"name": name}, headers={"authorization": f"Bearer {ADMIN}"}
        )
        response.raise_for_status()
        return str(response.json()["token"])

    def log_tail(self) -> str:
        path = self.root / "serve.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@contextmanager
def serving(root: Path, **environ: str) -> Iterator[ServeProcess]:
    """A ``runhealth serve`` over ``root/store.db`` for the block (a module's tests share one,
    each with its own run)."""
    process = ServeProcess(root, root / "store.db", None, **environ)
    process.start()
    try:
        yield process
    finally:
        process.stop()


class RecordingTransport:
    """Accepts every batch and keeps it: the hook's records, in-process, without a service."""

    def __init__(self) -> None:
        self.batches: list[list[Record]] = []

    def post(self, records: Sequence[Record]) -> Delivery:
        BATCH.validate_json(encode_batch(records))  # every record must pass the service's schema
        self.batches.append(list(records))
        return Delivery(Outcome.DELIVERED, 200)

    def close(self) -> None:
        return None

    def records(self, kind: str) -> list[Record]:
        return [record for batch in self.batches for record in batch if record["kind"] == kind]


class FakeMarker:
    """A marker whose completion and time the test controls."""

    def __init__(self) -> None:
        self.done = False
        self.at = 0.0
        self.recorded = 0
        self.waited = 0

    def record(self) -> None:
        self.recorded += 1
        self.done = False

    def query(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.waited += 1
        self.done = True

    def seconds_since(self, earlier: FakeMarker) -> float:
        return self.at - earlier.at


def step_rows(db: Path | sa.URL, run: str | None = None) -> list[dict[str, Any]]:
    """The stored step records of the store at ``db`` (of one run, if named)."""
    query = "SELECT s.* FROM step_records s JOIN runs r ON r.id = s.run_id"
    if run is not None:
        query += " WHERE r.name = :run"
    engine = store_engine(db)
    try:
        with engine.connect() as connection:
            rows = connection.execute(sa.text(query + " ORDER BY s.rank, s.attempt"), {"run": run})
            return [dict(row._mapping) for row in rows]
    finally:
        engine.dispose()


def store_argument(db: Path | sa.URL) -> str:
    """``--db``'s value for a test's store (a URL with its password, if it has one)."""
    return db.render_as_string(hide_password=False) if isinstance(db, sa.URL) else str(db)


def store_engine(db: Path | sa.URL) -> sa.Engine:
    """An engine on a test's store: a SQLite file, or a PostgreSQL database's URL."""
    return sa.create_engine(db if isinstance(db, sa.URL) else f"sqlite:///{db}")


def table_rows(db: Path | sa.URL, table: str) -> list[dict[str, Any]]:
    engine = store_engine(db)
    try:
        with engine.connect() as connection:
            return [dict(row._mapping) for row in connection.execute(sa.text(f"SELECT * FROM {table}"))]
    finally:
        engine.dispose()


def wait_until(condition: Any, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return bool(condition())
