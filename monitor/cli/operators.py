"""``runhealth operators add|revoke|list``: who may approve or reject proposals."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from monitor.cli.options import DbOption, JsonOption, cli_actor, open_engine, reading
from monitor.cli.render import UserError, fmt_time, out, print_json, table


def operators_add(name: str, db: DbOption = None, as_json: JsonOption = False) -> None:
    """Create an operator and print their token (shown once)."""
    from monitor.store.operators import OperatorError, add_operator

    engine = open_engine(db)
    try:
        with engine.begin() as connection:
            token = add_operator(connection, name, actor=cli_actor(), now=time.time())
    except OperatorError as exc:
        raise UserError(str(exc)) from exc
    if as_json:
        print_json({"operator": name, "token": token})
    else:
        typer.echo(token)


def operators_revoke(
    name: str, reason: Annotated[str | None, typer.Option(help="Why.")] = None, db: DbOption = None
) -> None:
    """Revoke an operator's token: it can no longer approve or reject."""
    from monitor.store.operators import OperatorError, revoke_operator

    engine = open_engine(db)
    try:
        with engine.begin() as connection:
            revoke_operator(connection, name, actor=cli_actor(), now=time.time(), reason=reason)
    except OperatorError as exc:
        raise UserError(str(exc)) from exc
    typer.echo(f"operator {name} revoked")


def operators_list(db: DbOption = None, as_json: JsonOption = False) -> None:
    """List operators."""
    from monitor.store.operators import list_operators

    with reading(db) as connection:
        listed = list_operators(connection)
    if as_json:
        print_json({"operators": listed})
        return
    out.print(
        table(
            "Operators",
            ["name", "created", "revoked"],
            [[o["name"], fmt_time(o["created_at"]), fmt_time(o["revoked_at"])] for o in listed],
        )
    )


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Operators who approve or reject proposals.", no_args_is_help=True)
    group.command("add")(operators_add)
    group.command("revoke")(operators_revoke)
    group.command("list")(operators_list)
    app.add_typer(group, name="operators")
