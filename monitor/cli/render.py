"""How the CLI prints: tables, one JSON document, times, and a user error as one line."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from monitor.errors import ConfigError
from monitor.judge.series_error import BacktestError
from monitor.recovery.replay_jobs import ReplayError
from monitor.store import queries
from monitor.store.db import StoreError
from monitor.store.floats import dumps

# Tables keep their width when piped (to a file, a pager, a log) instead of folding to 80 columns.
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)


class UserError(Exception):
    """Printed as one line on stderr; the exit status is 2."""


# What the user can fix: each is printed as one line (``runhealth: error: ...``), never a traceback.
USER_ERRORS = (
    UserError,
    ReplayError,
    StoreError,
    BacktestError,
    ConfigError,
    queries.NotFound,
    FileNotFoundError,
)


def print_json(document: Any) -> None:
    sys.stdout.write(dumps(document, indent=True).decode() + "\n")


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    view = Table(title=title, title_justify="left")
    for column in columns:
        view.add_column(column)
    for row in rows:
        view.add_row(*["" if value is None else str(value) for value in row])
    return view


def fmt_time(epoch: float | None) -> str:
    if epoch is None:
        return ""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S")


def fmt_number(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"
