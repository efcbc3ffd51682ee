"""``runhealth demo``: the main job (four ranks, a bad batch and a failing device, recovered)."""

from __future__ import annotations

from typing import Annotated

import typer

from monitor.cli.options import JsonOption
from monitor.cli.render import UserError, out, print_json


def demo(
    db: Annotated[
        str | None, typer.Option("--db", help="Store for the demo (default: ./runhealth-demo/runhealth.db).")
    ] = None,
    corrupt_step: Annotated[int, typer.Option(help="The update whose batch (on rank 1) is corrupted.")] = 150,
    as_json: JsonOption = False,
) -> None:
    """Four ranks train a small model on the CPU; a bad batch and a failing device are caught,
    diagnosed, approved from the CLI and recovered from."""
    # imported when run: the demo is a composition root that starts trainers (collectors code)
    from monitor.demo.run import DemoConfig, DemoError, run_demo

    try:
        config = DemoConfig(db=db, corrupt_step=corrupt_step, faulty_from=corrupt_step)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    try:
        result = run_demo(config, out, quiet=as_json)
    except DemoError as exc:
        raise UserError(str(exc)) from exc
    if as_json:
        print_json(result)


def register(app: typer.Typer) -> None:
    app.command()(demo)
