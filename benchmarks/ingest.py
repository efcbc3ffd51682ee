"""Ingest throughput: batches of 1,000 step records posted to a running ``runhealth serve``.

Starts its own service on a fresh SQLite file (or uses --url with --token), posts batches
from one client, and prints records per second and batch latency percentiles as JSON.
Server and client share the machine, as they do in the embedded default.

    python benchmarks/ingest.py [--batches 200] [--batch-size 1000] [--ranks 64]
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
from pathlib import Path

import httpx


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


def start_service(workdir: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    token = secrets.token_urlsafe(24)
    port_file = workdir / "port"
    env = {**os.environ, "RUNHEALTH_ADMIN_TOKEN": token}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "monitor",
            "serve",
            "--db",
            str(workdir / "bench.db"),
            "--port",
            "0",
            "--port-file",
            str(port_file),
        ],
        env=env,
    )
    deadline = time.time() + 60
    while not port_file.exists():
        if process.poll() is not None or time.time() > deadline:
            raise SystemExit("runhealth serve did not start")
        time.sleep(0.05)
    return process, f"http://127.0.0.1:{port_file.read_text().strip()}", token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url")
    parser.add_argument("--token", help="admin token of --url's service")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=64)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="rh-bench-", dir=os.environ.get("TMPDIR")))
    process = None
    if args.url:
        url, token = args.url, args.token or ""
    else:
        process, url, token = start_service(workdir)
    try:
        run = f"bench-{uuid.uuid4().hex[:8]}"
        headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            client.post("/v1/runs", json={"name": run}).raise_for_status()
            incarnation = str(uuid.uuid4())
            bodies = [
                json.dumps(
                    {"records": step_records(incarnation, args.ranks, b * args.batch_size, args.batch_size)}
                ).encode()
                for b in range(args.batches)
            ]
            latencies = []
            started = time.perf_counter()
            for body in bodies:
                t0 = time.perf_counter()
                client.post(f"/v1/runs/{run}/records", content=body).raise_for_status()
                latencies.append(time.perf_counter() - t0)
            elapsed = time.perf_counter() - started
            stored = len(client.get(f"/v1/runs/{run}/steps", params={"limit": 10**9}).json()["steps"])
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
    latencies.sort()
    records = args.batches * args.batch_size
    print(
        json.dumps(
            {
                "backend": "sqlite" if not args.url else url,
                "records": records,
                "batch_size": args.batch_size,
                "ranks": args.ranks,
                "seconds": round(elapsed, 3),
                "records_per_second": round(records / elapsed),
                "batch_latency_p50_ms": round(statistics.median(latencies) * 1000, 2),
                "batch_latency_p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1000, 2),
                "windows_stored": stored,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
