"""Detection quality over a labeled corpus, printed as JSON (a benchmark, not a test).

Per kind: recall (positive cases caught), false incidents per 100,000 clean steps, and
detection delay in steps (and in logged rows, for sparse excerpts) from the label's first
step to the step of the first finding of the incident that caught it.

    python benchmarks/detection.py [--only real]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from realcurves import Case, bigscience_cases, clean_controls  # noqa: E402

from policies.replay import replay_series  # noqa: E402
from policies.series import SeriesConfig  # noqa: E402


def score_case(case: Case, config: SeriesConfig) -> dict[str, Any]:
    result = replay_series(case.points, config)
    steps = [p.step for p in case.points]
    incidents = [i.view for i in result.incidents]
    caught, false = None, []
    for view in incidents:
        lo, hi = case.label or (0, -1)
        if case.positive and view.first_step <= hi and view.last_step >= lo:
            caught = caught or view
        else:
            false.append({"kind": view.kind, "first_step": view.first_step})
    row: dict[str, Any] = {
        "case": case.name,
        "kind": case.kind,
        "positive": case.positive,
        "split": case.split,
        "steps": len(steps),
        "false_incidents": false,
        "note": case.note,
    }
    if case.positive and case.label:
        row["caught"] = caught is not None
        if caught is not None:
            first_finding = min(f.step for f, key in result.findings if key == caught.key)
            row["incident_kind"] = caught.kind
            row["delay_steps"] = max(0, first_finding - case.label[0])
            row["delay_rows"] = sum(1 for s in steps if case.label[0] <= s < first_finding)
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["positive"]:
            by_kind[row["kind"]].append(row)
    clean_steps = sum(r["steps"] for r in rows if not r["positive"])
    false = sum(len(r["false_incidents"]) for r in rows)
    kinds = {}
    for kind, cases in by_kind.items():
        delays = [c["delay_steps"] for c in cases if c.get("caught")]
        kinds[kind] = {
            "cases": len(cases),
            "recall": sum(bool(c.get("caught")) for c in cases) / len(cases),
            "delay_steps_median": statistics.median(delays) if delays else None,
            "delay_steps_max": max(delays) if delays else None,
        }
    return {
        "positive_cases": sum(len(c) for c in by_kind.values()),
        "caught": sum(bool(c.get("caught")) for cs in by_kind.values() for c in cs),
        "clean_steps": clean_steps,
        "false_incidents": false,
        "false_incidents_per_100k_clean_steps": round(1e5 * false / clean_steps, 3) if clean_steps else None,
        "by_kind": kinds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=["real"], default="real")
    parser.add_argument("--cases", action="store_true", help="print every case, not only the summary")
    args = parser.parse_args()
    config = SeriesConfig()
    corpora = {"real_curves": clean_controls() + bigscience_cases()}
    report: dict[str, Any] = {}
    for name, cases in corpora.items():
        rows = [score_case(case, config) for case in cases]
        report[name] = {"summary": summarize(rows)}
        if args.cases:
            report[name]["cases"] = rows
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
