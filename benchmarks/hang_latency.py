"""How soon a rank stuck in a training phase is named, with the service's and the hook's default
settings (a benchmark, not a test).

    python benchmarks/hang_latency.py [--repeats 2]

The scenario corpus's hung-rank runs (``benchmarks/scenarios.py``: 4 gloo ranks of the demo's
character-level transformer, rank 2 or 1 stops in its forward at update 60 or 77, the others
wait in the all-reduce), against a real ``runhealth serve`` with nothing set but its admin
token: 5 s heartbeats, the 5 s hang check, the phase timeouts learned from the run's own
windows (``policies.hangs.HangConfig``). The delay is the stuck rank's time in its phase when
the hang was named (its heartbeat's ``phase_since`` to the finding, the rank's clock), printed
as JSON with the timeout that applied and the run's median window.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scenarios import Scenario, _query, corpus, run_scenario


def median_window_s(db: Path) -> float | None:
    times = [r["last_time"] for r in _query(db, "SELECT last_time FROM step_summaries ORDER BY attempt")]
    gaps = [b - a for a, b in itertools.pairwise(times) if b > a]
    return round(statistics.median(gaps), 4) if gaps else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rh-hangs-", dir=os.environ.get("TMPDIR")))
    hung: list[Scenario] = [s for s in corpus() if s.hang]
    rows = []
    for repeat in range(args.repeats):
        for scenario in hung:
            defaults = replace(scenario, name=f"{scenario.name}-{repeat}", service_settings=())
            outcome = run_scenario(defaults, workdir)
            row = {
                "case": defaults.name,
                "named_after_s": outcome.hang_in_phase_s,
                "timeout_s": outcome.hang_timeout_s,
                "median_window_s": median_window_s(workdir / defaults.name / "store.db"),
                "error": outcome.error,
            }
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    named = [r["named_after_s"] for r in rows if r["named_after_s"] is not None]
    summary = {
        "cases": rows,
        "named": len(named),
        "of": len(rows),
        "max_named_after_s": max(named, default=None),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
