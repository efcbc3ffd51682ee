"""The root ``runhealth`` Typer app: every command group registered, and ``main``.

To add a command group: write ``monitor/cli/<group>.py`` with its command functions and a
``register(app: typer.Typer) -> None`` that adds them (``app.command()(fn)`` for a top-level
command, or a ``typer.Typer`` sub-app passed to ``app.add_typer(group, name=...)``), then append
the module to ``COMMAND_GROUPS`` below. Shared options come from ``monitor.cli.options``, output
from ``monitor.cli.render``; a command raises ``UserError`` for anything the user can fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import sqlalchemy as sa
import typer

from monitor.cli import (
    audit,
    backtest,
    checkpoints,
    config,
    db,
    demo,
    drill,
    export,
    gate,
    goodput,
    incidents,
    operators,
    preflight,
    proposals,
    replay,
    runs,
    serve,
    spool,
)
from monitor.cli.render import USER_ERRORS


class CommandGroup(Protocol):
    """A module of commands: it adds them to the root app."""

    def register(self, app: typer.Typer) -> None: ...


# In the order ``runhealth --help`` lists them (top-level commands first, then groups, each in this order).
COMMAND_GROUPS: tuple[CommandGroup, ...] = (
    serve,
    db,
    runs,
    incidents,
    backtest,
    export,
    demo,
    proposals,
    operators,
    checkpoints,
    gate,
    goodput,
    preflight,
    drill,
    replay,
    audit,
    spool,
    config,
)


def build_app() -> typer.Typer:
    root = typer.Typer(
        name="runhealth",
        help="Run-health monitor and rollback service for large-model training.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    for group in COMMAND_GROUPS:
        group.register(root)
    return root


app = build_app()


def main(argv: Sequence[str] | None = None) -> None:
    """Run the CLI; a user error is one line on stderr and exit status 2, never a traceback."""
    try:
        # standalone mode: usage errors print click's own message and exit 2
        app(args=list(argv) if argv is not None else None, standalone_mode=True)
    except USER_ERRORS as exc:
        typer.echo(f"runhealth: error: {exc}", err=True)
        raise SystemExit(2) from None
    except sa.exc.OperationalError as exc:
        typer.echo(f"runhealth: error: the store is unavailable: {exc.orig}", err=True)
        raise SystemExit(2) from None
