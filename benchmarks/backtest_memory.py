"""Peak memory and wall time of ``runhealth backtest`` on a large file (a benchmark, not a test).

    python benchmarks/backtest_memory.py [--rows 10000000] [--nul-bytes 0] [--keep]

Writes a CSV of ``--rows`` rows (``step,loss``: a slowly decaying loss with noise, about 16 bytes
a row) under ``$TMPDIR``, runs ``python -m monitor backtest FILE --json`` on it under
``/usr/bin/time -v`` and prints JSON: the file's size, the command's exit status, wall time and
peak RSS. With ``--nul-bytes N`` it does the same for a file of N NUL bytes (what a crashed
writer's preallocated file holds), which must fail in one line. The files are deleted after
unless ``--keep``.

Measured (2 cores shared with another engineer's test suite, polars 2.1), peak RSS and wall time:

- 10,000,000 rows (159 MB). Before (``pl.read_csv`` of the whole file, a tuple of points):
  11.2 GiB, then a MemoryError at a 14 GB address-space cap after 2:17 (the issue: OOM-killed
  at 8.2 GB). After (read as judged): 193.5 MB, exit 0 in 10:14.
- 1,000,000 rows (15 MB), after: 197.1 MB, exit 0 in 1:48: the peak does not grow with the file.
- 2 GiB of NUL bytes. Before: 8.2 GiB and a Rust panic after 1:18. After: 110.5 MB, exit 2 in
  2.7 s with one line (``a NUL byte at line 1 (byte 0): not a text file``).

The wall time is the policies' (about 60 us a step on one core); the reading takes seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def write_curve(path: Path, rows: int, chunk: int = 1_000_000) -> None:
    """``step,loss`` rows: 2 + 8 exp(-step / (rows / 4)) plus 1% noise, written in chunks."""
    rng = np.random.default_rng(0)
    with path.open("w") as out:
        out.write("step,loss\n")
        for start in range(1, rows + 1, chunk):
            steps = np.arange(start, min(start + chunk, rows + 1))
            loss = 2.0 + 8.0 * np.exp(-steps / (rows / 4)) + rng.normal(0.0, 0.01, len(steps))
            out.writelines(f"{s},{v:.5f}\n" for s, v in zip(steps.tolist(), loss.tolist(), strict=True))


def write_nul(path: Path, size: int, chunk: int = 1 << 24) -> None:
    with path.open("wb") as out:
        for start in range(0, size, chunk):
            out.write(bytes(min(chunk, size - start)))


def measure(path: Path) -> dict[str, object]:
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "monitor", "backtest", str(path), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    stats = done.stderr

    def field(name: str) -> str:
        found = re.search(rf"{re.escape(name)}: (.+)", stats)
        return found.group(1).strip() if found else "?"

    error = [line for line in stats.splitlines() if line.startswith("runhealth:")]
    document = json.loads(done.stdout) if done.returncode == 0 else None
    return {
        "file": path.name,
        "bytes": path.stat().st_size,
        "exit": int(field("Exit status")) if field("Exit status").isdigit() else done.returncode,
        "wall": field("Elapsed (wall clock) time (h:mm:ss or m:ss)"),
        "peak_rss_mb": round(int(field("Maximum resident set size (kbytes)")) / 1024, 1),
        "steps": document["steps"] if document else None,
        "incidents": len(document["incidents"]) if document else None,
        "error_lines": error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--nul-bytes", type=int, default=0, help="also a file of this many NUL bytes")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="backtest-memory-"))
    results = []
    try:
        if args.rows:
            curve = folder / f"curve-{args.rows}.csv"
            write_curve(curve, args.rows)
            results.append(measure(curve))
        if args.nul_bytes:
            nul = folder / "nul.csv"
            write_nul(nul, args.nul_bytes)
            results.append(measure(nul))
    finally:
        if not args.keep:
            for path in folder.iterdir():
                path.unlink()
            folder.rmdir()
    print(json.dumps(results, indent=1))
    if args.keep:
        print(f"kept {folder}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("CI", "true")
    main()
