"""``runhealth drill``: the restart drills against the user's trainer; ``runhealth drills RUN``."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from monitor.cli.options import DbOption, JsonOption, cli_actor, open_engine, reading
from monitor.cli.render import UserError, fmt_time, out, print_json, table

NAMES = ("continuity", "topology", "preemption", "diagnostics")


def drill(
    which: Annotated[str, typer.Argument(metavar="DRILL", help=f"{', '.join(NAMES)}, or all.")] = "all",
    command: Annotated[
        str,
        typer.Option(
            "--command",
            help="The trainer: a command template; fields it does not name ({steps}, "
            "{checkpoint_dir}, {resume_from}, ...) are appended as flags (--steps N).",
        ),
    ] = "",
    run: Annotated[
        str, typer.Option("--run", help="The run this rehearses: `runhealth drills RUN` lists it.")
    ] = "",
    steps: Annotated[
        int, typer.Option(help="N: updates before the interruption (and the save interval).")
    ] = 5,
    resume_steps: Annotated[int, typer.Option(help="M: updates after the resume (continuity).")] = 5,
    workdir: Annotated[
        Path | None, typer.Option(help="Logs and checkpoints (default: ./runhealth-drills/<run>-<time>).")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds one trainer run may take.")] = 600.0,
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Run the restart drills against your trainer, print a verdict per check, record them.

    Exit status 1 when a check failed."""
    from monitor.drills.context import DrillContext
    from monitor.drills.convention import DrillError, TrainerCommand
    from monitor.drills.reports import record
    from monitor.drills.runner import run_drill
    from monitor.settings import service_config

    names = NAMES if which == "all" else (which,)
    if which not in (*NAMES, "all"):
        raise UserError(f"no drill {which!r} (choose from {', '.join(NAMES)}, all)")
    if not command:
        raise UserError("--command is required: the trainer's command template")
    if not run:
        raise UserError("--run is required: the run the drill rehearses")
    if steps < 1 or resume_steps < 1 or timeout <= 0:
        raise UserError("--steps and --resume-steps must be >= 1, --timeout > 0")
    config = service_config(os.environ).drills
    engine = open_engine(db)  # before minutes of drills: a store that cannot take the report fails now
    base = workdir or Path("runhealth-drills") / f"{run}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        trainer = TrainerCommand(command)
        context = DrillContext(trainer, base.resolve(), config, steps, resume_steps, timeout)
        results = []
        for name in names:
            result = run_drill(name, context)
            with engine.begin() as connection:
                settings = {"steps": steps, "resume_steps": resume_steps, **dataclasses.asdict(config)}
                report = record(connection, run, result, command, settings, cli_actor())
            results.append({"id": report, **result.document()})
            if not as_json:
                _print(results[-1])
    except DrillError as exc:
        raise UserError(str(exc)) from exc
    finally:
        engine.dispose()
    if as_json:
        print_json({"run": run, "verdict": _overall(results), "drills": results})
    if _overall(results) != "pass":
        raise typer.Exit(1)


def _overall(results: list[dict[str, Any]]) -> str:
    return "pass" if all(r["verdict"] == "pass" for r in results) else "fail"


def _print(result: dict[str, Any]) -> None:
    typer.echo(
        f"{result['drill']}: {result['verdict'].upper()} ({result['seconds']:g} s, report {result['id']})"
    )
    for check in result["checks"]:
        typer.echo(f"  {'pass' if check['passed'] else 'FAIL'}  {check['name']}: {check['detail']}")
    typer.echo(f"  logs and checkpoints: {result['workdir']}")


def drills(
    run: Annotated[str, typer.Argument(metavar="RUN")],
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """List the restart drills recorded for a run."""
    from monitor.drills.reports import list_reports

    with reading(db) as connection:
        reports = list_reports(connection, run)
    if as_json:
        print_json(reports)
        return
    rows = [
        [
            r["id"],
            r["drill"],
            r["verdict"],
            f"{sum(c['passed'] for c in r['checks'])}/{len(r['checks'])}",
            ", ".join(c["name"] for c in r["checks"] if not c["passed"]),
            fmt_time(r["started_at"]),
            f"{r['finished_at'] - r['started_at']:.0f} s",
        ]
        for r in reports
    ]
    out.print(
        table(f"drills of {run}", ["id", "drill", "verdict", "passed", "failed", "started", "took"], rows)
    )


def register(app: typer.Typer) -> None:
    app.command()(drill)
    app.command()(drills)
