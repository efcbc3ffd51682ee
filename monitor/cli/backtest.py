"""``runhealth backtest FILE``: the policies over a recorded series, and the findings they give."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from monitor.cli.options import JsonOption
from monitor.cli.render import UserError, out, print_json, table
from policies.series import SeriesConfig
from policies.spike import SpikeConfig

PRESETS: Mapping[str, Callable[[], SpikeConfig]] = {
    "calibrated": SpikeConfig,
    "authored": SpikeConfig.authored,
}


def backtest_command(
    # Not click's readable check: its refusal is a usage box; the reader's is one line.
    file: Annotated[Path, typer.Argument(readable=False)],
    run: Annotated[str | None, typer.Option(help="Only this run (when the file has a run column).")] = None,
    column: Annotated[
        list[str] | None,
        typer.Option(help="Map a column of the file to a field: SRC=FIELD (repeatable)."),
    ] = None,
    preset: Annotated[
        str,
        typer.Option(help="Spike thresholds: calibrated (default) or authored (median+3sd/50)."),
    ] = "calibrated",
    as_json: JsonOption = False,
) -> None:
    """Run the policies over a recorded series (CSV or JSONL with a step column, a training log, a
    Hugging Face trainer_state.json, or TensorBoard event files: one, or a directory of runs)."""
    if preset not in PRESETS:
        raise UserError(f"--preset must be one of {', '.join(PRESETS)}, not {preset!r}")
    config = SeriesConfig(loss_spike=PRESETS[preset]())
    # The readers bring polars: loaded when a backtest runs, not by every command's start.
    from monitor.judge.backtest import backtest_file, parse_mapping, report_json

    # The file is read as it is judged: memory holds the findings, not the file.
    reports, notes = backtest_file(file, parse_mapping(column or []), run, config)
    document = report_json(reports, notes, file)
    if as_json:
        print_json(document)
        return
    for note in document["notes"]:
        typer.echo(f"note: {note}", err=True)
    print_report(document)


def print_report(document: dict[str, Any]) -> None:
    several = isinstance(document["run"], list)  # a file of several runs names each incident's run
    out.print(
        f"{document['steps']} logged steps, {len(document['incidents'])} incidents, {len(document['findings'])} findings"
    )
    out.print(
        table(
            "Incidents",
            (["run"] if several else []) + ["id", "kind", "severity", "first step", "last step", "summary"],
            [
                ([i["run"]] if several else [])
                + [i["id"], i["kind"], i["severity"], i["first_step"], i["last_step"], i["summary"]]
                for i in document["incidents"]
            ],
        )
    )


def register(app: typer.Typer) -> None:
    app.command("backtest")(backtest_command)
