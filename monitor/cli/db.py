"""``runhealth db upgrade|downgrade|current``: the store's schema."""

from __future__ import annotations

import os
import sys
import time
from typing import Annotated

import typer

from monitor.cli.options import ConfigOption, DbOption, JsonOption, open_engine
from monitor.cli.render import UserError, fmt_time, out, print_json, table
from monitor.settings import service_config
from monitor.store import migrate
from monitor.store.usage import Usage, usage


def db_upgrade(
    db: DbOption = None,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Bring the store to the current schema (creates it when new)."""
    engine = open_engine(db, must_be_current=False, create=True)
    migrate.upgrade(engine, revision)
    typer.echo(f"store at revision {migrate.current_revision(engine)}")


def db_downgrade(
    revision: str,
    db: DbOption = None,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
) -> None:
    """Step the store's schema back to REVISION (``base`` removes every table). Asks first,
    unless ``--yes``: what the dropped tables held is gone."""
    engine = open_engine(db, must_be_current=False)
    shown = engine.url.render_as_string(hide_password=True)
    if not yes:
        if not sys.stdin.isatty():
            engine.dispose()
            raise UserError(
                f"db downgrade drops data from {shown}: confirm it with --yes (no terminal to ask on)"
            )
        if not typer.confirm(
            f"Downgrade {shown} from {migrate.current_revision(engine)} to {revision}? "
            "Tables and columns added since are dropped with their data."
        ):
            engine.dispose()
            raise UserError("db downgrade: not confirmed; nothing changed")
    migrate.downgrade(engine, revision)
    typer.echo(f"store at revision {migrate.current_revision(engine)}")


def db_current(db: DbOption = None) -> None:
    """Print the store's schema revision and the newest one this version knows."""
    engine = open_engine(db, must_be_current=False)
    typer.echo(f"current {migrate.current_revision(engine)}, head {migrate.head_revision()}")


def db_usage(db: DbOption = None, config_file: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Rows and bytes per table, and what retention drops next (its period from the settings,
    RUNHEALTH_RETENTION__RAW_DAYS)."""
    retention = service_config(os.environ, file=config_file).retention
    engine = open_engine(db)
    try:
        with engine.connect() as connection:
            found = usage(connection, retention)
    finally:
        engine.dispose()
    if as_json:
        print_json(found.as_json())
        return
    _print_usage(found)


def _print_usage(found: Usage) -> None:
    rows = [
        (t.table, f"{'~' if t.rows_estimated else ''}{t.rows:,}", _size(t.bytes), t.partitions)
        for t in found.tables
    ]
    out.print(
        table(f"{found.backend} store: {_size(found.total_bytes)}", ["table", "rows", "bytes", "days"], rows)
    )
    if found.retention_days == 0:
        out.print("retention: raw records are kept for ever (retention.raw_days = 0)")
        return
    if not found.next_drops:
        out.print(f"retention: no raw records yet (kept {found.retention_days:g} days)")
        return
    now = time.time()
    drops = [
        (
            d.table,
            d.partition or "rows",
            f"{fmt_time(d.start)} .. {fmt_time(d.end)}"
            if d.start is not None
            else f"before {fmt_time(d.end)}",
            fmt_time(d.due_at) if d.due_at > now else "at the next pass",
            f"{d.rows:,}",
            _size(d.bytes),
        )
        for d in found.next_drops
    ]
    title = f"retention drops next (raw records kept {found.retention_days:g} days)"
    out.print(
        table(title, ["table", "partition", "records from .. to (UTC)", "due (UTC)", "rows", "bytes"], drops)
    )


def _size(value: int | None) -> str:
    if value is None:
        return "?"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    size, unit = float(value), 0
    while size >= 1024 and unit < len(units) - 1:
        size, unit = size / 1024, unit + 1
    return f"{value:,} B" if unit == 0 else f"{size:,.1f} {units[unit]}"


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="The store's schema.", no_args_is_help=True)
    group.command("upgrade")(db_upgrade)
    group.command("downgrade")(db_downgrade)
    group.command("current")(db_current)
    group.command("usage")(db_usage)
    app.add_typer(group, name="db")
