"""``runhealth db upgrade|downgrade|current``: the store's schema."""

from __future__ import annotations

from typing import Annotated

import typer

from monitor.cli.options import DbOption, open_engine
from monitor.store import migrate


def db_upgrade(
    db: DbOption = None,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Bring the store to the current schema (creates it when new)."""
    engine = open_engine(db, must_be_current=False)
    migrate.upgrade(engine, revision)
    typer.echo(f"store at revision {migrate.current_revision(engine)}")


def db_downgrade(revision: str, db: DbOption = None) -> None:
    """Step the store's schema back to REVISION (``base`` removes every table)."""
    engine = open_engine(db, must_be_current=False)
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
