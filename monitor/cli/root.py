"""The root ``runhealth`` Typer app and ``main``: a command line registers the one command group
it runs (every group for ``--help``).

To add a command group: write ``monitor/cli/<group>.py`` with its command functions and a
``register(app: typer.Typer) -> None`` that adds them (``app.command()(fn)`` for a top-level
command, or a ``typer.Typer`` sub-app passed to ``app.add_typer(group, name=...)``), then add
the module and the names it registers to ``COMMAND_GROUPS`` below (``tests/test_cli.py`` checks
them). Shared options come from ``monitor.cli.options``, output
from ``monitor.cli.render``; a command raises ``UserError`` for anything the user can fix."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Protocol

import sqlalchemy as sa
import typer

from monitor.cli.render import USER_ERRORS


class CommandGroup(Protocol):
    """A module of commands: it adds them to the root app."""

    def register(self, app: typer.Typer) -> None: ...


# Each module of ``monitor/cli`` and the top-level names it registers, in the order
# ``runhealth --help`` lists them (top-level commands first, then groups, each in this order).
# A command imports its own module only: importing every group made `runhealth incidents` take
# 1.80-2.06 s on these machines against 1.53-1.68 s now (the rest: SQLAlchemy, its models, Alembic).
COMMAND_GROUPS: dict[str, tuple[str, ...]] = {
    "serve": ("serve",),
    "db": ("db",),
    "runs": ("runs",),
    "incidents": ("incidents", "incident"),
    "backtest": ("backtest",),
    "export": ("export",),
    "demo": ("demo",),
    "proposals": ("proposals", "approve", "reject"),
    "operators": ("operators",),
    "checkpoints": ("checkpoints",),
    "gate": ("gate",),
    "goodput": ("goodput",),
    "preflight": ("preflight",),
    "drill": ("drill", "drills"),
    "replay": ("replay",),
    "audit": ("audit",),
    "spool": ("spool",),
    "config": ("config",),
}


def group_module(name: str) -> CommandGroup:
    module: CommandGroup = importlib.import_module(f"monitor.cli.{name}")
    return module


def groups_for(argv: Sequence[str]) -> tuple[str, ...]:
    """The modules a command line needs: the one that registers its command, or every one (no
    command, ``--help``, or a name no module registers, which click then answers with its list)."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    owners = tuple(group for group, names in COMMAND_GROUPS.items() if command in names)
    return owners or tuple(COMMAND_GROUPS)


def build_app(groups: Sequence[str] = tuple(COMMAND_GROUPS)) -> typer.Typer:
    root = typer.Typer(
        name="runhealth",
        help="Run-health monitor and rollback service for large-model training.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    # A callback keeps the root a group of commands when only one module is registered (Typer
    # makes an app of a single command that command itself).
    root.callback()(lambda: None)
    for group in groups:
        group_module(group).register(root)
    return root


def main(argv: Sequence[str] | None = None) -> None:
    """Run the CLI; a user error is one line on stderr and exit status 2, never a traceback."""
    try:
        # standalone mode: usage errors print click's own message and exit 2
        args = list(argv) if argv is not None else sys.argv[1:]
        build_app(groups_for(args))(args=args, standalone_mode=True)
    except USER_ERRORS as exc:
        typer.echo(f"runhealth: error: {exc}", err=True)
        raise SystemExit(2) from None
    except sa.exc.OperationalError as exc:
        typer.echo(f"runhealth: error: the store is unavailable: {exc.orig}", err=True)
        raise SystemExit(2) from None
