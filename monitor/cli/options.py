"""The options several commands share, and how their values are read (the store, times, who)."""

from __future__ import annotations

import getpass
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Annotated

import sqlalchemy as sa
import typer
from sqlalchemy.engine import Engine

from monitor.cli.render import UserError
from monitor.store import audit, migrate
from monitor.store.db import create_store_engine, resolve_url

DbOption = Annotated[
    str | None,
    typer.Option("--db", help="SQLAlchemy URL or SQLite path (default: $RUNHEALTH_DB, else ./runhealth.db)"),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]
UrlOption = Annotated[
    str | None,
    typer.Option("--url", help="The service (default: $RUNHEALTH_URL, else http://127.0.0.1:8765)."),
]
TokenOption = Annotated[
    str | None, typer.Option("--token", help="Operator token (default: $RUNHEALTH_OPERATOR_TOKEN).")
]
ConfigOption = Annotated[
    str | None,
    typer.Option("--config", help="Settings file, TOML (default: $RUNHEALTH_CONFIG; the environment wins)."),
]


def open_engine(db: str | None, *, must_be_current: bool = True, create: bool = False) -> Engine:
    """The store ``--db`` names. Only ``create`` (``runhealth db upgrade``) makes a new SQLite
    file: elsewhere a mistyped path is ``no store at PATH``, not an empty store left behind."""
    engine = create_store_engine(resolve_url(db, os.environ), create_dir=create, must_exist=not create)
    audit.attach(engine, os.environ)  # what a command writes to the audit log is keyed too
    if must_be_current and not migrate.is_current(engine):
        raise UserError(
            f"the store {engine.url.render_as_string(hide_password=True)} is not at the current "
            "schema (run `runhealth db upgrade`)"
        )
    return engine


@contextmanager
def reading(db: str | None) -> Iterator[sa.Connection]:
    engine = open_engine(db)
    try:
        with engine.connect() as connection:
            yield connection
    finally:
        engine.dispose()


def parse_time(text: str | None) -> float | None:
    """ISO 8601, epoch seconds, or an age like 30m, 2h, 7d (that long ago)."""
    if text is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return datetime.now(UTC).timestamp() - float(text[:-1]) * units[text[-1]]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as exc:
        raise UserError(f"not a time: {text!r} (use ISO 8601, epoch seconds, or 30m/2h/7d)") from exc
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def cli_user() -> str:
    """The OS user running the command: who an approval without an operator token names."""
    return getpass.getuser()


def cli_actor() -> str:
    """Who a store-changing command is recorded as in the audit log."""
    return f"cli:{cli_user()}"
