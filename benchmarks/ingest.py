"""Ingest throughput and the service's CPU per record: batches of step records posted to a
running ``runhealth serve``.

Starts its own service on a fresh SQLite file (or uses --url with --token), posts batches
from one client, and prints records per second, batch latency percentiles and the service
process's CPU time per record as JSON. Server and client share the machine, as they do in the
embedded default; CPU time (user + system of the service process, from /proc) holds on a busy
machine where records per second does not.

    python benchmarks/ingest.py [--batches 200] [--batch-size 1000] [--ranks 64]

On PostgreSQL, ``--postgres`` starts a throwaway PostgreSQL 15 server the way the tests do
(``tests.support.PostgresServer``), ``--db postgresql+psycopg2://...`` uses an existing empty
database (upgraded here). Each is measured twice in one run, side by side: the row-by-row
INSERT path (``RUNHEALTH_INGEST__COPY_ON_POSTGRESQL=false``) and the COPY path (the default),
each on a fresh database (another run in the same one, with ``--db``) with the same batches.
With ``--postgres`` the database server's own CPU per record (every postgres process of the
throwaway cluster) is reported too. Then the store write alone, ``ingest_batch`` called in this
process on each path: its CPU per record for new records and for the same batches re-sent
(the service's figure also holds validation, folding windows and judging them, the same on
both paths).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, installed or not

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def step_records(incarnation: str, ranks: int, first: int, count: int) -> list[dict[str, object]]:
    """Records ``first .. first+count`` of a run where every window has ``ranks`` records."""
    records = []
    for index in range(first, first + count):
        attempt, rank = divmod(index, ranks)
        records.append(
            {
                "kind": "step",
                "incarnation": incarnation,
                "rank": rank,
                "attempt": attempt,
                "step": attempt,
                "consumed": attempt * 64 * ranks,
                "time": time.time(),
                "node": f"node-{rank // 8:03d}",
                "dp_rank": rank,
                "microbatches": 8,
                "sample_ids": [attempt * 1000 + rank * 2, attempt * 1000 + rank * 2 + 1],
                "tokens": 4096 + rank,
                "loss_sum": 2.5 * (4096 + rank),
                "reported_loss": 2.5,
                "grad_norm": 1.0,
                "lr": 3e-4,
                "loss_scale": 65536.0,
                "skipped": False,
                "data_wait_s": 0.001,
                "forward_s": 0.01,
                "backward_s": 0.02,
                "optimizer_s": 0.003,
            }
        )
    return records


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid``, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def cluster_cpu_seconds(postmaster_pid: int) -> float:
    """CPU time of a PostgreSQL cluster: the postmaster and every process it started (backends
    that exited are counted by their parent's cutime/cstime)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        pid, parent = int(entry.name), int(fields[1])
        if pid == postmaster_pid:
            total += sum(int(value) for value in fields[11:15]) / CLOCK_TICKS  # with children
        elif parent == postmaster_pid:
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


@contextmanager
def running_service(db: str, workdir: Path, environ: dict[str, str]) -> Iterator[tuple[int, str, str]]:
    """A ``runhealth serve`` over ``db``: its pid, URL and admin token."""
    token = secrets.token_urlsafe(24)
    port_file = workdir / f"port-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, **environ, "RUNHEALTH_ADMIN_TOKEN": token}
    argv = [
        sys.executable,
        "-m",
        "monitor",
        "serve",
        "--db",
        db,
        "--port",
        "0",
        "--port-file",
        str(port_file),
    ]
    process = subprocess.Popen(argv, env=env, cwd=workdir)
    try:
        deadline = time.time() + 60
        while not port_file.exists():
            if process.poll() is not None or time.time() > deadline:
                raise SystemExit("runhealth serve did not start")
            time.sleep(0.05)
        yield process.pid, f"http://127.0.0.1:{port_file.read_text().strip()}", token
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def measure(
    url: str, token: str, args: argparse.Namespace, service_pid: int | None = None, db_pid: int | None = None
) -> dict[str, Any]:
    """Post the batches; what they cost the service (and the database, given its pid)."""
    run = f"bench-{uuid.uuid4().hex[:8]}"
    headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        client.post("/v1/runs", json={"name": run}).raise_for_status()
        incarnation = str(uuid.uuid4())
        bodies = [
            json.dumps(
                {"records": step_records(incarnation, args.ranks, b * args.batch_size, args.batch_size)}
            ).encode()
            for b in range(args.batches)
        ]
        latencies = []
        service_cpu = cpu_seconds(service_pid) if service_pid else 0.0
        db_cpu = cluster_cpu_seconds(db_pid) if db_pid else 0.0
        started = time.perf_counter()
        for body in bodies:
            t0 = time.perf_counter()
            client.post(f"/v1/runs/{run}/records", content=body).raise_for_status()
            latencies.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - started
        service_cpu = cpu_seconds(service_pid) - service_cpu if service_pid else 0.0
        db_cpu = cluster_cpu_seconds(db_pid) - db_cpu if db_pid else 0.0
        stored = len(client.get(f"/v1/runs/{run}/steps", params={"limit": 100_000}).json()["steps"])
    latencies.sort()
    records = args.batches * args.batch_size
    figures: dict[str, Any] = {
        "records": records,
        "batch_size": args.batch_size,
        "ranks": args.ranks,
        "seconds": round(elapsed, 3),
        "records_per_second": round(records / elapsed),
        "batch_latency_p50_ms": round(statistics.median(latencies) * 1000, 2),
        "batch_latency_p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1000, 2),
        "windows_stored": stored,
    }
    if service_pid:
        figures["service_cpu_us_per_record"] = round(service_cpu / records * 1e6, 2)
    if db_pid:
        figures["database_cpu_us_per_record"] = round(db_cpu / records * 1e6, 2)
    return figures


def upgraded(db: str) -> None:
    done = subprocess.run([sys.executable, "-m", "monitor", "db", "upgrade", "--db", db], check=False)
    if done.returncode != 0:
        raise SystemExit(f"runhealth db upgrade --db {db} failed")


def store_write_cpu(db: str, copy: bool, args: argparse.Namespace) -> dict[str, float]:
    """The store write alone, in this process: ``ingest_batch``'s CPU per record, for the
    batches as new records and for the same batches re-sent (all duplicates)."""
    from sqlalchemy.engine import make_url

    from monitor.ingest.batches import ingest_batch
    from monitor.ingest.schemas import BatchIn
    from monitor.store import queries
    from monitor.store.db import create_store_engine

    engine = create_store_engine(make_url(db))
    try:
        run = f"write-{uuid.uuid4().hex[:8]}"
        with engine.begin() as connection:
            queries.create_run(connection, run)
            run_id = int(queries.run_row(connection, run).id)
        incarnation = str(uuid.uuid4())
        batches = [
            BatchIn.model_validate(
                {"records": step_records(incarnation, args.ranks, b * args.batch_size, args.batch_size)}
            ).records
            for b in range(args.batches)
        ]
        figures = {}
        for name in ("new", "resent"):
            cpu = 0.0
            for records in batches:
                with engine.begin() as connection:
                    started = time.process_time()
                    ingest_batch(connection, run_id, records, time.time(), copy=copy)
                    cpu += time.process_time() - started
            figures[f"store_write_cpu_us_per_record_{name}"] = round(
                cpu / (len(batches) * args.batch_size) * 1e6, 2
            )
        return figures
    finally:
        engine.dispose()


def postgres_paths(args: argparse.Namespace, workdir: Path) -> Iterator[dict[str, Any]]:
    """The row-by-row path and the COPY path, each on a fresh database, side by side."""
    server = None
    if args.postgres:
        from tests.support import PostgresServer  # the tests' throwaway cluster

        server = PostgresServer(workdir / "postgres")
        server.start()
    try:
        for name, copy in (("insert", "false"), ("copy", "true")):
            if server is not None:
                db = server.create_database(f"bench_{name}").render_as_string(hide_password=False)
            else:
                db = args.db
            upgraded(db)
            environ = {"RUNHEALTH_INGEST__COPY_ON_POSTGRESQL": copy}
            with running_service(db, workdir, environ) as (pid, url, token):
                db_pid = server.postmaster_pid() if server is not None else None
                figures = measure(url, token, args, pid, db_pid)
            yield {"path": name, **figures, **store_write_cpu(db, copy == "true", args)}
    finally:
        if server is not None:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url")
    parser.add_argument("--token", help="admin token of --url's service")
    parser.add_argument("--postgres", action="store_true", help="start a throwaway PostgreSQL")
    parser.add_argument("--db", help="an existing empty PostgreSQL database URL")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=64)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="rh-bench-", dir=os.environ.get("TMPDIR")))
    if args.postgres or args.db:
        print(json.dumps({"backend": "postgresql", "paths": list(postgres_paths(args, workdir))}, indent=2))
    elif args.url:
        print(json.dumps({"backend": args.url, **measure(args.url, args.token or "", args)}, indent=2))
    else:
        with running_service(str(workdir / "bench.db"), workdir, {}) as (pid, url, token):
            print(json.dumps({"backend": "sqlite", **measure(url, token, args, pid)}, indent=2))


if __name__ == "__main__":
    main()
