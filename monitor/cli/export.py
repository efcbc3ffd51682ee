"""``runhealth export RUN --out FILE``: a run's history as Parquet or CSV."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from monitor.cli.options import DbOption, reading
from monitor.cli.render import UserError
from monitor.store import queries


def export(
    run: str,
    output: Annotated[Path, typer.Option("--out", "-o", help="File to write (.parquet or .csv).")],
    what: Annotated[str, typer.Option(help="steps, records, findings or incidents.")] = "steps",
    db: DbOption = None,
) -> None:
    """Write a run's steps, per-rank records, findings or incident history to Parquet or CSV."""
    from monitor.store.export import EXPORTS, write_export

    if what not in EXPORTS:
        raise UserError(f"--what must be one of {', '.join(EXPORTS)}, not {what!r}")
    if output.suffix.lower() not in (".parquet", ".csv"):
        raise UserError(f"--out {output}: the file name must end in .parquet or .csv")
    with reading(db) as connection:
        try:
            count = write_export(connection, run, what, output)
        except queries.NotFound as exc:
            raise UserError(str(exc)) from exc
    typer.echo(f"wrote {count} {what} rows to {output}")


def register(app: typer.Typer) -> None:
    app.command()(export)
