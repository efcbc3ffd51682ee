"""Scrape cost of ``/metrics`` for a large run: 16,384 ranks on 2,048 nodes of 8 GPUs and 8 ports.

Builds a store through the service's own ingest path (windows of every rank, heartbeats, two
device and link samples per device and port, checkpoints), adds a long history of judged windows
straight into the store, then times scrapes: the collector alone (store reads and families) and
the whole text exposition, with device and port counters per device and port, per node (what
"auto" picks at this size) and off. Prints JSON.

    python benchmarks/metrics_scrape.py [--ranks 16384] [--windows 25] [--history 200000] [--db URL]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from prometheus_client.exposition import generate_latest

from monitor.config import ServiceConfig
from monitor.ingest.schemas import BatchIn
from monitor.observe.metrics import MetricsConfig, metrics_registry
from monitor.service import Service
from monitor.store import migrate, models, queries
from monitor.store.db import create_store_engine, resolve_url

GPUS_PER_NODE = 8


def step_records(incarnation: str, ranks: int, attempt: int, now: float) -> list[dict[str, Any]]:
    return [
        {
            "kind": "step",
            "incarnation": incarnation,
            "rank": rank,
            "attempt": attempt,
            "step": attempt,
            "time": now,
            "node": f"node-{rank // GPUS_PER_NODE:04d}",
            "device_uuid": f"GPU-{rank:05d}",
            "tokens": 4096,
            "loss_sum": 2.5 * 4096,
            "grad_norm": 1.0,
            "lr": 3e-4,
            "loss_scale": 65536.0,
            "skipped": False,
            "data_wait_s": 0.001,
            "forward_s": 0.010 * (1.3 if rank % 1000 == 7 else 1.0),
            "backward_s": 0.020,
            "optimizer_s": 0.005,
        }
        for rank in range(ranks)
    ]


def device_samples(ranks: int, seq: int, now: float) -> list[dict[str, Any]]:
    return [
        {
            "kind": "device_sample",
            "node": f"node-{rank // GPUS_PER_NODE:04d}",
            "device_uuid": f"GPU-{rank:05d}",
            "seq": seq,
            "time": now,
            "rank": rank,
            "counters": {
                "clock_event_ns": {
                    name: seq * 1000
                    for name in (
                        "sw_power_cap",
                        "sync_boost",
                        "sw_thermal_slowdown",
                        "hw_thermal_slowdown",
                        "hw_power_brake_slowdown",
                    )
                },
                "ecc": {"volatile": {"corrected": 0, "uncorrected": 0}},
                "pcie_replay": 0,
                "nvlink": {
                    str(link): {"replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 0}
                    for link in range(18)
                },
                "remapped_rows": {"corrected": 0, "uncorrected": 0, "pending": False, "failure": False},
            },
        }
        for rank in range(ranks)
    ]


def link_samples(nodes: int, ports: int, seq: int, now: float) -> list[dict[str, Any]]:
    return [
        {
            "kind": "link_sample",
            "node": f"node-{node:04d}",
            "device": f"mlx5_{port}",
            "port": 1,
            "seq": seq,
            "time": now,
            "state": "ACTIVE",
            "counters": {"symbol_error": 0, "link_downed": 0, "link_error_recovery": 0, "port_rcv_errors": 0},
        }
        for node in range(nodes)
        for port in range(ports)
    ]


def post(service: Service, run: str, run_id: int, records: list[dict[str, Any]]) -> None:
    for start in range(0, len(records), 20_000):
        batch = BatchIn.model_validate_json(json.dumps({"records": records[start : start + 20_000]}))
        service.ingest(run, run_id, batch.records)


def add_history(engine: sa.Engine, run_id: int, windows: int) -> None:
    """Judged windows of an earlier incarnation, as months of training leave behind."""
    table = models.table_of(models.StepSummary)
    incarnation = str(uuid.uuid4())
    rows = [
        {
            "run_id": run_id,
            "incarnation": incarnation,
            "attempt": attempt,
            "step": attempt,
            "ranks_reported": 16384,
            "tokens": 4096 * 16384,
            "loss_sum": 2.5 * 4096 * 16384,
            "grad_norm": 1.0,
            "lr": 3e-4,
            "loss_scale": 65536.0,
            "skipped_ranks": 0,
            "first_time": 1e9 + attempt,
            "last_time": 1e9 + attempt,
            "judged": True,
            "late_records": 0,
            "reported_loss_count": 0,
            "rank_mean_count": 0,
        }
        for attempt in range(1, windows + 1)
    ]
    with engine.begin() as connection:
        for start in range(0, len(rows), 50_000):
            connection.execute(table.insert(), rows[start : start + 50_000])


def timed(function: Any, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=16_384)
    parser.add_argument("--ports-per-node", type=int, default=8)
    parser.add_argument(
        "--windows", type=int, default=25, help="windows of every rank (>= 20 for stragglers)"
    )
    parser.add_argument("--history", type=int, default=200_000, help="older judged windows in the store")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--db", help="SQLAlchemy URL of an empty store (default: a new SQLite file)")
    args = parser.parse_args()

    db = args.db or str(Path(tempfile.mkdtemp(dir=os.environ.get("TMPDIR"))) / "big.db")
    engine = create_store_engine(resolve_url(db, {}))
    migrate.upgrade(engine)
    service = Service(engine, ServiceConfig())
    with engine.begin() as connection:
        queries.create_run(connection, "big")
        run_id = int(queries.run_row(connection, "big").id)
    add_history(engine, run_id, args.history)
    nodes = args.ranks // GPUS_PER_NODE
    incarnation = str(uuid.uuid4())
    built = time.perf_counter()
    now = time.time()
    post(
        service,
        "big",
        run_id,
        [{"kind": "run_start", "incarnation": incarnation, "time": now, "world_size": args.ranks}],
    )
    for attempt in range(1, args.windows + 1):
        post(service, "big", run_id, step_records(incarnation, args.ranks, attempt, now + attempt))
    beats = [
        {
            "kind": "heartbeat",
            "incarnation": incarnation,
            "rank": r,
            "phase": "forward",
            "phase_since": now,
            "time": now,
        }
        for r in range(args.ranks)
    ]
    post(service, "big", run_id, beats)
    for seq in (1, 2):
        post(service, "big", run_id, device_samples(args.ranks, seq, now + 10 * seq))
        post(service, "big", run_id, link_samples(nodes, args.ports_per_node, seq, now + 10 * seq))
    build_s = time.perf_counter() - built

    registry = metrics_registry(service)
    report: dict[str, Any] = {
        "backend": engine.dialect.name,
        "ranks": args.ranks,
        "nodes": nodes,
        "devices": args.ranks,
        "ports": nodes * args.ports_per_node,
        "windows_in_store": args.history + args.windows,
        "build_seconds": round(build_s, 1),
    }
    grains = {
        "per_device_and_port": MetricsConfig(device_series="device", link_series="port"),
        "auto_per_node": MetricsConfig(),
        "off": MetricsConfig(device_series="off", link_series="off"),
    }
    for label, config in grains.items():
        service.config = replace(service.config, metrics=config)
        text = generate_latest(registry)
        collect = timed(lambda: [f.samples for f in registry.collect()], args.repeat)
        scrape = timed(lambda: generate_latest(registry), args.repeat)
        report[label] = {
            "series": sum(1 for line in text.splitlines() if line and not line.startswith(b"#")),
            "bytes": len(text),
            "collect_seconds_median": round(statistics.median(collect), 3),
            "scrape_seconds_median": round(statistics.median(scrape), 3),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
