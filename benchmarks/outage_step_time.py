"""The training step while the service is gone, against the same step while it is up (a
benchmark, not a test).

One hooked training (the ``hook_overhead`` model: about 20 ms a step on one core) sends to a
real ``runhealth serve`` on a fixed loopback port. The service alternates between up and down:
killed with SIGKILL and started again on the same store and port (``--fault kill``), or paused
with SIGSTOP and resumed (``--fault stop``: connections are accepted by the kernel and never
answered, so every request waits for its timeout). Each phase lasts ``--phase-s`` seconds and
the cycle repeats ``--cycles`` times, so the up and down steps are measured side by side in one
run. Each step is labelled by the phase it started in. With two or more cores the training is
pinned to the first and the service to the others: in production the service runs elsewhere,
and here its CPU while it is up would otherwise be charged to the up phases' steps.

Printed as JSON: per phase, the median, p95 and mean step time; the ratio of the down phases'
median to the up phases'; and at the end, once the last up phase has drained the spool, the
windows the store holds against those the training ran (none may be missing).

    python benchmarks/outage_step_time.py [--fault kill|stop] [--cycles 3] [--phase-s 8] [--spool-dir D]

``--spool-dir``: where the hook spools (default: a temporary folder), e.g. a small tmpfs that
fills during the outage (``mount -t tmpfs -o size=200k tmpfs D``): then batches wait in memory
and the counters say how many were spooled, dropped or dead-lettered.

Target (issue 17): the median step during an outage within 2% of the median outside it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hook_overhead import BenchmarkConfig, Timings, build_training, hooked_step, make_batches  # noqa: E402

from collectors import RunHealth  # noqa: E402

CPUS = sorted(os.sched_getaffinity(0))
TRAINER_CPUS = set(CPUS[:1])
SERVICE_CPUS = set(CPUS[1:]) or TRAINER_CPUS


def pin(cpus: set[int]) -> None:
    os.sched_setaffinity(0, cpus)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Service:
    """``runhealth serve`` on one store and port, killed, paused and started again."""

    def __init__(self, root: Path, port: int, admin: str) -> None:
        self.root, self.port, self.admin = root, port, admin
        self.db = root / "store.db"
        self.process: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("RUNHEALTH_")}
        environ.update(RUNHEALTH_ADMIN_TOKEN=self.admin, PYTHONPATH=str(REPO))
        command = [sys.executable, "-m", "monitor", "serve", "--db", str(self.db), "--port", str(self.port)]
        with open(self.root / "serve.log", "ab") as log:
            self.process = subprocess.Popen(
                command, env=environ, stdout=log, stderr=log, preexec_fn=lambda: pin(SERVICE_CPUS)
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"serve did not answer on {self.url} within 60 s: see {self.root}/serve.log")

    def down(self, fault: str) -> None:
        assert self.process is not None
        if fault == "stop":
            self.process.send_signal(signal.SIGSTOP)
            return
        self.process.kill()
        self.process.wait(30)

    def up(self, fault: str) -> None:
        assert self.process is not None
        if fault == "stop":
            self.process.send_signal(signal.SIGCONT)
        else:
            self.start()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(30)


def stored_windows(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
        return int(connection.execute("SELECT count(*) FROM step_records").fetchone()[0])


def summary(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    return {
        "steps": len(values),
        "median_ms": round(1e3 * statistics.median(ordered), 3),
        "p95_ms": round(1e3 * ordered[int(0.95 * (len(ordered) - 1))], 3),
        "mean_ms": round(1e3 * statistics.fmean(ordered), 3),
    }


def run(fault: str, cycles: int, phase_s: float, workdir: Path, spool: Path | None = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    pin(TRAINER_CPUS)
    config = BenchmarkConfig()
    training, batches = build_training(config), make_batches(config, 64)
    service = Service(workdir, free_port(), secrets.token_urlsafe(16))
    service.start()
    try:
        token = httpx.post(f"{service.url}/v1/runs", json={"name": "outage"}, timeout=30,
                           headers={"authorization": f"Bearer {service.admin}"}).json()["token"]  # fmt: skip
        environ = {"RUNHEALTH_URL": service.url, "RUNHEALTH_TOKEN": token, "RUNHEALTH_RUN": "outage",
                   "RUNHEALTH_SPOOL_DIR": str(spool or workdir / "spool")}  # fmt: skip
        steps: dict[str, list[float]] = {"up": [], "down": []}
        ran = 0
        with RunHealth(model=training.model, optimizer=training.optimizer, environ=environ) as rh:
            timings = Timings()
            for _ in range(config.warmup):  # the sender settles to the step's pace
                hooked_step(training, batches[ran % len(batches)], rh, timings)
                ran += 1
            for phase in ["up", "down"] * cycles + ["up"]:
                if phase == "down":
                    service.down(fault)
                elif ran > config.warmup:
                    service.up(fault)
                ends = time.monotonic() + phase_s
                while time.monotonic() < ends:
                    started = time.perf_counter()
                    hooked_step(training, batches[ran % len(batches)], rh, timings)
                    steps[phase].append(time.perf_counter() - started)
                    ran += 1
            counters = dict(rh.counters)
        time.sleep(3.0)  # the last batch the close sent, committed
        stored = stored_windows(service.db)
    finally:
        service.stop()
    up, down = summary(steps["up"]), summary(steps["down"])
    return {
        "fault": fault,
        "cycles": cycles,
        "trainer_cpus": sorted(TRAINER_CPUS),
        "service_cpus": sorted(SERVICE_CPUS),
        "phase_s": phase_s,
        "up": up,
        "down": down,
        "median_ratio_down_over_up": round(down["median_ms"] / up["median_ms"], 4),
        "mean_ratio_down_over_up": round(down["mean_ms"] / up["mean_ms"], 4),
        "windows_ran": ran,
        "windows_stored": stored,
        "hook_counters": counters,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=("kill", "stop"), default="kill")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--phase-s", type=float, default=8.0)
    parser.add_argument("--spool-dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="runhealth-outage-", dir=os.environ.get("TMPDIR")) as workdir:
        result = run(args.fault, args.cycles, args.phase_s, Path(workdir), args.spool_dir)
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
