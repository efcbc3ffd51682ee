"""Detection quality over a labeled corpus, printed as JSON (a benchmark, not a test).

Per kind: recall (positive cases caught), false incidents per 100,000 clean steps, and
detection delay in steps (and in logged rows, for sparse excerpts) from the label's first
step to the step of the first finding of the incident that caught it.

    python benchmarks/detection.py [--only real|scenarios|all] [--scenario NAME] [--cases]
    python benchmarks/detection.py --stragglers [--clean-steps 3000] [--scenario NAME]

``--stragglers``: straggler detection alone, on 4-rank gloo runs of the scenario trainer's small
task (``sequence``: steps of a few milliseconds) with the machine loaded by two busy processes:
false straggler incidents over a long clean run, and the steps until a rank that waits (sleeps)
30% or 10% of its step, inside its step or in its loader, is named.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from realcurves import Case, Event, added_cases, bigscience_cases, clean_controls, heldout_cases
from scenarios import Outcome, Scenario, run_corpus, run_scenario

from policies.backtest import backtest_series
from policies.series import SeriesConfig
from policies.types import Finding


def score_case(case: Case, config: SeriesConfig) -> dict[str, Any]:
    result = backtest_series(case.points, config)
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
        "set": case.set,
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


def score_stream(case: Case, config: SeriesConfig) -> list[dict[str, Any]]:
    """A stream with several labeled events (``case.events``): one row for the stream (its steps
    and its false incidents: those with no finding inside a labeled event), then one row per
    positive event (caught: a finding of that event's incarnation inside its steps). An incident
    whose findings fall inside a benign (positive 0) event is false."""
    result = backtest_series(case.points, config)

    def inside(finding: Finding, event: Event) -> bool:
        same = event.incarnation is None or finding.incarnation == event.incarnation
        return same and event.lo <= finding.step <= event.hi

    positives = [e for e in case.events if e.positive]
    views = {i.view.key: i.view for i in result.incidents}
    caught_keys = {
        key for f, key in result.findings if key is not None and any(inside(f, e) for e in positives)
    }
    false = [
        {"kind": views[key].kind, "first_step": views[key].first_step}
        for key in sorted(views)
        if key not in caught_keys
    ]
    rows: list[dict[str, Any]] = [
        {
            "case": case.name,
            "series": case.name,
            "kind": "stream",
            "positive": False,
            "split": case.split,
            "set": case.set,
            "steps": len(case.points),
            "false_incidents": false,
            "note": case.note,
        }
    ]
    for event in positives:
        first = next(((f, key) for f, key in result.findings if key is not None and inside(f, event)), None)
        row: dict[str, Any] = {
            "case": f"{case.name}:{event.lo}",
            "series": case.name,
            "kind": event.kind,
            "positive": True,
            "split": case.split,
            "set": case.set,
            "steps": 0,
            "false_incidents": [],
            "caught": first is not None,
        }
        if first is not None:
            finding, key = first
            row["incident_kind"] = views[key].kind
            row["delay_steps"] = max(0, finding.step - event.lo)
            row["delay_rows"] = sum(
                1
                for p in case.points
                if p.incarnation == finding.incarnation and event.lo <= p.step < finding.step
            )
        rows.append(row)
    return rows


def score_streams(cases: list[Case], config: SeriesConfig) -> list[dict[str, Any]]:
    """Rows of a set of streams: a labeled stream event by event, a clean one as one case."""
    return [
        row
        for case in cases
        for row in (score_stream(case, config) if case.events else [score_case(case, config)])
    ]


def by_series(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per series: steps, false incidents (and per 100,000 steps), positives caught, delays."""
    out: dict[str, Any] = {}
    for row in rows:
        name = row.get("series", row["case"])
        entry = out.setdefault(
            name, {"steps": 0, "false_incidents": 0, "positives": 0, "caught": 0, "delay_steps": []}
        )
        entry["steps"] += row["steps"]
        entry["false_incidents"] += len(row["false_incidents"])
        if row["positive"]:
            entry["positives"] += 1
            entry["caught"] += bool(row.get("caught"))
            if row.get("caught"):
                entry["delay_steps"].append(row["delay_steps"])
    for entry in out.values():
        steps = entry["steps"]
        entry["false_per_100k_steps"] = round(1e5 * entry["false_incidents"] / steps, 3) if steps else None
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["positive"]:
            by_kind[row["kind"]].append(row)
    # Clean steps: the clean runs, plus the steps of fault runs before their fault.
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
        timeouts = [c["delay_timeouts"] for c in cases if c.get("delay_timeouts") is not None]
        if timeouts:
            kinds[kind]["delay_learned_timeouts_max"] = max(timeouts)
    return {
        "positive_cases": sum(len(c) for c in by_kind.values()),
        "caught": sum(bool(c.get("caught")) for cs in by_kind.values() for c in cs),
        "clean_steps": clean_steps,
        "false_incidents": false,
        "false_incidents_per_100k_clean_steps": round(1e5 * false / clean_steps, 3) if clean_steps else None,
        "by_kind": kinds,
        "errors": [r["case"] for r in rows if r.get("error")],
    }


def score_scenario(outcome: Outcome) -> dict[str, Any]:
    """A planted fault is caught by an incident of its kind opened at or after its first
    evidence; every other incident is false."""
    scenario = outcome.scenario
    caught = None
    false = []
    for incident in outcome.incidents:
        evidence_step = scenario.first_evidence
        if (
            scenario.kind
            and caught is None
            and incident["kind"] == scenario.kind
            and incident["last_step"] >= evidence_step - 1
        ):
            caught = incident
        else:
            false.append({"kind": incident["kind"], "first_step": incident["first_step"]})
    row: dict[str, Any] = {
        "case": scenario.name,
        "kind": scenario.kind or "clean",
        "positive": scenario.kind is not None,
        "split": scenario.split,
        "steps": outcome.steps,
        "world": scenario.world,
        "false_incidents": false,
        "error": outcome.error,
    }
    if scenario.kind:
        row["caught"] = caught is not None
        if caught is not None:
            detected = (
                caught["detected_step"] if caught["detected_step"] is not None else caught["first_step"]
            )
            row["delay_steps"] = max(0, detected - scenario.first_evidence)
            row["first_step"] = caught["first_step"]
        if scenario.hang and outcome.hang_detected_after_s is not None and outcome.hang_timeout_s:
            row["delay_timeouts"] = round(outcome.hang_detected_after_s / outcome.hang_timeout_s, 2)
    return row


WAITING_RANK = 2
WAIT_FROM = 100


def straggler_corpus(clean_steps: int) -> list[Scenario]:
    """A long clean run, then one rank waiting 30% and 10% of its step from update 100 on,
    inside its step and in its loader."""
    clean = Scenario("stragglers-clean", None, 0, "stragglers", steps=clean_steps, task="sequence")
    waits = [
        Scenario(
            f"stragglers-wait_{int(fraction * 100)}pct_{where}",
            "straggler",
            WAIT_FROM,
            "stragglers",
            args=(
                "--wait",
                f"{WAITING_RANK}:{fraction}:{WAIT_FROM}" + (":data" if where == "loader" else ""),
            ),
            steps=WAIT_FROM + 150,
            task="sequence",
        )
        for fraction in (0.30, 0.10)
        for where in ("step", "loader")
    ]
    return [clean, *waits]


@contextmanager
def busy_processes(count: int) -> Iterator[list[int]]:
    """``count`` processes that keep a core busy (``yes``), killed by their PIDs afterwards."""
    busy = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(count)]
    try:
        yield [process.pid for process in busy]
    finally:
        for process in busy:
            process.kill()
            process.wait(10)


def score_straggler_run(outcome: Outcome) -> dict[str, Any]:
    """Caught: a straggler incident naming the waiting rank, detected at or after the wait
    began. Every other incident is false (a straggler one counts as a false straggler)."""
    scenario = outcome.scenario
    caught, false = None, []
    for incident in sorted(outcome.incidents, key=lambda i: i["detected_step"] or i["first_step"]):
        detected = (
            incident["detected_step"] if incident["detected_step"] is not None else incident["first_step"]
        )
        named = WAITING_RANK in (incident["ranks"] or [])
        if (
            scenario.kind
            and caught is None
            and incident["kind"] == "straggler"
            and named
            and detected >= WAIT_FROM
        ):
            caught = {"delay_steps": detected - WAIT_FROM, "severity": incident["severity"]}
        else:
            false.append(
                {"kind": incident["kind"], "first_step": incident["first_step"], "ranks": incident["ranks"]}
            )
    return {
        "case": scenario.name,
        "steps": outcome.steps,
        "seconds": round(outcome.seconds),
        "caught": caught,
        "false_incidents": false,
        "false_stragglers": sum(1 for f in false if f["kind"] == "straggler"),
        "error": outcome.error,
    }


def straggler_report(clean_steps: int, only: str | None) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="rh-stragglers-", dir=os.environ.get("TMPDIR")))
    rows = []
    with busy_processes(2) as pids:
        print(f"  busy processes {pids}; stores under {workdir}", file=sys.stderr)
        for scenario in straggler_corpus(clean_steps):
            if only and only not in scenario.name:
                continue
            row = score_straggler_run(run_scenario(scenario, workdir))
            print(f"  {json.dumps(row)}", file=sys.stderr)
            rows.append(row)
    clean = [r for r in rows if r["case"].endswith("clean")]
    return {
        "clean_steps": sum(r["steps"] for r in clean),
        "false_stragglers_clean": sum(r["false_stragglers"] for r in clean),
        "false_incidents_clean": sum(len(r["false_incidents"]) for r in clean),
        "delay_steps": {r["case"]: (r["caught"] or {}).get("delay_steps") for r in rows if r not in clean},
        "cases": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=["real", "scenarios", "all"], default="all")
    parser.add_argument("--scenario", default=None, help="run only scenarios whose name contains this")
    parser.add_argument("--cases", action="store_true", help="print every case, not only the summary")
    parser.add_argument("--stragglers", action="store_true", help="the straggler runs alone (see above)")
    parser.add_argument("--clean-steps", type=int, default=3000, help="--stragglers: the clean run's steps")
    args = parser.parse_args()
    if args.stragglers:
        print(json.dumps({"stragglers": straggler_report(args.clean_steps, args.scenario)}, indent=2))
        return
    config = SeriesConfig()
    report: dict[str, Any] = {}
    if args.only in ("real", "all"):
        rows = [score_case(case, config) for case in clean_controls() + bigscience_cases()]
        report["real_curves"] = {"summary": summarize(rows), **({"cases": rows} if args.cases else {})}
        # The added set (other codebases), reported apart so the development numbers stay as they
        # were; the held-out set (codebases in neither, no threshold set on it) apart again.
        for name, cases in (("added", added_cases()), ("heldout", heldout_cases())):
            scored = score_streams(cases, config)
            report["real_curves"][name] = {
                "summary": summarize(scored),
                "series": by_series(scored),
                **({"cases": scored} if args.cases else {}),
            }
    if args.only in ("scenarios", "all"):
        rows = [score_scenario(outcome) for outcome in run_corpus(args.scenario)]
        for split in ("dev", "holdout"):
            mine = [r for r in rows if r["split"] == split]
            report[f"scenarios_{split}"] = {
                "summary": summarize(mine),
                **({"cases": mine} if args.cases else {}),
            }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
