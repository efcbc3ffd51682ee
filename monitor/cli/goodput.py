"""``runhealth goodput RUN``: where the run's wall time went, and the checkpoint interval to use.

Productive training and badput by cause over the run's incarnations (``policies.goodput``), each
figure with how it was measured, and Young/Daly's checkpoint interval from the run's measured
save cost and interruptions (``policies.checkpoint_interval``), with the arithmetic."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from monitor.cli.options import ConfigOption, DbOption, JsonOption, reading
from monitor.cli.render import out, print_json, table
from monitor.judge.goodput import document, run_goodput
from monitor.settings import service_config
from monitor.store import queries


def goodput(
    run: Annotated[str, typer.Argument(help="The run.")],
    db: DbOption = None,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Goodput and badput by cause over the run's incarnations, and checkpoint interval advice."""
    settings = service_config(os.environ, file=config)
    with reading(db) as connection:
        run_id = int(queries.run_row(connection, run).id)
        report = document(
            run_goodput(connection, run_id, settings.engine.checkpoint_interval, settings.engine.hangs)
        )
    if as_json:
        print_json({"run": run, **report})
        return
    _print(run, report)


def _print(run: str, report: dict[str, Any]) -> None:
    ratio = report["goodput_ratio"]
    rows = [
        [
            c["label"],
            "not measured" if c["seconds"] is None else f"{c['seconds']:.1f}",
            "" if c["share"] is None else f"{100 * c['share']:.1f}%",
            c["how"],
        ]
        for c in report["categories"]
    ]
    title = (
        f"Goodput of {run}: {'unknown' if ratio is None else f'{100 * ratio:.1f}%'} of "
        f"{report['wall_s']:.1f} s wall over {report['incarnations']} incarnation(s), "
        f"{report['interruptions']} interruption(s)"
    )
    out.print(table(title, ["cause", "seconds", "share", "how it was measured"], rows))
    monitoring = report["monitoring"]
    if monitoring["late_windows"]:
        typer.echo(
            f"monitoring: {monitoring['late_windows']} window(s) reached the store more than "
            f"{monitoring['late_threshold_s']:.1f} s late (up to {monitoring['latest_s']:.1f} s): "
            f"{monitoring['note']}"
        )
    typer.echo("checkpoint interval (Young/Daly):")
    for line in report["interval"]["arithmetic"]:
        typer.echo(f"  {line}")


def register(app: typer.Typer) -> None:
    app.command()(goodput)
