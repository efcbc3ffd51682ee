"""``runhealth incidents`` (the history, filtered) and ``runhealth incident ID`` (one, with its story)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import typer
from rich.table import Table

from monitor.cli.options import DbOption, JsonOption, parse_time, reading
from monitor.cli.render import UserError, fmt_number, fmt_time, out, print_json, table
from monitor.store import queries

INCIDENT_COLUMNS = ["id", "run", "kind", "severity", "status", "first step", "last step", "opened", "summary"]


def incidents(
    db: DbOption = None,
    run: Annotated[str | None, typer.Option(help="Only this run.")] = None,
    kind: Annotated[str | None, typer.Option(help="Only this kind (spike, nonfinite, ...).")] = None,
    severity: Annotated[str | None, typer.Option(help="info, warning or critical.")] = None,
    status: Annotated[str | None, typer.Option(help="open or resolved.")] = None,
    node: Annotated[str | None, typer.Option(help="Only incidents involving this node.")] = None,
    since: Annotated[str | None, typer.Option(help="Opened at or after (ISO, epoch, or 2h).")] = None,
    until: Annotated[str | None, typer.Option(help="Opened at or before.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List incidents, newest last."""
    if severity is not None and severity not in ("info", "warning", "critical"):
        raise UserError(f"--severity must be info, warning or critical, not {severity!r}")
    where = queries.IncidentFilter(
        run=run,
        kind=kind,
        severity=severity,
        status=status,
        node=node,
        since=parse_time(since),
        until=parse_time(until),
    )
    with reading(db) as connection:
        rows = queries.list_incidents(connection, where)
    if as_json:
        print_json({"incidents": rows})
        return
    out.print(table("Incidents", INCIDENT_COLUMNS, [incident_row(r) for r in rows]))


def incident_row(r: dict[str, Any]) -> list[Any]:
    return [
        r["id"],
        r["run"],
        r["kind"],
        r["severity"],
        r["status"],
        r["first_step"],
        r["last_step"],
        fmt_time(r["opened_at"]),
        r["summary"],
    ]


def incident(
    incident_id: Annotated[int, typer.Argument(metavar="ID")],
    db: DbOption = None,
    as_json: JsonOption = False,
    every: Annotated[
        bool,
        typer.Option("--all", help="One row per finding (by default a run of consecutive steps is one row)."),
    ] = False,
) -> None:
    """Show one incident and its evidence, in order."""
    with reading(db) as connection:
        try:
            found = queries.get_incident(connection, incident_id)
        except queries.NotFound as exc:
            raise UserError(str(exc)) from exc
    if as_json:
        print_json(found)
        return
    out.print(
        f"[bold]Incident {found['id']}[/bold] {found['kind']} ({found['severity']}, {found['status']}) "
        f"run {found['run']}, steps {found['first_step']}..{found['last_step']}"
    )
    out.print(found["summary"])
    if found.get("story"):
        out.print(story_table(found["story"]))
    out.print(evidence_table(found["evidence"], every))


def story_table(story: list[dict[str, Any]]) -> Table:
    return table(
        "Story",
        ["#", "time", "who", "what", "subject", "why"],
        [
            [e["seq"], fmt_time(e["time"]), e["actor"], e["action"], e["subject"], e["reason"] or ""]
            for e in story
        ],
    )


@dataclass(frozen=True)
class EvidenceRun:
    """Findings of one kind, signal, severity and rank at consecutive steps: one row."""

    first: dict[str, Any]
    last_step: int
    count: int
    low: float | None
    high: float | None


def _key(finding: dict[str, Any]) -> tuple[Any, ...]:
    return finding["kind"], finding["signal"], finding["severity"], finding["rank"]


def _spread(low: float | None, high: float | None, value: float | None) -> tuple[float | None, float | None]:
    if value is None or math.isnan(value):
        return low, high
    return (value if low is None else min(low, value)), (value if high is None else max(high, value))


def collapse_evidence(evidence: list[dict[str, Any]]) -> list[EvidenceRun]:
    """Consecutive steps' findings of the same kind, signal, severity and rank as one run each,
    ordered by first step: a NaN that persisted for 600 windows is one row, not 1,800."""
    open_runs: dict[tuple[Any, ...], EvidenceRun] = {}
    done: list[EvidenceRun] = []
    for finding in evidence:
        key, value = _key(finding), finding["value"]
        current = open_runs.get(key)
        if current is not None and finding["step"] in (current.last_step, current.last_step + 1):
            low, high = _spread(current.low, current.high, value)
            open_runs[key] = EvidenceRun(current.first, finding["step"], current.count + 1, low, high)
            continue
        if current is not None:
            done.append(current)
        low, high = _spread(None, None, value)
        open_runs[key] = EvidenceRun(finding, finding["step"], 1, low, high)
    done.extend(open_runs.values())
    return sorted(done, key=lambda r: (r.first["step"], str(r.first["kind"]), str(r.first["signal"])))


def _shown_value(run: EvidenceRun) -> str:
    value = run.first["value"]
    if run.count == 1 or run.low is None or run.low == run.high:
        return fmt_number(value)
    return f"{fmt_number(run.low)}..{fmt_number(run.high)}"


def evidence_table(evidence: list[dict[str, Any]], every: bool = False) -> Table:
    runs = (
        [EvidenceRun(f, f["step"], 1, None, None) for f in evidence] if every else collapse_evidence(evidence)
    )
    return table(
        "Evidence",
        ["step", "kind", "signal", "severity", "value", "threshold", "rank", "message"],
        [
            [
                run.first["step"] if run.count == 1 else f"{run.first['step']}..{run.last_step}",
                run.first["kind"],
                run.first["signal"],
                run.first["severity"],
                _shown_value(run),
                fmt_number(run.first["threshold"]),
                run.first["rank"],
                run.first["message"]
                if run.count == 1
                else f"{run.first['message']} (and {run.count - 1} more)",
            ]
            for run in runs
        ],
    )


def register(app: typer.Typer) -> None:
    app.command()(incidents)
    app.command()(incident)
