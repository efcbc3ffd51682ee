"""Fleet load: can the service keep up with N runs of R ranks at one step per second?

Starts a throwaway PostgreSQL (as the tests do: ``tests/support.py``; or uses ``--db URL``, or
``--backend sqlite``), brings it to the current schema, starts ``--replicas`` ``runhealth serve``
processes on it, and drives them from ``--senders`` processes of simulated ranks
(``fleet_senders.py``): every rank posts its step records every ``--flush-s`` (the hook's
default 2 s), a heartbeat every 5 s and a device sample every 10 s, each batch to one replica
(ranks split over the replicas). A nonfinite loss is planted on one rank of the first run at
``--fault-at`` and every ``--fault-every`` steps after.

While the load runs, this process polls the store (every ``--poll-s``) for the newest judged
window of each run, the unjudged windows and new incidents. It prints JSON:

- ``records_per_second``: records accepted (2xx) over the load's seconds; ``shed`` (429) and
  ``failed`` batches beside them;
- ``service_cpu_us_per_record``: the serve processes' CPU (``/proc/<pid>/stat``) over records
  accepted, and the database server's likewise (``postgres_cpu_us_per_record``), which holds on a
  loaded machine where wall-clock rates do not; ``ranks_per_service_core`` (and
  ``ranks_per_postgres_core``): step records over CPU seconds, the ranks at one step a second
  one core carries at the measured cost, whether or not this run kept up;
- ``record_to_judged_s``: from a record's send to the poll that first saw its window judged
  (p50, p99; an upper bound by up to one poll interval); ``step_to_judged_s``: from the window's
  end on the rank's clock (its records wait up to a flush interval in the hook);
- ``fault_to_incident_s``: from the faulty record's send to its incident's ``opened_at``;
- ``database_bytes``, the machine's load average (start, end and mean of the load), and
  ``sustained``: the senders kept their schedule (p99 lag under a flush interval), no batch was
  refused, and the judge did not fall behind (its lag behind the training clock in the load's
  last half stayed within ``--flush-s`` of the first half's and under ``--max-lag-s``).

``--find-max`` runs stages of ``--sustain-s`` each (10 minutes by default, per issue 18) on a
fresh database, doubling the ranks per run until a stage is not sustained, then bisects, and
prints every stage and the largest rank count sustained.

    python benchmarks/fleet.py --runs 1 --ranks 1024 --seconds 60
    python benchmarks/fleet.py --replicas 2 --ranks 4096 --seconds 120
    python benchmarks/fleet.py --find-max --ranks 1024 --sustain-s 600
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import sqlalchemy as sa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, installed or not
sys.path.insert(0, str(REPO / "benchmarks"))

from fleet_senders import Fault, Plan, Poster, Sent  # noqa: E402

from monitor.store import migrate  # noqa: E402
from monitor.store.db import create_store_engine  # noqa: E402

ADMIN_TOKEN = "rh_admin_" + secrets.token_urlsafe(16)
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Load:
    runs: int
    ranks: int
    ranks_per_batch: int
    replicas: int
    senders: int
    threads: int
    seconds: float
    flush_s: float
    heartbeat_s: float
    device_s: float
    fault_at: int
    fault_every: int
    poll_s: float
    max_lag_s: float
    ask_directives: bool = False


# --- the store ---------------------------------------------------------------------------------


@dataclass
class Store:
    url: sa.URL
    postgres: Any = None  # tests.support.PostgresServer when this benchmark started one
    sqlite_file: Path | None = None

    def size(self, engine: sa.Engine) -> int:
        if self.sqlite_file is not None:
            paths = [self.sqlite_file, Path(f"{self.sqlite_file}-wal")]
            return sum(p.stat().st_size for p in paths if p.exists())
        with engine.connect() as connection:
            return int(
                connection.execute(sa.text("SELECT pg_database_size(current_database())")).scalar_one()
            )

    def database_cpu_s(self) -> float | None:
        """CPU of the PostgreSQL this benchmark started: the postmaster, its live children and
        the children it reaped (a backend's time moves there when it exits)."""
        if self.postgres is None:
            return None
        postmaster = self.postgres.postmaster_pid()
        if postmaster is None:
            return None
        total = _cpu_s(postmaster, children=True)
        for stat in Path("/proc").glob("[0-9]*/stat"):
            fields = _stat_fields(stat)
            if fields is not None and int(fields[1]) == postmaster:
                total += (int(fields[11]) + int(fields[12])) / TICKS
        return total


def _stat_fields(path: Path) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name: state, ppid, ... (utime is index 11)."""
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _cpu_s(pid: int, children: bool = False) -> float:
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    if fields is None:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / TICKS


@contextmanager
def store_for(args: argparse.Namespace, workdir: Path) -> Iterator[Store]:
    if args.db:
        url = sa.make_url(args.db)
        database = url.database if url.get_backend_name() == "sqlite" else None
        yield Store(url, sqlite_file=Path(database) if database else None)
        return
    if args.backend == "sqlite":
        path = workdir / "fleet.db"
        yield Store(sa.make_url(f"sqlite:///{path}"), sqlite_file=path)
        return
    from tests.support import POSTGRES_BIN, PostgresServer

    for binary in ("initdb", "pg_ctl"):
        if not (POSTGRES_BIN / binary).exists():
            raise SystemExit(
                f"fleet: {POSTGRES_BIN / binary} is not installed (apt-get install postgresql-15)"
            )
    server = PostgresServer(workdir / "postgres")
    server.start()
    try:
        yield Store(server.url(), postgres=server)
    finally:
        server.stop()


def fresh_database(store: Store, workdir: Path, stage: int) -> Store:
    """A new, empty database for one stage, at the current schema."""
    if store.postgres is not None:
        url = store.postgres.create_database("fleet")
        fresh = replace(store, url=url)
    elif store.sqlite_file is not None:
        path = workdir / f"fleet-{stage}.db"
        fresh = replace(store, url=sa.make_url(f"sqlite:///{path}"), sqlite_file=path)
    else:
        fresh = store  # --db URL: the caller's database, used as it is
    engine = create_store_engine(fresh.url)
    migrate.upgrade(engine)
    engine.dispose()
    return fresh


# --- the replicas ----------------------------------------------------------------------------


@dataclass
class Replica:
    process: subprocess.Popen[bytes]
    port: int
    log: Path


def start_replicas(url: sa.URL, count: int, workdir: Path) -> list[Replica]:
    env = {**os.environ, "RUNHEALTH_ADMIN_TOKEN": ADMIN_TOKEN}
    replicas = []
    for index in range(count):
        port_file, log = workdir / f"port-{index}", workdir / f"serve-{index}.log"
        command = [
            sys.executable, "-m", "monitor", "serve", "--db", url.render_as_string(hide_password=False),
            "--port", "0", "--port-file", str(port_file),
        ]  # fmt: skip
        with log.open("ab") as out:
            process = subprocess.Popen(command, env=env, cwd=workdir, stdout=out, stderr=out)
        replicas.append(Replica(process, 0, log))
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                stop_replicas(replicas)
                raise SystemExit(f"fleet: runhealth serve did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        replicas[-1].port = int(port_file.read_text())
    return replicas


def stop_replicas(replicas: list[Replica]) -> None:
    for replica in replicas:
        if replica.process.poll() is None:
            replica.process.send_signal(signal.SIGTERM)
    for replica in replicas:
        try:
            replica.process.wait(30)
        except subprocess.TimeoutExpired:
            replica.process.kill()
            replica.process.wait(10)


# --- watching the store --------------------------------------------------------------------------


@dataclass
class Watch:
    """What the store said while the load ran, polled from this process."""

    judged_at: dict[tuple[int, int], float] = field(default_factory=dict)  # (run id, attempt)
    newest_judged: dict[int, int] = field(default_factory=dict)
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (time, min judged, pending)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    polls: int = 0


def watch_store(url: sa.URL, run_ids: list[int], poll_s: float, stop: threading.Event, out: Watch) -> None:
    engine = create_store_engine(url)
    summaries, incidents = sa.table(
        "step_summaries", sa.column("run_id"), sa.column("attempt"), sa.column("judged")
    ), sa.table("incidents", sa.column("id"), sa.column("run_id"), sa.column("kind"), sa.column("first_step"),
                sa.column("opened_at"))  # fmt: skip
    newest = sa.select(summaries.c.run_id, sa.func.max(summaries.c.attempt)).where(
        summaries.c.judged.is_(True)
    )
    pending = sa.select(sa.func.count()).select_from(summaries).where(summaries.c.judged.is_(False))
    last_incident = 0
    try:
        while not stop.wait(poll_s):
            with engine.connect() as connection:
                judged = dict(connection.execute(newest.group_by(summaries.c.run_id)).all())
                waiting = int(connection.execute(pending).scalar_one())
                found = connection.execute(
                    sa.select(incidents).where(incidents.c.id > last_incident).order_by(incidents.c.id)
                ).mappings()
                out.incidents += [dict(row) for row in found]
            now = time.time()
            for run_id, attempt in judged.items():
                for a in range(out.newest_judged.get(run_id, 0) + 1, attempt + 1):
                    out.judged_at[(run_id, a)] = now
                out.newest_judged[run_id] = max(attempt, out.newest_judged.get(run_id, 0))
            if out.incidents:
                last_incident = out.incidents[-1]["id"]
            out.samples.append((now, min(out.newest_judged.get(r, 0) for r in run_ids), waiting))
            out.polls += 1
    finally:
        engine.dispose()


# --- one stage -----------------------------------------------------------------------------------


def create_runs(replica: Replica, count: int, load: Load) -> tuple[list[str], list[str], list[str]]:
    """The runs (names, tokens, incarnations), each with its run-start record posted."""
    names, tokens, incarnations = [], [], []
    base = f"http://127.0.0.1:{replica.port}"
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    hook = {"heartbeat_s": load.heartbeat_s, "flush_s": load.flush_s}
    with httpx.Client(base_url=base, timeout=60) as client:
        for index in range(count):
            name = f"fleet-{index}-{uuid.uuid4().hex[:6]}"
            response = client.post("/v1/runs", json={"name": name}, headers=admin)
            response.raise_for_status()
            token, incarnation = response.json()["token"], str(uuid.uuid4())
            start = {
                "kind": "run_start",
                "incarnation": incarnation,
                "time": time.time(),
                "world_size": load.ranks,
                "config": {"runhealth_hook": hook},
            }
            client.post(
                f"/v1/runs/{name}/records",
                json={"records": [start]},
                headers={"authorization": f"Bearer {token}"},
            ).raise_for_status()
            names.append(name)
            tokens.append(token)
            incarnations.append(incarnation)
    return names, tokens, incarnations


def finish_runs(replica: Replica, names: list[str], tokens: list[str], incarnations: list[str]) -> None:
    """Each run's run-finish record, as rank 0's hook sends at close: a run that ended is not
    hung when its ranks fall silent."""
    with httpx.Client(base_url=f"http://127.0.0.1:{replica.port}", timeout=120) as client:
        for name, token, incarnation in zip(names, tokens, incarnations, strict=True):
            finish = {
                "kind": "run_finish",
                "incarnation": incarnation,
                "time": time.time(),
                "status": "completed",
            }
            try:
                client.post(
                    f"/v1/runs/{name}/records",
                    json={"records": [finish]},
                    headers={"authorization": f"Bearer {token}"},
                ).raise_for_status()
            except httpx.HTTPError as exc:  # a service this far behind: the figures say so already
                print(f"fleet: run_finish of {name} not stored: {exc!r}", file=sys.stderr)


def posters_for(load: Load, names: list[str], tokens: list[str], replicas: list[Replica]) -> list[Poster]:
    posters = []
    per_run = -(-load.ranks // load.ranks_per_batch)
    total = per_run * load.runs
    for run_index, (name, token) in enumerate(zip(names, tokens, strict=True)):
        for group in range(per_run):
            index = run_index * per_run + group
            first = group * load.ranks_per_batch
            posters.append(
                Poster(
                    run=name,
                    run_index=run_index,
                    token=token,
                    host="127.0.0.1",
                    port=replicas[index % len(replicas)].port,
                    first_rank=first,
                    last_rank=min(load.ranks, first + load.ranks_per_batch),
                    # Spread over the flush interval, as ranks that started apart post apart.
                    offset_s=load.flush_s * index / total,
                )
            )
    return posters


def run_stage(load: Load, store: Store, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    replicas = start_replicas(store.url, load.replicas, workdir)
    engine = create_store_engine(store.url)
    running: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()  # the store watcher's
    try:
        names, tokens, incarnations = create_runs(replicas[0], load.runs, load)
        with engine.connect() as connection:
            ids = {
                str(name): int(id_) for name, id_ in connection.execute(sa.text("SELECT name, id FROM runs"))
            }
        run_ids = [int(ids[name]) for name in names]
        fault = Fault(0, load.ranks // 2, load.fault_at, load.fault_every) if load.fault_at > 0 else None
        posters = posters_for(load, names, tokens, replicas)
        started_at = time.time() + 3.0 + 0.5 * load.senders  # the senders build their templates first
        plan = Plan(
            incarnations=tuple(incarnations),
            ranks=load.ranks,
            flush_s=load.flush_s,
            heartbeat_s=load.heartbeat_s,
            device_s=load.device_s,
            started_at=started_at,
            seconds=load.seconds,
            fault=fault,
            threads=load.threads,
            ask_directives=load.ask_directives,
        )
        watch = Watch()
        watcher = threading.Thread(
            target=watch_store, args=(store.url, run_ids, load.poll_s, stop, watch), daemon=True
        )
        senders = launch_senders(posters, plan, load.senders, workdir)
        running.extend(process for process, _ in senders)
        while time.time() < started_at:
            time.sleep(0.05)
        # CPU is read at the start, over the steady part (after every rank's first heartbeat and
        # device sample, whose first sightings cost the service a store read each), and at the end.
        steady = (
            started_at + max(load.heartbeat_s, load.device_s) + 2 * load.flush_s,
            started_at + load.seconds,
        )
        meter = [cpu_sample(replicas, store)]
        load_before = os.getloadavg()[0]
        watcher.start()
        loads = []
        while any(process.poll() is None for process, _ in senders):
            loads.append(os.getloadavg()[0])
            if len(meter) < 3 and time.time() >= steady[len(meter) - 1]:
                meter.append(cpu_sample(replicas, store))
            time.sleep(0.2)
        ended_at = time.time()
        finish_runs(replicas[0], names, tokens, incarnations)
        # The last windows are judged once their last ranks' posts land: wait for them (the
        # newest attempt every rank sent), up to a readiness watermark and a flush interval more.
        last_attempt = int(load.seconds)
        drain_until = ended_at + 2 * load.flush_s + 1 + load.max_lag_s
        while (
            time.time() < drain_until and min(watch.newest_judged.get(r, 0) for r in run_ids) < last_attempt
        ):
            time.sleep(load.poll_s)
        meter.append(cpu_sample(replicas, store))
        stop.set()
        watcher.join()
        sent = [read_sent(out) for _, out in senders]
        result = summarize(load, plan, sent, watch, run_ids, meter)
        # A batch the senders gave up on (no answer in time) may still be stored: the whole run's
        # CPU is also given per record the store holds.
        with engine.connect() as connection:
            stored_steps = int(connection.execute(sa.text("SELECT count(*) FROM step_records")).scalar_one())
            stored_samples = int(
                connection.execute(sa.text("SELECT count(*) FROM device_samples")).scalar_one()
            )
        result["step_records_stored"] = stored_steps
        result["cpu_whole_per_stored"] = cpu_figures(
            meter[0], meter[-1], stored_steps + stored_samples, stored_steps
        )
        result["database_bytes"] = store.size(engine)
        result["load_average"] = {
            "start": round(load_before, 2),
            "mean": round(float(np.mean(loads)) if loads else load_before, 2),
            "end": round(os.getloadavg()[0], 2),
        }
        result["replica_logs_tail"] = [
            r.log.read_text(errors="replace")[-400:] for r in replicas if _errors_in(r.log)
        ]
        return result
    finally:
        stop.set()
        for process in running:  # interrupted: the senders go with the stage
            if process.poll() is None:
                process.kill()
                process.wait(10)
        engine.dispose()
        stop_replicas(replicas)


@dataclass(frozen=True)
class CpuSample:
    at: float
    service_s: float
    database_s: float | None


def cpu_sample(replicas: list[Replica], store: Store) -> CpuSample:
    return CpuSample(time.time(), sum(_cpu_s(r.process.pid) for r in replicas), store.database_cpu_s())


def cpu_figures(first: CpuSample, last: CpuSample, records: int, steps: int) -> dict[str, Any]:
    """CPU between two samples over the records and step records accepted between them."""
    service = last.service_s - first.service_s
    database = (
        None if first.database_s is None or last.database_s is None else last.database_s - first.database_s
    )
    return {
        "seconds": round(last.at - first.at, 1),
        "service_cpu_s": round(service, 2),
        "service_cores_used": round(service / (last.at - first.at), 3),
        "service_cpu_us_per_record": round(1e6 * service / records, 2) if records else None,
        "service_cpu_us_per_step_record": round(1e6 * service / steps, 2) if steps else None,
        # A rank at one step a second costs a step record and its share of the other records:
        # the ranks one core carries at the measured cost, whether or not this run kept up.
        "ranks_per_service_core": round(steps / service) if service > 0 else None,
        "postgres_cpu_s": None if database is None else round(database, 2),
        "postgres_cpu_us_per_record": round(1e6 * database / records, 2)
        if database is not None and records
        else None,
        "ranks_per_postgres_core": round(steps / database) if database else None,
    }


def _errors_in(log: Path) -> bool:
    text = log.read_text(errors="replace")
    return "Traceback" in text or "ERROR" in text


def launch_senders(
    posters: list[Poster], plan: Plan, count: int, workdir: Path
) -> list[tuple[subprocess.Popen[bytes], Path]]:
    senders = []
    for index in range(count):
        plan_file, out = workdir / f"plan-{index}.pickle", workdir / f"sent-{index}.pickle"
        plan_file.write_bytes(pickle.dumps((posters[index::count], plan)))
        script = REPO / "benchmarks" / "fleet_senders.py"
        process = subprocess.Popen([sys.executable, str(script), str(plan_file), str(out)])
        senders.append((process, out))
    return senders


def read_sent(path: Path) -> Sent:
    if not path.exists():
        raise SystemExit(f"fleet: a sender process ended without its results ({path})")
    sent = pickle.loads(path.read_bytes())
    assert isinstance(sent, Sent)
    return sent


# --- the figures ---------------------------------------------------------------------------------


def _weighted_percentiles(values: np.ndarray, weights: np.ndarray, points: tuple[float, ...]) -> list[float]:
    if values.size == 0:
        return [float("nan")] * len(points)
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return [float(values[order][np.searchsorted(cumulative, p * cumulative[-1])]) for p in points]


def summarize(
    load: Load,
    plan: Plan,
    sent: list[Sent],
    watch: Watch,
    run_ids: list[int],
    meter: list[CpuSample],
) -> dict[str, Any]:
    batches = [b for s in sent for b in s.batches]
    accepted = sum(b[8] for b in batches if 200 <= b[7] < 300)
    steps_accepted = sum((b[2] - b[1] + 1) * b[3] for b in batches if 200 <= b[7] < 300)
    shed = sum(1 for b in batches if b[7] == 429)
    failed = sum(1 for b in batches if not (200 <= b[7] < 300) and b[7] != 429)
    lags = np.array([b[5] - b[4] for b in batches]) if batches else np.zeros(0)
    answer = np.array([b[6] - b[5] for b in batches]) if batches else np.zeros(0)

    latency, weight, step_latency, unjudged, late = [], [], [], 0, 0
    for run_index, first, last, ranks, _due, sent_at, _answered, status, _records in batches:
        if not 200 <= status < 300:
            continue
        for attempt in range(first, last + 1):
            judged = watch.judged_at.get((run_ids[run_index], attempt))
            if judged is None:
                unjudged += ranks
                continue
            if judged < sent_at:
                late += ranks  # its window was judged without it (given up on at the watermark)
            latency.append(judged - sent_at)
            weight.append(ranks)
            step_latency.append((judged - (plan.started_at + attempt), ranks))
    p50, p99 = _weighted_percentiles(np.array(latency), np.array(weight, dtype=float), (0.5, 0.99))
    s50, s99 = _weighted_percentiles(
        np.array([v for v, _ in step_latency]),
        np.array([w for _, w in step_latency], dtype=float),
        (0.5, 0.99),
    )

    faults = sorted({(run_index, attempt): at for s in sent for run_index, attempt, at in s.faults}.items())
    to_incident, missed, per_fault = [], [], []
    for (run_index, attempt), at in faults:
        matching = [
            i for i in watch.incidents if i["run_id"] == run_ids[run_index] and i["first_step"] == attempt
        ]
        per_fault.append(len(matching))
        if matching:
            to_incident.append(min(i["opened_at"] for i in matching) - at)
        else:
            missed.append(attempt)
    fault_steps = {(run_ids[r], a) for (r, a), _ in faults}
    other = [i for i in watch.incidents if (i["run_id"], i["first_step"]) not in fault_steps]

    judge_lag = judge_lags(watch, plan)
    half = len(judge_lag) // 2
    first_half = max((lag for _, lag in judge_lag[:half]), default=0.0)
    second_half = max((lag for _, lag in judge_lag[half:]), default=0.0)
    pending = [p for t, _, p in watch.samples if plan.started_at + 10 <= t <= plan.started_at + plan.seconds]
    total_ranks = load.runs * load.ranks
    kept_pace = lags.size > 0 and float(np.percentile(lags, 99)) <= load.flush_s
    kept_up = second_half <= first_half + load.flush_s and second_half <= load.max_lag_s
    return {
        "runs": load.runs,
        "ranks_per_run": load.ranks,
        "total_ranks": total_ranks,
        "replicas": load.replicas,
        "ranks_per_batch": load.ranks_per_batch,
        "ask_directives": load.ask_directives,
        "flush_s": load.flush_s,
        "seconds": load.seconds,
        "batches": len(batches),
        "records_accepted": accepted,
        "step_records_accepted": steps_accepted,
        "records_per_second": round(accepted / load.seconds),
        "step_records_per_second": round(steps_accepted / load.seconds),
        "batches_shed_429": shed,
        "batches_failed": failed,
        "sender_errors": [e for s in sent for e in s.errors][:5],
        # Whole: from the load's start to its last window judged. Steady: the load's seconds
        # after every rank's first heartbeat and device sample, over the batches sent then.
        "cpu_whole": cpu_figures(meter[0], meter[-1], accepted, steps_accepted),
        "cpu_steady": steady_cpu(meter, batches),
        "generator_cpu_s": round(sum(s.cpu_s for s in sent), 2),
        "send_lag_s": {"p50": _round(np.percentile(lags, 50)), "p99": _round(np.percentile(lags, 99))}
        if lags.size
        else None,
        "batch_answer_s": {"p50": _round(np.percentile(answer, 50)), "p99": _round(np.percentile(answer, 99))}
        if answer.size
        else None,
        "record_to_judged_s": {"p50": _round(p50), "p99": _round(p99), "poll_s": load.poll_s},
        "step_to_judged_s": {"p50": _round(s50), "p99": _round(s99)},
        "records_never_judged": unjudged,
        "records_sent_after_their_window_was_judged": late,
        "judge_lag_s": {"first_half_max": _round(first_half), "second_half_max": _round(second_half)},
        "pending_windows": {"max": max(pending, default=0), "end": pending[-1] if pending else 0},
        "faults_planted": len(faults),
        "fault_to_incident_s": {
            "p50": _round(np.percentile(to_incident, 50)) if to_incident else None,
            "p99": _round(np.percentile(to_incident, 99)) if to_incident else None,
            "max": _round(max(to_incident)) if to_incident else None,
        },
        "faults_missed_steps": missed,
        "incidents_per_fault": per_fault,
        "other_incidents": [{k: i[k] for k in ("kind", "first_step")} for i in other][:10],
        "sustained": bool(kept_pace and kept_up and shed == 0 and failed == 0),
        "kept_schedule": bool(kept_pace),
        "judge_kept_up": bool(kept_up),
    }


def steady_cpu(
    meter: list[CpuSample], batches: list[tuple[int, int, int, int, float, float, float, int, int]]
) -> dict[str, Any] | None:
    if len(meter) < 4:
        return None  # the load ended before its steady part did
    first, last = meter[1], meter[2]
    inside = [b for b in batches if first.at <= b[5] < last.at and 200 <= b[7] < 300]
    records = sum(b[8] for b in inside)
    steps = sum((b[2] - b[1] + 1) * b[3] for b in inside)
    return cpu_figures(first, last, records, steps)


def judge_lags(watch: Watch, plan: Plan) -> list[tuple[float, float]]:
    """How far the slowest run's judged windows trail the training clock, once warmed up
    (the first windows wait for a full readiness watermark), during the load."""
    warm = plan.started_at + 3 * plan.flush_s + 2
    last = plan.started_at + plan.seconds
    return [(t, (t - plan.started_at) - judged) for t, judged, _ in watch.samples if warm <= t <= last]


def _round(value: Any) -> float | None:
    value = float(value)
    return None if value != value else round(value, 3)


# --- the command ---------------------------------------------------------------------------------


def find_max(args: argparse.Namespace, load: Load, store: Store, workdir: Path) -> dict[str, Any]:
    stages: list[dict[str, Any]] = []
    good, bad = 0, 0
    ranks = load.ranks
    for stage in range(args.max_stages):
        result = run_stage(replace(load, ranks=ranks, seconds=args.sustain_s), fresh_database(store, workdir, stage),
                           workdir / f"stage-{stage}")  # fmt: skip
        print(json.dumps({"stage": stage, **result}), file=sys.stderr, flush=True)
        stages.append(result)
        if result["sustained"]:
            good = max(good, ranks)
        else:
            bad = ranks if bad == 0 else min(bad, ranks)
        if bad and bad - good <= max(load.ranks_per_batch, good // 10):
            break
        ranks = ranks * 2 if not bad else (good + bad) // 2 if good else max(1, bad // 2)
        if ranks in (good, bad):
            break
    return {
        "find_max": True,
        "sustain_s": args.sustain_s,
        "largest_sustained_ranks_per_run": good,
        "largest_sustained_total_ranks": good * load.runs,
        "first_not_sustained_ranks_per_run": bad or None,
        "stages": stages,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--db", help="a store URL to use instead of a throwaway one (at the current schema)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=1024, help="ranks per run (find-max: the first stage's)")
    parser.add_argument("--ranks-per-batch", type=int, default=1, help="ranks whose records share a batch")
    parser.add_argument(
        "--ask-directives", action="store_true",
        help="each post asks for its ranks' directives, as the hook (one rank) and a node relay (several) do",
    )  # fmt: skip
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--senders", type=int, default=1, help="sender processes")
    parser.add_argument("--threads", type=int, default=16, help="posting threads per sender process")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--flush-s", type=float, default=2.0)
    parser.add_argument("--heartbeat-s", type=float, default=5.0)
    parser.add_argument("--device-s", type=float, default=10.0)
    parser.add_argument("--fault-at", type=int, default=20, help="step of the first planted fault (0: none)")
    parser.add_argument("--fault-every", type=int, default=60)
    parser.add_argument("--poll-s", type=float, default=0.1)
    parser.add_argument("--max-lag-s", type=float, default=15.0)
    parser.add_argument("--find-max", action="store_true")
    parser.add_argument("--sustain-s", type=float, default=600.0)
    parser.add_argument("--max-stages", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    for name in ("runs", "ranks", "ranks_per_batch", "replicas", "senders", "threads", "max_stages"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("seconds", "flush_s", "heartbeat_s", "device_s", "poll_s", "sustain_s"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.replicas > 1 and (args.backend == "sqlite" or (args.db and args.db.startswith("sqlite"))):
        parser.error("--replicas over 1 needs PostgreSQL: an SQLite store takes one service process")
    if args.find_max and args.db:
        parser.error("--find-max starts a fresh database per stage: leave out --db")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    # Stopped (a timeout's SIGTERM): unwind, so the database server and the replicas stop too.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))
    load = Load(
        runs=args.runs,
        ranks=args.ranks,
        ranks_per_batch=args.ranks_per_batch,
        ask_directives=args.ask_directives,
        replicas=args.replicas,
        senders=args.senders,
        threads=args.threads,
        seconds=args.seconds,
        flush_s=args.flush_s,
        heartbeat_s=args.heartbeat_s,
        device_s=args.device_s,
        fault_at=args.fault_at,
        fault_every=args.fault_every,
        poll_s=args.poll_s,
        max_lag_s=args.max_lag_s,
    )
    root = Path(os.environ.get("TMPDIR") or tempfile.gettempdir())
    workdir = Path(tempfile.mkdtemp(prefix="rh-fleet-", dir=root))
    try:
        with store_for(args, workdir) as store:
            backend = store.url.get_backend_name()
            if args.find_max:
                result = find_max(args, load, store, workdir)
            else:
                result = run_stage(load, fresh_database(store, workdir, 0), workdir / "stage-0")
            print(json.dumps({"backend": backend, "cpus": os.cpu_count(), **result}, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
