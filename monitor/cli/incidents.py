"""``runhealth incidents`` (the history, filtered) and ``runhealth incident ID`` (one, with its story)."""

from __future__ import annotations

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
    out.print(evidence_table(found["evidence"]))


def story_table(story: list[dict[str, Any]]) -> Table:
    return table(
        "Story",
        ["#", "time", "who", "what", "subject", "why"],
        [
            [e["seq"], fmt_time(e["time"]), e["actor"], e["action"], e["subject"], e["reason"] or ""]
            for e in story
        ],
    )


def evidence_table(evidence: list[dict[str, Any]]) -> Table:
    return table(
        "Evidence",
        ["step", "kind", "signal", "severity", "value", "threshold", "rank", "message"],
        [
            [
                f["step"],
                f["kind"],
                f["signal"],
                f["severity"],
                fmt_number(f["value"]),
                fmt_number(f["threshold"]),
                f["rank"],
                f["message"],
            ]
            for f in evidence
        ],
    )


def register(app: typer.Typer) -> None:
    app.command()(incidents)
    app.command()(incident)
