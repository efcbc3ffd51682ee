"""``runhealth replay INCIDENT``: run the trainer's replay entry point and record the verdict."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from monitor.cli.options import DbOption, JsonOption, cli_actor, open_engine
from monitor.cli.render import print_json
from monitor.settings import service_config


def replay(
    incident_id: Annotated[int, typer.Argument(metavar="INCIDENT")],
    db: DbOption = None,
    command: Annotated[
        str | None,
        typer.Option(help="Replay entry point with {spec} and {result} (default: the registered one)."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds the replay may take.")] = 3600.0,
    as_json: JsonOption = False,
) -> None:
    """Run the trainer's replay entry point for an incident and record the verdict."""
    from monitor.recovery.replay_verdicts import replay_incident

    # the workflow's settings (retries, quarantine) are the service's, read from this environment
    decision_config = service_config(os.environ).decisions
    engine = open_engine(db)
    result = replay_incident(engine, incident_id, command, timeout, cli_actor(), decision_config)
    if as_json:
        print_json(result)
    else:
        typer.echo(f"replay of incident {incident_id}: {result['verdict']} ({result['reason']})")
        if result.get("proposal"):
            typer.echo(f"new proposal {result['proposal']}")


def register(app: typer.Typer) -> None:
    app.command()(replay)
