"""``runhealth db upgrade|downgrade|current``: the store's schema."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from monitor.cli.options import DbOption, open_engine
from monitor.cli.render import UserError
from monitor.store import migrate


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


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="The store's schema.", no_args_is_help=True)
    group.command("upgrade")(db_upgrade)
    group.command("downgrade")(db_downgrade)
    group.command("current")(db_current)
    app.add_typer(group, name="db")
