"""``runhealth runs [create NAME]``: list runs; create one and print its ingest token."""

from __future__ import annotations

import typer

from monitor.cli.options import DbOption, JsonOption, open_engine, reading
from monitor.cli.render import UserError, fmt_time, out, print_json, table
from monitor.store import queries
from monitor.store.leases import judges_by_name
from policies.protocol import RUN_NAME, value_problem


def runs(ctx: typer.Context, db: DbOption = None, as_json: JsonOption = False) -> None:
    """List runs."""
    if ctx.invoked_subcommand is not None:
        return
    with reading(db) as connection:
        rows = queries.list_runs(connection)
        # On PostgreSQL, several replicas may serve: which one judges each run (its lease).
        replicated = connection.dialect.name == "postgresql"
        judges = judges_by_name(connection) if replicated else {}
    if replicated:
        rows = [{**r, "judged_by": judges.get(r["name"])} for r in rows]
    if as_json:
        print_json({"runs": rows})
        return
    columns = ["run", "created", "latest step", "windows", "last record", "open incidents"]
    out.print(
        table(
            "Runs",
            [*columns, "judged by"] if replicated else columns,
            [
                [
                    r["name"],
                    fmt_time(r["created_at"]),
                    r["latest_step"],
                    r["windows"],
                    fmt_time(r["last_record_at"]),
                    r["open_incidents"],
                    *([r["judged_by"] or "-"] if replicated else []),
                ]
                for r in rows
            ],
        )
    )


def runs_create(name: str, db: DbOption = None, as_json: JsonOption = False) -> None:
    """Create a run and print its ingest token (shown once; only a digest is stored)."""
    problem = value_problem(RUN_NAME, name)
    if problem is not None:  # the API, and so the hook, would refuse it
        raise UserError(f"{name!r} is not a run name: {problem}")
    engine = open_engine(db)
    try:
        with engine.begin() as connection:
            token = queries.create_run(connection, name)
    except queries.AlreadyExists as exc:
        raise UserError(str(exc)) from exc
    if as_json:
        print_json({"run": name, "token": token})
    else:
        typer.echo(token)


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Runs: list them, or create one and get its token.")
    group.callback(invoke_without_command=True)(runs)
    group.command("create")(runs_create)
    app.add_typer(group, name="runs")
