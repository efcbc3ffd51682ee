"""Engine throughput: can one service process keep up with R ranks at one step per second?

For each rank count, posts windows of R step records (plus R/5 heartbeats a second: every
rank beats every 5 s) through the service's ingest path in this process (validation, store,
fold, judge with every step and per-rank policy), on a fresh SQLite store, and measures the
seconds one simulated second of training costs. R is sustained when that is under 1 s.
Prints JSON, including the largest rank count sustained.

    python benchmarks/engine_throughput.py [--ranks 1024 4096 16384 32768] [--windows 8]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from monitor.api.routes import validate_batch
from monitor.config import ServiceConfig
from monitor.service import Service
from monitor.store import migrate, queries
from monitor.store.db import create_store_engine, resolve_url


def window(incarnation: str, ranks: int, attempt: int) -> list[dict[str, Any]]:
    now = time.time()
    return [
        {
            "kind": "step",
            "incarnation": incarnation,
            "rank": rank,
            "attempt": attempt,
            "step": attempt,
            "time": now,
            "node": f"node-{rank // 8:05d}",
            "device_uuid": f"GPU-{rank:06d}",
            "dp_rank": rank,
            "tokens": 4096,
            "loss_sum": 4096 * (2.5 + 0.001 * (rank % 7)),
            "reported_loss": 2.5,
            "grad_norm": 1.0,
            "lr": 3e-4,
            "loss_scale": 65536.0,
            "skipped": False,
            "consumed": attempt * ranks * 8,
            "sample_ids": [attempt * ranks + rank],
            "data_wait_s": 0.001,
            "forward_s": 0.3 + 0.001 * (rank % 5),
            "backward_s": 0.6,
            "optimizer_s": 0.05,
        }
        for rank in range(ranks)
    ]


def heartbeats(incarnation: str, ranks: range, attempt: int) -> list[dict[str, Any]]:
    now = time.time()
    return [
        {
            "kind": "heartbeat",
            "incarnation": incarnation,
            "rank": rank,
            "phase": "forward",
            "phase_since": now,
            "time": now,
            "step": attempt,
            "attempt": attempt,
        }
        for rank in ranks
    ]


def measure(ranks: int, windows: int, workdir: Path) -> dict[str, Any]:
    engine = create_store_engine(resolve_url(str(workdir / f"engine-{ranks}.db"), {}))
    migrate.upgrade(engine)
    service = Service(engine, ServiceConfig())
    with engine.begin() as connection:
        queries.create_run(connection, "bench")
        run_id = int(queries.run_row(connection, "bench").id)
    incarnation = str(uuid.uuid4())
    start = {"kind": "run_start", "incarnation": incarnation, "time": time.time(), "world_size": ranks}
    service.ingest("bench", run_id, validate_batch(json.dumps({"records": [start]}).encode(), 10**6).records)
    seconds = []
    per_second = max(1, ranks // 5)
    for attempt in range(1, windows + 1):
        # One simulated second: a window from every rank and a fifth of the ranks' heartbeats,
        # in batches of at most 50,000 records (the service's batch limit).
        first = (attempt * per_second) % ranks
        beats = heartbeats(incarnation, range(first, min(ranks, first + per_second)), attempt)
        bodies = [
            json.dumps({"records": chunk}).encode()
            for chunk in _chunks(window(incarnation, ranks, attempt) + beats)
        ]
        started = time.perf_counter()
        for body in bodies:
            batch = validate_batch(body, 50_000)
            service.ingest("bench", run_id, batch.records)
        seconds.append(time.perf_counter() - started)
    engine.dispose()
    steady = sorted(seconds[1:]) or seconds
    median = steady[len(steady) // 2]
    return {
        "ranks": ranks,
        "windows": windows,
        "seconds_per_step_median": round(median, 3),
        "seconds_per_step_max": round(max(steady), 3),
        "sustained": max(steady) < 1.0,
    }


def _chunks(records: list[dict[str, Any]], size: int = 50_000) -> list[list[dict[str, Any]]]:
    return [records[i : i + size] for i in range(0, len(records), size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--windows", type=int, default=6)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rh-engine-", dir=os.environ.get("TMPDIR")))
    results = [measure(r, args.windows, workdir) for r in args.ranks]
    sustained = [r["ranks"] for r in results if r["sustained"]]
    print(json.dumps({"results": results, "largest_sustained_ranks": max(sustained, default=0)}, indent=2))


if __name__ == "__main__":
    main()
