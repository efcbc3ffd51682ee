"""``runhealth gate RUN``: whether a launcher should start the run again.

Exit status 0: go on. 93: do not requeue, the run is in a restart loop (an open
``restart_loop`` incident: ``policies.restart_loop``); 93 is the status nvidia-resiliency-ext's
launcher uses for the same verdict, so a wrapper that already stops on it needs no change. 2:
the command could not answer (no such run, no store). ``--json`` prints why either way."""

from __future__ import annotations

from typing import Annotated, Any

import sqlalchemy as sa
import typer

from monitor.cli.options import DbOption, JsonOption, reading
from monitor.cli.render import print_json
from monitor.store import models, queries
from policies.restart_loop import KIND

DO_NOT_REQUEUE = 93
INCIDENT = models.table_of(models.Incident)


def blocking(connection: sa.Connection, run_id: int) -> list[dict[str, Any]]:
    """The open incidents that say the run must not be started again."""
    rows = connection.execute(
        sa.select(INCIDENT.c.id, INCIDENT.c.kind, INCIDENT.c.summary).where(
            INCIDENT.c.run_id == run_id, INCIDENT.c.kind == KIND, INCIDENT.c.status == "open"
        )
    ).all()
    return [{"kind": row.kind, "incident": row.id, "summary": row.summary} for row in rows]


def gate(
    run: Annotated[str, typer.Argument(help="The run a launcher is about to start again.")],
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Exit 0 if the run may start again, 93 if it must not be requeued (restart loop)."""
    with reading(db) as connection:
        reasons = blocking(connection, int(queries.run_row(connection, run).id))
    status = DO_NOT_REQUEUE if reasons else 0
    if as_json:
        print_json({"run": run, "ok": not reasons, "exit_status": status, "reasons": reasons})
    elif reasons:
        for reason in reasons:
            typer.echo(f"do not requeue {run}: incident {reason['incident']}: {reason['summary']}", err=True)
    else:
        typer.echo(f"{run} may start again")
    raise SystemExit(status)


def register(app: typer.Typer) -> None:
    app.command()(gate)
