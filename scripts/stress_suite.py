"""Run tests with the machine loaded: a test of the tests' timing.

Starts ``--busy`` processes that each keep one core busy (a Python loop), runs pytest (by
default the end-to-end tests, ``-m slow``) beside them, ends each busy process by its PID, and
prints one JSON object: the pytest counts, its exit status, wall time and the load average
sampled every few seconds. CI runs on two cores with other work on them; an end-to-end test
that waits for a step count instead of an event passes on an idle machine and fails here.

    python scripts/stress_suite.py [--busy 2] [-- PYTEST_ARGS...]

The exit status is pytest's. Temp files go under ``$TMPDIR`` (the project's ``.tmp`` when
unset), as everywhere in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUSY = "while True:\n    pass\n"
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")


def start_busy(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(count)]


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait(30)


def sample_load(samples: list[float], done: threading.Event, every_s: float = 5.0) -> None:
    while not done.wait(every_s):
        samples.append(os.getloadavg()[0])


def counts(output: str) -> dict[str, int]:
    """The numbers of pytest's last summary line (``3 passed, 1 failed in 12.0s``)."""
    lines = [line for line in output.splitlines() if " in " in line and COUNTS.search(line)]
    if not lines:
        return {}
    return {
        kind.rstrip("s") if kind.startswith("error") else kind: int(n)
        for n, kind in COUNTS.findall(lines[-1])
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the tests (default 2)")
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs (default: -m slow)")
    args = parser.parse_args()
    tmp = Path(os.environ.get("TMPDIR") or REPO / ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    environ = {**os.environ, "TMPDIR": str(tmp), "CI": "true", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--basetemp={tmp / 'stress-pytest'}", *(args.pytest_args or ["-m", "slow"])]  # fmt: skip
    samples: list[float] = []
    done = threading.Event()
    sampler = threading.Thread(target=sample_load, args=(samples, done), daemon=True)
    busy = start_busy(args.busy)
    started = time.monotonic()
    try:
        sampler.start()
        result = subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True, check=False)
    finally:
        done.set()
        stop(busy)
    sys.stderr.write(result.stdout[-4000:] + result.stderr[-2000:])
    report = {
        "busy_processes": args.busy,
        "cores": os.cpu_count(),
        "command": " ".join(command[1:]),
        "returncode": result.returncode,
        "counts": counts(result.stdout),
        "failed_tests": re.findall(r"^FAILED (\S+)", result.stdout, re.MULTILINE),
        "wall_s": round(time.monotonic() - started, 1),
        "load_average_1m": {
            "mean": round(sum(samples) / len(samples), 2) if samples else None,
            "max": max(samples, default=None),
        },
    }
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
